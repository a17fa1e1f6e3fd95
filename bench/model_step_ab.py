"""An A/B of the model's training step: runs of `model_step_benchmark` (its --json) with a baseline binary and with
the change, alternated in one lease (`bench/gpu/gpu.sh step-ab`), compared.

For the step, its forward and its backward: every run's time, the change of the medians (negative: the change is
faster); tokens/s and MFU at the medians; whether every run of both sides gave the same loss (a change meant to keep
the arithmetic must leave it equal to the last digit) and the same memory. The runs must share their shape (config,
sequences, length, recompute, loss chunk): a comparison across shapes is refused by name.

Writes model-step-ab.json (the comparison and every run) and model-step-ab.md into --out.
Usage: python3 bench/model_step_ab.py --base RUN.json [RUN.json ...] --new RUN.json [RUN.json ...] --out DIR
       [--label-base NAME] [--label-new NAME]
"""

import statistics
import sys

import ab_runs

SHAPE = ("config", "tokens", "sequences", "seq_len", "recompute", "loss_chunk")
TIMES = ("step_ms", "forward_ms", "backward_ms")


def compare(base_runs, new_runs):
    """The comparison of two sides' runs; ValueError where a run's shape differs from the first base run's."""
    if not base_runs or not new_runs:
        raise ValueError("each side needs at least one run")
    shape = {key: base_runs[0].get(key) for key in SHAPE}
    for side, runs in (("base", base_runs), ("new", new_runs)):
        for i, run in enumerate(runs):
            differs = [key for key in SHAPE if run.get(key) != shape[key]]
            if differs:
                raise ValueError(f"{side} run {i}: {', '.join(differs)} differ from the first base run's "
                                 f"({', '.join(f'{k}={shape[k]}' for k in differs)})")
    result = {"shape": shape, "times": {}}
    for key in TIMES:
        base = [run[key] for run in base_runs]
        new = [run[key] for run in new_runs]
        result["times"][key] = {"base": base, "new": new,
                                "change": statistics.median(new) / statistics.median(base) - 1}
    step = result["times"]["step_ms"]
    result["tokens_per_s"] = {side: shape["tokens"] / statistics.median(step[side]) * 1e3 for side in ("base", "new")}
    result["mfu"] = {side: runs[0]["training_gflop_per_token"] * result["tokens_per_s"][side] / 1e3 /
                     runs[0]["peak_tflops"] for side, runs in (("base", base_runs), ("new", new_runs))}
    losses = {run["loss"] for run in base_runs + new_runs}
    result["loss_equal"] = len(losses) == 1
    result["losses"] = sorted(losses)
    result["memory_gib"] = {"base": sorted({r["memory_used_gib"] for r in base_runs}),
                            "new": sorted({r["memory_used_gib"] for r in new_runs})}
    return result


def markdown(result, labels):
    shape = result["shape"]
    lines = [f"# Training step A/B: {labels['base']} (base) against {labels['new']} (new)", "",
             f"{shape['config']}, {shape['sequences']} x {shape['seq_len']} tokens, recompute {shape['recompute']}, "
             f"loss chunk {shape['loss_chunk']}; ms per step, each run (runs alternated in one lease); change of the "
             "medians.", "",
             "| | base | new | change |", "|---|---|---|---|"]
    for key in TIMES:
        t = result["times"][key]
        lines.append(f"| {key[:-3]} | {' / '.join(f'{v:.1f}' for v in t['base'])} | "
                     f"{' / '.join(f'{v:.1f}' for v in t['new'])} | {t['change']:+.1%} |")
    tokens, mfu = result["tokens_per_s"], result["mfu"]
    lines.append(f"| tokens/s (medians) | {tokens['base']:,.0f} | {tokens['new']:,.0f} | "
                 f"{tokens['new'] / tokens['base'] - 1:+.1%} |")
    lines.append(f"| MFU | {mfu['base']:.1%} | {mfu['new']:.1%} | |")
    memory = result["memory_gib"]
    lines.append(f"| memory (GiB) | {' / '.join(f'{m:.2f}' for m in memory['base'])} | "
                 f"{' / '.join(f'{m:.2f}' for m in memory['new'])} | |")
    lines += ["", "The loss is " + ("the same in every run." if result["loss_equal"] else
                                    "not the same in every run: " + ", ".join(repr(x) for x in result["losses"]))]
    return "\n".join(lines) + "\n"


def summarise(base_runs, new_runs, labels):
    result = compare(base_runs, new_runs)
    return result, markdown(result, labels)


def main(argv=None):
    return ab_runs.main(argv, __doc__, "model-step-ab", summarise)


if __name__ == "__main__":
    sys.exit(main())
