"""Charts of a deltatrain JSONL log, chosen by what the log holds:

- `deltatrain train --log`: training loss per step and validation loss;
- `deltatrain rl --log`: the reward and the held-out accuracy per RL step, the time of each phase and phase
  switch per step, and the train/rollout log-probability mismatch.

    python -m deltatrain.charts LOG.jsonl OUT.png      (or python python/deltatrain/charts.py ...)

Exits with status 3 and a message when matplotlib is missing, 2 when the log holds no rows to draw.
"""

import json
import sys


def read_rows(path):
    """Rows by kind; a resumed run appends to the log, so the last row of each (kind, step) wins."""
    rows = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if "step" in row:
                rows.setdefault(row.get("kind"), {})[row["step"]] = row
    return {kind: [by_step[s] for s in sorted(by_step)] for kind, by_step in rows.items()}


def draw_train(plt, rows, out):
    train, val = rows.get("train", []), rows.get("eval", [])
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="training loss", linewidth=1)
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


def draw_rl(plt, rows, out):
    rl, evals = rows.get("rl", []), rows.get("eval", [])
    steps = [r["rl_step"] for r in rl]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 9), dpi=120, sharex=True,
                                              gridspec_kw={"height_ratios": [3, 2, 1.4]})
    rewards = [r["reward_mean"] for r in rl]
    top.plot(steps, rewards, label="reward (sampled, mean of the step)", linewidth=0.8, alpha=0.5)
    window = 5
    if len(rewards) >= window:
        smooth = [sum(rewards[i - window + 1:i + 1]) / window for i in range(window - 1, len(rewards))]
        top.plot(steps[window - 1:], smooth, color="#1f77b4", linewidth=2, label=f"reward, mean of {window} steps")
    if evals:
        top.plot([e["rl_step"] for e in evals], [e["accuracy"] for e in evals], "o-", markersize=4,
                 label="held-out accuracy (greedy)")
    top.set_ylabel("reward / accuracy")
    top.set_ylim(-0.02, 1.02)
    top.grid(alpha=0.3)
    top.legend(loc="lower right")

    # One bar per step: the two phases and the two switches stacked, in the order they run.
    parts = [("to_rollout_s", "switch to rollout", "#d62728"), ("rollout_s", "rollout", "#1f77b4"),
             ("to_train_s", "switch to train", "#ff7f0e"), ("train_s", "train", "#2ca02c")]
    bottoms = [0.0] * len(rl)
    for key, label, color in parts:
        values = [r[key] for r in rl]
        middle.bar(steps, values, bottom=bottoms, width=0.85, label=label, color=color)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    switches = sorted(1e3 * (r["to_rollout_s"] + r["to_train_s"]) for r in rl)
    median = switches[len(switches) // 2] if switches else 0
    middle.set_ylabel("seconds per step")
    middle.set_title(f"phase timeline (both switches together: median {median:.1f} ms per step)", fontsize=9)
    middle.grid(alpha=0.3, axis="y")
    middle.legend(loc="upper right", fontsize=8, ncol=2)

    bottom.semilogy(steps, [max(r["mismatch_mean"], 1e-12) for r in rl], label="mean |logp_train - logp_rollout|")
    bottom.semilogy(steps, [max(r["mismatch_max"], 1e-12) for r in rl], label="max", linewidth=0.8)
    bottom.set_xlabel("RL step")
    bottom.set_ylabel("mismatch")
    bottom.grid(alpha=0.3)
    bottom.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.exit("usage: python -m deltatrain.charts LOG.jsonl OUT.png")
    log, out = argv
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("deltatrain.charts: matplotlib is not installed in this python (make demo-deps installs it)",
              file=sys.stderr)
        sys.exit(3)
    rows = read_rows(log)
    if rows.get("rl"):
        draw_rl(plt, rows, out)
    elif rows.get("train"):
        draw_train(plt, rows, out)
    else:
        print(f"deltatrain.charts: {log} holds no training or RL rows", file=sys.stderr)
        sys.exit(2)
    return 0


if __name__ == "__main__":
    main()
