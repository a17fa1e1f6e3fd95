"""The command line's own behaviour: --version, "did you mean" for mistyped subcommands and options, refusals that
name the flag, and `bench gdn --pass both` running both passes as its help says.

    python cli_check.py DELTATRAIN_BINARY
"""

import json
import os
import subprocess
import sys
import tempfile


def run(binary, *args):
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120)


def expect(condition, what, result):
    if not condition:
        sys.exit(f"FAIL {what}\nexit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}")
    print(f"PASS {what}")


def main(binary, version):
    result = run(binary, "--version")
    expect(result.returncode == 0 and result.stdout.strip() == f"deltatrain {version}", "--version", result)

    cases = [
        (["trian"], "deltatrain: unknown subcommand 'trian'; did you mean 'train'?"),
        (["bench", "gdm"], "deltatrain bench: unknown subcommand 'gdm'; did you mean 'gdn'?"),
        (["model", "inof"], "deltatrain model: unknown subcommand 'inof'; did you mean 'info'?"),
        (["train", "--stpes", "3"], "deltatrain train: unknown option '--stpes'; did you mean '--steps'?"),
        (["bench", "gdn", "--jsn"], "deltatrain bench gdn: unknown option '--jsn'; did you mean '--json'?"),
        (["bench", "gdn", "--repeats=2"], "deltatrain bench gdn: unknown option '--repeats'; did you mean '--repeat'?"),
        (["xyzzy"], "deltatrain: unknown subcommand 'xyzzy'; the subcommands are"),
    ]
    for args, message in cases:
        result = run(binary, *args)
        expect(result.returncode != 0 and message in result.stderr, f"{' '.join(args)}: {message}", result)

    result = run(binary, "bench", "gdn", "--backend", "cpu", "--heads", "1/1", "--seqlens", "1x64", "--dim", "64",
                 "--repeat", "1", "--sgemm-size", "0", "--pass", "both", "--json")
    passes = [row["pass"] for row in json.loads(result.stdout)["results"]] if result.returncode == 0 else []
    expect(passes == ["fwd", "bwd"], "bench gdn --pass both runs fwd and bwd", result)
    cited = json.loads(result.stdout)["flop_model"].split(" ")[0] if result.returncode == 0 else ""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    expect(os.path.isfile(os.path.join(root, cited)), f"bench gdn --json's flop_model cites a file of the tree: {cited}",
           result)
    # The library's refusals name the flag as typed where the command has one; a config.json's field keeps its name.
    refusals = [
        (["model", "info", "--config", "nowhere-such"], "invalid argument '--config': must be a preset"),
        (["rl", "--config", "tiny", "--steps", "-3"], "invalid argument '--steps': must be >= 0, got -3"),
        (["rl", "--config", "tiny", "--task", "juggling"], "invalid argument '--task': no task is called 'juggling'"),
        # Fields whose flag has another name, or that the library checks under another name.
        (["train", "--config", "tiny", "--data", "nowhere", "--clip", "-1"], "invalid argument '--clip': must be"),
        (["rl", "--config", "tiny", "--warmup-lr", "-1"], "invalid argument '--warmup-lr': must be"),
        (["rl", "--config", "tiny", "--steps", "1", "--init", "/nonexistent"],
         "invalid argument '--init': '/nonexistent'"),
        (["generate", "--config", "tiny", "--weights", "/nonexistent", "--prompt-ids", "1"],
         "invalid argument '--weights': '/nonexistent'"),
        (["train", "--config", "tiny", "--data", "nowhere", "--threads", "-3"],
         "invalid argument '--threads': must be"),
        (["rl", "--config", "tiny", "--threads", "-3"], "invalid argument '--threads': must be"),
        # Values that were accepted silently.
        (["train", "--config", "tiny", "--data", "nowhere", "--peak-flops", "-1"],
         "invalid argument '--peak-flops': must be"),
        (["optim", "demo", "--steps", "2", "--save-at", "3", "--ckpt", "nowhere"],
         "invalid argument '--save-at': must be a step this run reaches, 1 to 2; got 3"),
        # Sizes no machine holds: refused up front naming the flag, not as "std::bad_alloc".
        (["train", "--config", "tiny", "--data", "nowhere", "--tokens-per-step", str(1 << 40)],
         "invalid argument '--tokens-per-step': needs at least"),
        (["bench", "gdn", "--seqlens", "100000x100000"], "invalid argument '--seqlens': needs at least"),
    ]
    with tempfile.TemporaryDirectory() as directory:
        config = os.path.join(directory, "config.json")
        with open(config, "w") as f:
            json.dump({"hidden_size": 64}, f)
        refusals.append((["model", "info", "--config", config], "invalid argument 'model_type': in " + config))
        # A checkpoint root under a file is refused before the run, not at its first save.
        refusals.append((["rl", "--config", "tiny", "--steps", "1", "--ckpt", os.path.join(config, "sub")],
                         "invalid argument '--ckpt': cannot create the checkpoint directory"))
        for args, message in refusals:
            result = run(binary, *args)
            expect(result.returncode == 1 and message in result.stderr, f"{' '.join(args)}: {message}", result)

    with tempfile.TemporaryDirectory() as root:
        run(binary, "optim", "demo", "--steps", "2", "--save-at", "2", "--ckpt", root)
        shard = os.path.join(root, "step-00000002", "shard-00000-of-00001.safetensors")
        with open(shard, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            last = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([last[0] ^ 0x5A]))
        for extra in ([], ["--json"]):
            result = run(binary, "ckpt", "inspect", root, "--verify", *extra)
            expect(result.returncode == 1 and "BAD" in result.stdout and "failed verification" in result.stderr,
                   f"ckpt inspect --verify {' '.join(extra)} exits 1 on a damaged shard", result)

    # The documented form parses (the refusal is of the option after it, which CLI11 checks next; a full check
    # of `tiny` takes minutes).
    result = run(binary, "model", "check", "--config", "tiny", "--seqlens", "70,1,13", "--gradient-samples", "0")
    expect(result.returncode != 0 and "--seqlens" not in result.stderr and "--gradient-samples" in result.stderr,
           "model check --seqlens 70,1,13 (the documented form) is accepted", result)
    for lengths in ("0", "5,0"):
        result = run(binary, "model", "check", "--config", "tiny", "--seqlens", lengths)
        expect(result.returncode != 0 and "--seqlens: Value 0 not in range 1 to" in result.stderr,
               f"model check --seqlens {lengths} is refused with the range", result)

    # CLI11's own refusals (exit 105) of values it would otherwise take: a negative seed read as 2^64 - 1, a
    # negative sgemm size.
    cases = [(["train", "--config", "tiny", "--data", "nowhere", "--seed", "-1"], "--seed: must be >= 0"),
             (["rl", "--config", "tiny", "--seed", "-1"], "--seed: must be >= 0"),
             (["bench", "gdn", "--sgemm-size", "-1"], "--sgemm-size: Value -1 not in range 0 to")]
    for args, message in cases:
        result = run(binary, *args)
        expect(result.returncode != 0 and message in result.stderr, f"{' '.join(args)}: {message}", result)

    result = run(binary, "bench", "gdn", "--pass", "sideways")
    expect(result.returncode == 1 and "--pass" in result.stderr and "fwd, bwd or both" in result.stderr,
           "bench gdn --pass sideways is refused naming the flag", result)
    # A thread count the operator refuses is refused before any work: the sgemm reference does not run first.
    result = run(binary, "bench", "gdn", "--threads", "-1")
    expect(result.returncode == 1 and "invalid argument '--threads': must be in [0, " in result.stderr and
           "sgemm" not in result.stderr, "bench gdn --threads -1 is refused before the sgemm reference runs", result)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: cli_check.py DELTATRAIN_BINARY VERSION")
    main(sys.argv[1], sys.argv[2])
