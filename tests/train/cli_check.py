"""`deltatrain train` end to end, single process: data written by prepare_text.py's writer (so the Python
writer and the C++ reader agree on the format), bad flags and files refused by name, SIGTERM finishing the
step, saving and exiting 0, a second signal during a long step ending the process without a partial checkpoint, and
`--resume latest` continuing from there.

With MPIEXEC, a failure on rank 0 alone (a log it cannot open, an allocation that fails) ends every rank with
the reason instead of leaving the others waiting in a collective.

    python cli_check.py DELTATRAIN_BINARY [MPIEXEC]
"""

import importlib.util
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PREPARE = os.path.join(HERE, "..", "..", "python", "deltatrain", "prepare_text.py")

CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6, "initializer_range": 0.02,
    "tie_word_embeddings": True,
}


def load_prepare():
    spec = importlib.util.spec_from_file_location("prepare_text", PREPARE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documents(rng, count):
    out = []
    for _ in range(count):
        token = rng.randrange(64)
        doc = []
        for _ in range(rng.randrange(20, 140)):
            doc.append(token)
            token = rng.randrange(64) if rng.random() < 0.125 else (3 * token + 7) % 64
        out.append(doc)
    return out


def run(binary, *args, expect_ok=True):
    result = subprocess.run([binary, "train", *args], capture_output=True, text=True, timeout=120)
    if expect_ok and result.returncode != 0:
        sys.exit(f"FAIL: {args} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def expect_refused(binary, args, what):
    result = run(binary, *args, expect_ok=False)
    if result.returncode == 0 or what not in result.stderr:
        sys.exit(f"FAIL: {args} should be refused naming {what!r}; exit {result.returncode}, stderr: {result.stderr}")
    print(f"ok: refused naming {what}: {result.stderr.strip()[:160]}")
    return result


def main():
    binary = sys.argv[1]
    seed = int(os.environ.get("DELTATRAIN_TEST_SEED", random.SystemRandom().randrange(1 << 32)))
    print(f"random seed {seed}: replay with DELTATRAIN_TEST_SEED={seed}")
    rng = random.Random(seed)
    prepare = load_prepare()
    with tempfile.TemporaryDirectory(prefix="deltatrain-train-cli-") as tmp:
        data = os.path.join(tmp, "data")
        os.makedirs(data)
        prepare.write_shard(os.path.join(data, "train-00000.bin"), documents(rng, 40), 64)
        prepare.write_shard(os.path.join(data, "val.bin"), documents(rng, 4), 64)
        prepare.write_vocabulary(os.path.join(data, "vocab.bin"), [bytes([65 + i % 26]) for i in range(64)])
        config = os.path.join(tmp, "config.json")
        with open(config, "w") as f:
            json.dump(CONFIG, f)
        flags = ["--config", config, "--data", data, "--seq-len", "32", "--threads", "1", "--chart", "none"]
        common = flags + ["--tokens-per-step", "128"]

        expect_refused(binary, flags + ["--tokens-per-step", "100"], "tokens-per-step")
        expect_refused(binary, common + ["--schedule", "linear"], "schedule")
        expect_refused(binary, common + ["--lr", "-1"], "lr")
        expect_refused(binary, common + ["--resume", "latest"], "resume")
        expect_refused(binary, common + ["--device", "tpu"], "device")
        expect_refused(binary, common + ["--sample-tokens", "0"], "sample-tokens")
        expect_refused(binary, common + ["--sample-tokens", str((1 << 32) + 5)],
                       "'--sample-tokens': must be at most")
        # A sample whose caches (`tiny`'s, 2 * 10^9 positions: terabytes) this machine cannot hold is refused before
        # training, naming the flag, rather than failing as std::bad_alloc at the first sample; without samples the
        # size is not used, and not refused.
        huge_sample = ["--config", "tiny"] + common[2:] + ["--sample-tokens", "2000000000"]
        result = expect_refused(binary, huge_sample + ["--sample-every", "1"], "'--sample-tokens': needs at least")
        if "step 1/" in result.stdout:
            sys.exit(f"FAIL: the huge sample was refused only after training\n{result.stdout}")
        run(binary, *huge_sample, "--steps", "0")
        # A refused run leaves an earlier log as it was; a fresh run that starts empties it.
        kept_log = os.path.join(tmp, "kept.jsonl")
        with open(kept_log, "w") as f:
            f.write("an earlier run's line\n")
        expect_refused(binary, ["--config", "tiny", "--data", os.path.join(tmp, "nowhere"), "--log", kept_log],
                       os.path.join(tmp, "nowhere"))
        with open(kept_log) as f:
            if f.read() != "an earlier run's line\n":
                sys.exit("FAIL: a refused run emptied its --log")
        run(binary, *common, "--steps", "1", "--log", kept_log)
        with open(kept_log) as f:
            if "earlier" in f.read():
                sys.exit("FAIL: a fresh run appended to an earlier log")
        print("ok: a refused run keeps the log, a fresh run starts it anew")
        bad = os.path.join(tmp, "bad")
        os.makedirs(bad)
        prepare.write_shard(os.path.join(bad, "val.bin"), documents(rng, 2), 64)
        with open(os.path.join(bad, "train-00000.bin"), "wb") as f:
            f.write(b"DTSHARD\0" + bytes(20))
        expect_refused(binary, common[:2] + ["--data", bad] + common[4:], os.path.join(bad, "train-00000.bin"))

        # SIGTERM mid-run: the step finishes, a checkpoint is saved, the exit status is 0.
        ckpt = os.path.join(tmp, "ckpt")
        log = os.path.join(tmp, "log.jsonl")
        process = subprocess.Popen([binary, "train", *common, "--steps", "100000", "--ckpt", ckpt, "--log", log],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            if os.path.exists(log) and sum(1 for _ in open(log)) >= 3:
                break
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
        if process.returncode != 0 or "stopped on a signal" not in out:
            sys.exit(f"FAIL: SIGTERM: exit {process.returncode}\n{out}\n{err}")
        steps = [json.loads(line)["step"] for line in open(log) if '"train"' in line]
        with open(os.path.join(ckpt, "latest")) as f:
            latest = f.read().strip()
        with open(os.path.join(ckpt, latest, "trainer.json")) as f:
            saved_step = json.load(f)["step"]
        if saved_step != steps[-1] or latest != f"step-{steps[-1]:08d}":
            sys.exit(f"FAIL: SIGTERM at step {steps[-1]} saved {latest} (step {saved_step})")
        print(f"ok: SIGTERM after step {steps[-1]}: saved {latest}, exit 0")

        # SIGTERM during a long evaluation or a long sample (hours of it): it is abandoned and the run saves the
        # step and exits 0.
        slow_runs = [["--eval-every", "1", "--eval-batches", "1000000"],
                     ["--sample-every", "1", "--sample-tokens", "10000000"]]
        for number, extra in enumerate(slow_runs):
            slow_log = os.path.join(tmp, f"slow-{number}.jsonl")
            slow_ckpt = os.path.join(tmp, f"slow-ckpt-{number}")
            process = subprocess.Popen([binary, "train", *common, "--steps", "100", "--log", slow_log,
                                        "--ckpt", slow_ckpt, *extra],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            deadline = time.time() + 60
            while time.time() < deadline and not (os.path.exists(slow_log) and '"train"' in open(slow_log).read()):
                time.sleep(0.05)
            time.sleep(0.5)  # into the evaluation or the sample
            process.send_signal(signal.SIGTERM)
            try:
                out, err = process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                sys.exit(f"FAIL: SIGTERM with {extra} did not end the run")
            slow_steps = [json.loads(line)["step"] for line in open(slow_log) if '"train"' in line]
            saved = os.path.join(slow_ckpt, f"step-{slow_steps[-1]:08d}", "trainer.json")
            if process.returncode != 0 or "stopped on a signal" not in out or not os.path.exists(saved):
                sys.exit(f"FAIL: SIGTERM with {extra}: exit {process.returncode}, expected 0, a stop and {saved}\n"
                         f"{out}\n{err}")
        print("ok: SIGTERM abandons an evaluation or a sample, saves and exits 0")

        check_second_signal(binary, flags, tmp)

        # Resume from `latest` for two more steps; the log continues.
        target = steps[-1] + 2
        result = run(binary, *common, "--steps", str(target), "--ckpt", ckpt, "--resume", "latest", "--log", log)
        steps = [json.loads(line)["step"] for line in open(log) if '"train"' in line]
        if steps[-2:] != [target - 1, target] or not os.path.exists(os.path.join(ckpt, f"step-{target:08d}")):
            sys.exit(f"FAIL: resume did not continue to step {target}: {steps[-4:]}\n{result.stdout}")
        print(f"ok: resumed to step {target}")

        # `ckpt inspect` finds the optimizer's checkpoint in a trainer's root and step directory.
        for where in (ckpt, os.path.join(ckpt, f"step-{target:08d}")):
            result = subprocess.run([binary, "ckpt", "inspect", where, "--verify"], capture_output=True, text=True)
            if result.returncode != 0 or f"step           {target}" not in result.stdout:
                sys.exit(f"FAIL: ckpt inspect {where}: exit {result.returncode}\n{result.stdout}\n{result.stderr}")
        print("ok: ckpt inspect reads a trainer's checkpoint")

        # generate's refusals name its flags, not the engine's fields.
        model = os.path.join(ckpt, f"step-{target:08d}", "model")
        weights = ["--config", config, "--weights", model, "--prompt-ids", "1"]
        for args, what in [(["--batch", "0"], "'--batch'"), (["--max-new-tokens", "0"], "'--max-new-tokens'"),
                           (["--top-p", "2"], "'--top-p'"), (["--threads", "-1"], "'--threads'"),
                           (["--max-length", "-5"], "'--max-length'"), (["--prompt-ids", "1,2,"], "'--prompt-ids'"),
                           (["--max-new-tokens", "2000000000"], "'--max-new-tokens': needs at least")]:
            result = subprocess.run([binary, "generate", *weights, *args], capture_output=True, text=True,
                                    timeout=60)
            if result.returncode == 0 or f"invalid argument {what}" not in result.stderr:
                sys.exit(f"FAIL: generate {args} should be refused naming {what}: {result.stderr}")
        print("ok: generate's refusals name its flags")

        # --steps is the step to train to: below the checkpoint's, the resume is refused rather than reported done.
        expect_refused(binary, common + ["--steps", "1", "--ckpt", ckpt, "--resume", "latest"], "--steps")

        # Another run into the same root without --resume is refused before it trains: nothing of the first is lost.
        another_run = ["--steps", "2", "--save-every", "1", "--seed", "7", "--ckpt", ckpt]
        expect_refused(binary, common + another_run, "--ckpt")
        with open(os.path.join(ckpt, "latest")) as f:
            if f.read().strip() != f"step-{target:08d}":
                sys.exit("FAIL: a refused run moved `latest`")
        # A root that cannot be made is refused before training, not at the first save.
        not_a_directory = os.path.join(tmp, "afile")
        open(not_a_directory, "w").close()
        expect_refused(binary, common + ["--steps", "1", "--ckpt", os.path.join(not_a_directory, "sub")], "--ckpt")
        if len(sys.argv) > 2:
            check_one_rank_failing(binary, sys.argv[2], common, tmp)
    print("all CLI checks passed")


def check_second_signal(binary, flags, tmp):
    """A second signal while the first waits for a long step to end ends the process as the signal's default action
    does: killed by it, not "stopped on a signal" with exit 0, the step neither finished nor saved. The checkpoint
    saved before it stays the latest and whole, and no temporary directory of another is left (none was begun).

    `tiny` at 16384 tokens a step on one thread: a step of about 6 s on a 2-core machine (2,500 tokens/s), so the
    two signals, sent at once after step 1's save, both arrive within step 2 on any machine up to some 20 times
    faster. Without the second signal's handling step 2 would finish, save and exit 0."""
    ckpt = os.path.join(tmp, "second-signal-ckpt")
    log = os.path.join(tmp, "second-signal.jsonl")
    process = subprocess.Popen([binary, "train", "--config", "tiny", *flags[2:], "--tokens-per-step", "16384",
                                "--steps", "4", "--save-every", "1", "--ckpt", ckpt, "--log", log],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def records(kind):
        if not os.path.exists(log):
            return []
        # The last line may be half written while the run goes on.
        return [row for row in (json.loads(line) for line in open(log) if line.endswith("\n"))
                if row["kind"] == kind]

    deadline = time.time() + 60
    while time.time() < deadline and process.poll() is None and not records("save"):
        time.sleep(0.02)
    if process.poll() is not None or not records("save"):
        process.kill()
        out, err = process.communicate()
        sys.exit(f"FAIL: second signal: no save of step 1 to wait for (exit {process.returncode})\n{out}\n{err}")
    process.send_signal(signal.SIGINT)  # asks the run to stop once step 2 ends
    time.sleep(0.1)
    process.send_signal(signal.SIGTERM)  # before it does: the process ends, by SIGTERM's default action
    try:
        out, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        sys.exit("FAIL: a second signal during a long step did not end the run")
    steps = [row["step"] for row in records("train")]
    if process.returncode != -signal.SIGTERM or "stopped on a signal" in out or steps != [1]:
        sys.exit(f"FAIL: second signal during step 2: exit {process.returncode}, expected {-signal.SIGTERM} (killed "
                 f"by SIGTERM) with step 2 unfinished; steps {steps}\n{out}\n{err}")
    entries = sorted(os.listdir(ckpt))
    with open(os.path.join(ckpt, "latest")) as f:
        latest = f.read().strip()
    if entries != ["latest", "step-00000001"] or latest != "step-00000001":
        sys.exit(f"FAIL: second signal: the checkpoint root holds {entries}, latest {latest!r}; expected step 1's "
                 "alone")
    result = subprocess.run([binary, "ckpt", "inspect", ckpt, "--verify"], capture_output=True, text=True, timeout=60)
    if result.returncode != 0 or "step           1" not in result.stdout:
        sys.exit(f"FAIL: second signal: step 1's checkpoint does not verify\n{result.stdout}\n{result.stderr}")
    print("ok: a second signal during a long step ends the process by that signal; step 1's checkpoint stays whole "
          "and the latest")


def check_one_rank_failing(binary, mpiexec, common, tmp):
    not_a_directory = os.path.join(tmp, "afile")
    open(not_a_directory, "a").close()
    # `tiny`, whose caches for 10^8 tokens this machine cannot hold: refused on every rank before training. Its
    # caches for 3 * 10^6 tokens (3 GiB) pass that check; under a 2 GiB limit on each rank's address space their
    # allocation fails on rank 0 alone, the one that samples.
    tiny = ["--config", "tiny"] + common[2:]
    cases = [
        (common + ["--steps", "1", "--log", os.path.join(not_a_directory, "x.jsonl")], "'--log'", None),
        (tiny + ["--steps", "2", "--sample-every", "1", "--sample-tokens", "100000000"],
         "invalid argument '--sample-tokens': needs at least", None),
        (tiny + ["--steps", "2", "--sample-every", "1", "--sample-tokens", "3000000"], "rank 0 of 2: std::bad_alloc",
         2 << 30),
    ]
    for args, what, address_space in cases:
        command = [mpiexec, "-n", "2", binary, "train", *args]
        limit = None
        if address_space is not None:
            limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=90, preexec_fn=limit)
        except subprocess.TimeoutExpired:
            sys.exit(f"FAIL: 2 ranks with {args[-4:]} hung")
        if result.returncode == 0 or what not in result.stderr:
            sys.exit(f"FAIL: 2 ranks with {args[-4:]}: exit {result.returncode}, expected {what!r} in\n"
                     f"{result.stderr}")
        print(f"ok: 2 ranks with {args[-2:]} end with {what}")


if __name__ == "__main__":
    main()
