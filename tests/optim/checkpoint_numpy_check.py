"""A checkpoint written by `deltatrain optim demo` read with numpy alone: the safetensors layout
(8-byte little-endian header length, JSON header, raw little-endian tensors) parsed by hand, the
gathered state rebuilt from metadata.json's layout, and its SHA-256 compared with the hashes the
CLI printed; each file's recorded digest (SHA-256 over its pieces' SHA-256 digests) recomputed with
hashlib. Exits 77 (skipped) without numpy.

usage: checkpoint_numpy_check.py DELTATRAIN MPIEXEC RANKS
"""
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile

try:
    import numpy as np
except ImportError:
    print("numpy is not installed: skipped")
    sys.exit(77)


def pieces_digest(path, piece_bytes):
    """SHA-256 over the SHA-256 digests of the file's consecutive pieces of piece_bytes."""
    raw = open(path, "rb").read()
    digests = b"".join(hashlib.sha256(raw[at:at + piece_bytes]).digest() for at in range(0, len(raw), piece_bytes))
    return hashlib.sha256(digests).hexdigest()


def read_safetensors(path):
    raw = open(path, "rb").read()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        assert entry["dtype"] == "F32", (path, name, entry["dtype"])
        data = np.frombuffer(raw[8 + length + begin:8 + length + end], dtype="<f4")
        tensors[name] = data.reshape(entry["shape"])
    assert 8 + length + max(e["data_offsets"][1] for n, e in header.items() if n != "__metadata__") == len(raw)
    return header.get("__metadata__", {}), tensors


def gathered(meta, shards, state):
    dp = meta["dp_size"]
    out = []
    for b, buffer in enumerate(meta["layout"]["buffers"]):
        flat = np.zeros(buffer["numel"], dtype="<f4")
        for k, bucket in enumerate(buffer["buckets"]):
            shard = bucket["numel"] // dp
            for rank in range(dp):
                start = bucket["offset"] + rank * shard
                flat[start:start + shard] = shards[rank][f"{state}.buffer{b}.bucket{k}"]
        out += [flat[p["offset"]:p["offset"] + p["numel"]] for p in buffer["params"]]
    return np.concatenate(out)


def main():
    deltatrain, mpiexec, ranks = sys.argv[1], sys.argv[2], sys.argv[3]
    with tempfile.TemporaryDirectory() as root:
        printed = json.loads(subprocess.run(
            [mpiexec, "-np", ranks, "--oversubscribe", "--allow-run-as-root", deltatrain, "optim", "demo",
             "--steps", "5", "--save-at", "5", "--ckpt", root, "--dtype", "bf16", "--json"],
            check=True, capture_output=True, text=True).stdout)
        directory = os.path.join(root, open(os.path.join(root, "latest")).read().strip())
        meta = json.load(open(os.path.join(directory, "metadata.json")))
        shards = []
        for rank, file in enumerate(meta["files"]):
            path = os.path.join(directory, file["name"])
            assert pieces_digest(path, meta["digest_piece_bytes"]) == file["sha256_of_pieces"], path
            header_metadata, tensors = read_safetensors(path)
            assert header_metadata["rank"] == str(rank), (path, header_metadata)
            shards.append(tensors)
        params = hashlib.sha256(gathered(meta, shards, "fp32_param").tobytes()).hexdigest()
        state = hashlib.sha256(np.int64(meta["step"]).astype("<i8").tobytes() +
                               gathered(meta, shards, "exp_avg").tobytes() +
                               gathered(meta, shards, "exp_avg_sq").tobytes()).hexdigest()
        print(f"step {meta['step']} (printed {printed['step']}), params {params}, state {state}")
        assert meta["step"] == printed["step"] == 5
        assert params == printed["params_sha256"], (params, printed)
        assert state == printed["state_sha256"], (state, printed)


main()
