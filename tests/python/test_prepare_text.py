"""prepare_text.py: bad flags refused by name before any work (a zero --val-every divided, a negative
--doc-chars looped forever), --val-every that would leave a split empty refused with the file count, a missing
--source or an --out that is a file refused without a traceback, and nothing half-written: a run that fails
while writing leaves the previous data set as it was, and one stopped while moving files into place leaves no
vocab.bin (what `make train-demo` looks for). Loaded from its file with a byte-level stand-in for the
`tokenizers` package, so it needs neither that nor the native module."""

import errno
import importlib.util
import os
import pathlib
import struct
import sys
import types

import pytest

PREPARE = pathlib.Path(__file__).resolve().parents[2] / "python" / "deltatrain" / "prepare_text.py"


@pytest.fixture
def prepare():
    spec = importlib.util.spec_from_file_location("prepare_text_under_test", PREPARE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tokenizers_module(prepare, usable=True):
    """A stand-in for `tokenizers`: one token a byte (ids 0-255, written in the byte-level table's characters),
    so the rest of prepare_text runs unchanged; or, unusable, one that fails the test if a run gets that far."""

    class ByteLevelBPETokenizer:
        def __init__(self):
            assert usable, "prepare_text reached the tokenizer; the bad input should have been refused before"

        def train_from_iterator(self, texts, vocab_size, min_frequency, show_progress):
            pass

        def get_vocab(self):
            return dict(prepare.byte_decoder())

        def encode_batch(self, texts):
            return [types.SimpleNamespace(ids=list(t.encode("utf-8"))) for t in texts]

    return types.SimpleNamespace(ByteLevelBPETokenizer=ByteLevelBPETokenizer)


def corpus(directory, rng, files):
    """`files` random texts of paragraphs split by blank lines, as directory/text-NN.txt; the texts in name order."""
    directory.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(files):
        paragraphs = []
        for _ in range(int(rng.integers(1, 12))):
            words = ["".join(rng.choice(list("abcdefghij"), int(rng.integers(1, 8))))
                     for _ in range(rng.integers(1, 40))]
            paragraphs.append(" ".join(words))
        texts.append("\n\n".join(paragraphs) + "\n")
        (directory / f"text-{i:02d}.txt").write_text(texts[-1])
    return texts


def run(prepare, argv):
    """(exit code, stderr and exit message together); 0 for a run that returned."""
    try:
        prepare.main([str(a) for a in argv])
    except SystemExit as e:
        return e.code, str(e.code)
    return 0, ""


def read_shard(path):
    data = pathlib.Path(path).read_bytes()
    magic, version, _, vocab_size, tokens, documents = struct.unpack_from("<8sIIQQQ", data)
    assert magic == b"DTSHARD\0"
    at = struct.calcsize("<8sIIQQQ")
    offsets = struct.unpack_from(f"<{documents + 1}Q", data, at)
    ids = struct.unpack_from(f"<{tokens}I", data, at + 8 * (documents + 1))
    return [list(ids[offsets[d]:offsets[d + 1]]) for d in range(documents)]


def snapshot(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


@pytest.mark.parametrize("flag", ["--val-every", "--doc-chars", "--shard-tokens", "--vocab-size"])
def test_bad_numbers_are_refused_by_flag_before_any_work(prepare, tmp_path, rng, monkeypatch, capsys, flag):
    monkeypatch.setitem(sys.modules, "tokenizers", tokenizers_module(prepare, usable=False))
    corpus(tmp_path / "src", rng, int(rng.integers(2, 6)))
    least = {"--val-every": 2, "--doc-chars": 1, "--shard-tokens": 1, "--vocab-size": 257}[flag]
    for value in (least - 1, int(rng.integers(-10**6, least - 1)), -int(rng.integers(1, 10**9))):
        code, message = run(prepare, ["--out", tmp_path / "out", "--source", tmp_path / "src", flag, value])
        err = capsys.readouterr().err
        assert code == 2 and f"{flag} must be at least {least}" in err and f"got {value}" in err, err
        assert not (tmp_path / "out").exists()


def test_val_every_must_leave_files_in_both_splits(prepare, tmp_path, rng, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tokenizers", tokenizers_module(prepare, usable=False))
    files = int(rng.integers(2, 10))
    corpus(tmp_path / "src", rng, files)
    for value in (1, files + 1, files + int(rng.integers(2, 100))):
        code, _ = run(prepare, ["--out", tmp_path / "out", "--source", tmp_path / "src", "--val-every", value])
        err = capsys.readouterr().err
        assert code == 2 and "--val-every" in err and f"got {value}" in err, err
        if value > 1:
            assert f"({files} in {tmp_path / 'src'})" in err
        assert not (tmp_path / "out").exists()


def test_a_run_writes_both_splits_token_for_token(prepare, tmp_path, rng, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tokenizers", tokenizers_module(prepare))
    files = int(rng.integers(2, 10))
    texts = corpus(tmp_path / "src", rng, files)
    val_every, doc_chars = int(rng.integers(2, files + 1)), int(rng.integers(1, 300))
    shard_tokens = int(rng.integers(1, 2000))
    out = tmp_path / "out"
    argv = ["--out", out, "--source", tmp_path / "src", "--val-every", val_every, "--doc-chars", doc_chars,
            "--shard-tokens", shard_tokens]
    assert run(prepare, argv) == (0, "")
    assert "training shards" in capsys.readouterr().out
    expected = {False: [], True: []}
    for i, text in enumerate(texts):
        expected[i % val_every == val_every - 1] += [list(p.encode()) for p in prepare.passages(text, doc_chars)]
    assert expected[False] and expected[True]
    shards = sorted(n for n in os.listdir(out) if n.startswith("train-"))
    assert sorted(os.listdir(out)) == shards + ["val.bin", "vocab.bin"]  # nothing left of the staging directory
    assert [d for name in shards for d in read_shard(out / name)] == expected[False]
    assert read_shard(out / "val.bin") == expected[True]


def test_a_split_without_text_is_refused_and_nothing_written(prepare, tmp_path, rng, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", tokenizers_module(prepare))
    files = int(rng.integers(2, 10))
    corpus(tmp_path / "src", rng, files)
    val_every = int(rng.integers(2, files + 1))
    for i in range(val_every - 1, files, val_every):  # the held-out files, emptied
        (tmp_path / "src" / f"text-{i:02d}.txt").write_text("")
    code, message = run(prepare, ["--out", tmp_path / "out", "--source", tmp_path / "src", "--val-every", val_every])
    assert code != 0 and "validation split" in message and "nothing written" in message, message
    assert not (tmp_path / "out").exists()


def test_a_missing_source_or_an_out_that_is_a_file_is_refused_by_name(prepare, tmp_path, rng, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tokenizers", tokenizers_module(prepare, usable=False))
    corpus(tmp_path / "src", rng, 3)
    code, _ = run(prepare, ["--out", tmp_path / "out", "--source", tmp_path / "nowhere"])
    err = capsys.readouterr().err
    assert code == 2 and f"--source {tmp_path / 'nowhere'}: no such directory" in err, err
    (tmp_path / "a-file").write_bytes(rng.bytes(16))
    code, _ = run(prepare, ["--out", tmp_path / "out", "--source", tmp_path / "a-file"])
    assert code == 2 and "--source" in capsys.readouterr().err
    code, _ = run(prepare, ["--out", tmp_path / "a-file", "--source", tmp_path / "src"])
    err = capsys.readouterr().err
    assert code == 2 and f"--out {tmp_path / 'a-file'}: exists and is not a directory" in err, err
    assert not (tmp_path / "out").exists()


def test_passages_cover_the_text_and_refuse_a_length_below_one(prepare, rng, tmp_path):
    text = corpus(tmp_path, rng, 1)[0]
    least = int(rng.integers(1, 200))
    pieces = prepare.passages(text, least)
    assert "".join(pieces) == text
    assert all(len(p) >= least and p.endswith("\n\n") for p in pieces[:-1])
    for bad in (0, -int(rng.integers(1, 10**6))):
        with pytest.raises(ValueError, match="min_chars"):
            prepare.passages(text, bad)


def two_corpora(prepare, tmp_path, rng, monkeypatch):
    """Two random corpora; returns argv(source, out), the flags of a run of corpus `source` into `out`."""
    monkeypatch.setitem(sys.modules, "tokenizers", tokenizers_module(prepare))
    for source in ("first", "second"):
        corpus(tmp_path / source, rng, int(rng.integers(2, 6)))
    shard_tokens = int(rng.integers(1, 500))
    return lambda source, out: ["--out", out, "--source", tmp_path / source, "--val-every", 2,
                                "--shard-tokens", shard_tokens]


def test_a_failed_write_leaves_the_previous_data_set_untouched(prepare, tmp_path, rng, monkeypatch):
    argv = two_corpora(prepare, tmp_path, rng, monkeypatch)
    writes = []
    write_shard = prepare.write_shard

    def counting(path, documents, vocab_size):
        writes.append(path)
        write_shard(path, documents, vocab_size)

    monkeypatch.setattr(prepare, "write_shard", counting)
    assert run(prepare, argv("second", tmp_path / "counted"))[0] == 0  # how many shards the second corpus makes
    monkeypatch.setattr(prepare, "write_shard", write_shard)
    out = tmp_path / "out"
    assert run(prepare, argv("first", out))[0] == 0
    before = snapshot(out)
    failing_at = int(rng.integers(len(writes)))
    calls = []

    def failing(path, documents, vocab_size):
        calls.append(path)
        if len(calls) == failing_at + 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        write_shard(path, documents, vocab_size)

    monkeypatch.setattr(prepare, "write_shard", failing)
    code, message = run(prepare, argv("second", out))
    assert code != 0 and f"--out {out}" in message and "untouched" in message, message
    assert snapshot(out) == before
    # Into a directory of its own, a failed run leaves none.
    calls.clear()
    code, message = run(prepare, argv("second", tmp_path / "fresh"))
    assert code != 0 and not (tmp_path / "fresh").exists()


def test_a_run_stopped_while_moving_leaves_no_vocab_bin(prepare, tmp_path, rng, monkeypatch):
    argv = two_corpora(prepare, tmp_path, rng, monkeypatch)
    replace = os.replace
    moves = []

    def counting(src, dst):
        if os.path.dirname(str(dst)) == str(tmp_path / "counted"):
            moves.append(dst)
        replace(src, dst)

    monkeypatch.setattr(os, "replace", counting)
    assert run(prepare, argv("second", tmp_path / "counted"))[0] == 0  # how many moves, and the new data set
    monkeypatch.setattr(os, "replace", replace)
    new = snapshot(tmp_path / "counted")
    out = tmp_path / "out"
    assert run(prepare, argv("first", out))[0] == 0
    stop_at = int(rng.integers(len(moves)))
    count = []

    def stopping(src, dst):
        if os.path.dirname(str(dst)) == str(out):
            count.append(dst)
            if len(count) == stop_at + 1:
                raise OSError(errno.EIO, os.strerror(errno.EIO), dst)
        replace(src, dst)

    monkeypatch.setattr(os, "replace", stopping)
    code, message = run(prepare, argv("second", out))
    monkeypatch.setattr(os, "replace", replace)
    assert code != 0 and f"--out {out}" in message, message
    left = snapshot(out)
    assert "vocab.bin" not in left
    if "val.bin" in left:  # then every file but vocab.bin is the new run's
        assert left == {name: data for name, data in new.items() if name != "vocab.bin"}
    assert not [name for name in left if name.startswith(".prepare_text-")]
