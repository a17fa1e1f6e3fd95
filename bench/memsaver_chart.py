"""Chart of the memory saver's H200 figures: pause and resume bandwidth with a CPU copy, beside the plain
pinned copy and torch_memory_saver, from the records in bench/results/.

Usage: python3 bench/memsaver_chart.py [RESULTS_DIR]   (writes memsaver-h200.png there; needs matplotlib)
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(results):
    native = [r for r in json.load(open(os.path.join(results, "memsaver-h200-native.json"))) if r["backup"] == "cpu"]
    torch_rows = [json.loads(line) for line in open(os.path.join(results, "memsaver-h200-torch.jsonl"))]
    in_torch = {(r["saver"], r["bytes"]): r for r in torch_rows if r.get("backup") == "cpu"}

    sizes = sorted(r["bytes"] for r in native)
    labels = [f"{b >> 30} GiB" for b in sizes]
    by_size = {r["bytes"]: r for r in native}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, direction, copy_key in ((axes[0], "pause", "d2h_gibps"), (axes[1], "resume", "h2d_gibps")):
        series = [
            ("plain pinned copy", [by_size[b][copy_key] for b in sizes]),
            ("deltatrain (steady state)", [by_size[b][f"{direction}_gibps"] for b in sizes]),
            ("deltatrain shim in torch (cycle 2)",
             [in_torch.get(("deltatrain", b), {}).get(f"{direction}_gibps", [0, 0])[-1] for b in sizes]),
            ("torch_memory_saver (cycle 2)",
             [in_torch.get(("torch_memory_saver", b), {}).get(f"{direction}_gibps", [0, 0])[-1] for b in sizes]),
        ]
        width = 0.8 / len(series)
        for i, (name, values) in enumerate(series):
            xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(sizes))]
            ax.bar(xs, values, width, label=name)
        ax.set_xticks(range(len(sizes)), labels)
        ax.set_title(f"{direction} with a CPU copy (device {'to host' if direction == 'pause' else 'from host'})")
        ax.set_ylabel("GiB/s")
        ax.grid(axis="y", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8)
    fig.suptitle(f"Memory saver on an {native[0]['machine']['gpus'][0]['name']} (no bar: not measured)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(os.path.join(results, "memsaver-h200.png"), dpi=110)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results"))
