"""The loss chart of a `deltatrain train --log` file: training loss per step and validation loss.

    python -m deltatrain.charts LOG.jsonl OUT.png      (or python python/deltatrain/charts.py ...)

Exits with status 3 and a message when matplotlib is missing, 2 when the log holds no training rows.
"""

import json
import sys


def read_log(path):
    train, val = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("kind") == "train":
                train.append((row["step"], row["loss"]))
            elif row.get("kind") == "eval":
                val.append((row["step"], row["val_loss"]))
    # A resumed run appends to the log: keep the last value of each step.
    return sorted(dict(train).items()), sorted(dict(val).items())


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
        print("deltatrain.charts: matplotlib is not installed in this python (make train-deps installs it)",
              file=sys.stderr)
        sys.exit(3)
    train, val = read_log(log)
    if not train:
        print(f"deltatrain.charts: {log} holds no training rows", file=sys.stderr)
        sys.exit(2)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(*zip(*train), label="training loss", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    return 0


if __name__ == "__main__":
    main()
