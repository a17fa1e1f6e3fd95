"""The report of bench/gdn_h200.py: gdn-h200.json, a markdown table and a PNG chart of the speedups.

Ours is compared with fla and with FlashQLA: speedup = their time / ours (above 1: ours faster), in kernel time
against each one's target and in host-inclusive time. A null field, or one missing from a JSON written before its
column existed (FlashQLA's), was not measured: the table shows a dash and says so, the chart leaves that bar out.
Several runs (each measuring some cells) merge into one report (merge: the latest run of a cell wins; each row
keeps the date and commit of the run that measured it, and the report lists the runs).
Usage (to redraw from JSON files, later ones winning where they share a cell): python3 bench/gdn_report.py
JSON [JSON ...] OUT_DIR
"""

import json
import math
import os
import sys
from typing import NamedTuple


class Other(NamedTuple):
    name: str  # as the table and chart show it
    package: str  # its key in the run's versions
    target: float  # kernel time, its / ours, on every cell


# The implementations ours is measured against, by the prefix of their fields in a row.
OTHERS = {"fla": Other("fla", "fla", 1.5),  # issue 3
          "flashqla": Other("FlashQLA", "flash_qla", 1.25)}
NOT_MEASURED = "-"  # a table cell's value where the row's field is null or missing


def busy_time(intervals):
    """The length of the union of (start, end) intervals: the time during which at least one of them runs, so
    that kernels running side by side count once."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def cell_of(row):
    """What identifies a row's cell of the grid."""
    return row["pass"], row["h_qk"], row["h_v"], row["seqlens"]


def parse_cell(spec):
    """A cell outside the grid, as `--cell` spells it: PASS:HQK/HV:LENGTHS, LENGTHS the sequences' token counts
    separated by commas, each optionally repeated as LENGTH*COUNT (`fwd:2/4:32768`, `bwd:16/32:4096*8`). Returns
    (pass, h_qk, h_v, seqlens, lengths), seqlens the LENGTHS text (what the row is keyed by). A malformed spec raises
    ValueError naming the rule it breaks."""
    parts = spec.split(":")
    if len(parts) != 3:
        raise ValueError(f"--cell {spec!r}: expected PASS:HQK/HV:LENGTHS, e.g. fwd:2/4:32768")
    pass_, heads, seqlens = parts
    if pass_ not in ("fwd", "bwd"):
        raise ValueError(f"--cell {spec!r}: the pass must be fwd or bwd, got {pass_!r}")
    try:
        h_qk, h_v = (int(h) for h in heads.split("/"))
    except ValueError:
        raise ValueError(f"--cell {spec!r}: heads must be HQK/HV, two integers, got {heads!r}") from None
    if h_qk < 1 or h_v < 1 or h_v % h_qk != 0:
        raise ValueError(f"--cell {spec!r}: heads HQK/HV must be positive with HV a multiple of HQK, got {heads!r}")
    lengths = []
    for item in seqlens.split(","):
        length, _, count = item.partition("*")
        try:
            length, count = int(length), int(count) if count else 1
        except ValueError:
            raise ValueError(f"--cell {spec!r}: each length must be LENGTH or LENGTH*COUNT, got {item!r}") from None
        if length < 1 or count < 1:
            raise ValueError(f"--cell {spec!r}: lengths and counts must be positive, got {item!r}")
        lengths += [length] * count
    return pass_, h_qk, h_v, seqlens, lengths


def run_of(result):
    """How a row names the run that measured it."""
    return f"{result['date']} {result['commit']}"


def merge(results):
    """One result from several, in order: a cell measured by more than one keeps the last run's row; rows without
    a run of their own are tagged with their result's; the merged result takes the last one's date, commit, GPU and
    versions, and its rows the order of the first appearance of their cells."""
    if not results:
        raise ValueError("merge: no results")
    rows = {}
    for result in results:
        for row in result["rows"]:
            tagged = dict(row)
            tagged.setdefault("run", run_of(result))
            rows[cell_of(row)] = tagged  # a dict keeps the first insertion's position
    merged = {key: value for key, value in results[-1].items() if key != "rows"}
    merged["rows"] = list(rows.values())
    return merged


def _runs_summary(result):
    """A line naming the runs when the rows come from more than one."""
    runs = []
    for row in result["rows"]:
        if row.get("run", run_of(result)) not in runs:
            runs.append(row.get("run", run_of(result)))
    if len(runs) < 2:
        return []
    counts = [sum(1 for r in result["rows"] if r.get("run", run_of(result)) == run) for run in runs]
    return ["Rows from " + str(len(runs)) + " runs: " + "; ".join(f"{run} ({n} cells)" for run, n in zip(runs, counts)) +
            ".", ""]


def _ratio(row, other, what):
    ours, theirs = row.get(f"ours_{what}_ms"), row.get(f"{other}_{what}_ms")
    return None if ours is None or theirs is None else theirs / ours


def _target_summary(rows):
    """The lines that say where each kernel-time target holds (the table's rounding must not decide it)."""
    lines = []
    for other, (name, _, target) in OTHERS.items():
        measured = [r for r in rows if _ratio(r, other, "kernel") is not None]
        if not measured:
            lines.append(f"Kernel-time target {target}x over {name}: not measured.")
            continue
        below = [r for r in measured if _ratio(r, other, "kernel") < target]
        line = (f"Kernel-time target {target}x over {name}: met on {len(measured) - len(below)} of {len(measured)} "
                "measured cells")
        if below:
            line += "; below it: " + ", ".join(f"{r['pass']} {r['h_qk']}/{r['h_v']} {r['seqlens']} "
                                               f"({_ratio(r, other, 'kernel'):.3f}x)" for r in below)
        lines.append(line + ".")
    return lines + [""]


def _columns():
    """(header, the cell's text from a row) for every column after pass, h_qk/h_v and seqlens: per time, ours then
    each other's time and ratio (kernel ratios to three decimals, so that rounding cannot hide a miss such as 1.497x);
    then the errors."""
    def shown(value, spec, unit=""):
        return NOT_MEASURED if value is None else format(value, spec) + unit

    def field(impl, name, spec):
        return lambda r: shown(r.get(f"{impl}_{name}"), spec)

    def ratio(other, what, spec):
        return lambda r: shown(_ratio(r, other, what), spec, "x")

    columns = []
    for what, ratio_spec in (("kernel", ".3f"), ("host", ".2f")):
        columns.append((f"ours {what} ms", field("ours", f"{what}_ms", ".3f")))
        for other, (name, _, _) in OTHERS.items():
            columns += [(f"{name} {what} ms", field(other, f"{what}_ms", ".3f")),
                        (f"{name} / ours {what}", ratio(other, what, ratio_spec))]
    columns.append(("ours err", field("ours", "rel_err", ".2e")))
    columns += [(f"{name} err", field(other, "rel_err", ".2e")) for other, (name, _, _) in OTHERS.items()]
    return columns


def write(result, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gdn-h200.json"), "w") as f:
        json.dump(result, f, indent=1)
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    columns = _columns()
    lines = [f"# deltatrain cuda backend vs fla and FlashQLA on {result['gpu']}", "",
             f"{result['date']}, commit {result['commit']}, {versions}", "",
             "Kernel time: device time of one call (torch profiler), the union of its kernels' intervals (their "
             "sum where they run one after another; rows measured before 2026-12-03T21:00 took the sum, the same "
             "for kernels that did not overlap). Host: median wall time of "
             "one call among back-to-back calls (CUDA events). Speedup = their time / ours (above 1: ours faster). "
             "Errors: relative Frobenius error vs fp64 on the same inputs, max over o and final_state (fwd) or "
             f"dq, dk, dv, dg, dbeta, dh0 (bwd). '{NOT_MEASURED}': not measured (left out of the run, refused by that "
             "implementation, or a run from before its column).", "",
             *_runs_summary(result),
             *_target_summary(result["rows"]),
             "| pass | h_qk/h_v | seqlens | " + " | ".join(header for header, _ in columns) + " |",
             "|" + "---|" * (3 + len(columns))]
    for r in result["rows"]:
        lines.append(f"| {r['pass']} | {r['h_qk']}/{r['h_v']} | {r['seqlens']} | " +
                     " | ".join(cell(r) for _, cell in columns) + " |")
    with open(os.path.join(out, "gdn-h200.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    _chart(result, out, plt)


def _chart(result, out, plt):
    """Two panels, kernel time over host-inclusive, with one bar per cell and other implementation measured there;
    the kernel panel draws each target and hatches the bars below it."""
    rows = [r for r in result["rows"] if any(_ratio(r, other, "kernel") is not None for other in OTHERS)]
    drawn = [other for other in OTHERS if any(_ratio(r, other, "kernel") is not None for r in rows)]
    width = 0.8 / max(len(drawn), 1)
    fig, (kernel_ax, host_ax) = plt.subplots(2, 1, sharex=True, figsize=(max(8, len(rows) * 0.9), 8))
    for slot, other in enumerate(drawn):
        name, _, target = OTHERS[other]
        color = f"C{list(OTHERS).index(other)}"  # the same colour for an implementation whatever else was measured
        offset = (slot - (len(drawn) - 1) / 2) * width
        for ax, what in ((kernel_ax, "kernel"), (host_ax, "host")):
            measured = [(x, _ratio(r, other, what)) for x, r in enumerate(rows) if _ratio(r, other, what) is not None]
            bars = ax.bar([x + offset for x, _ in measured], [ratio for _, ratio in measured], width=width,
                          color=color, label=f"{name} / ours")
            if what == "kernel":
                for bar, (_, ratio) in zip(bars, measured):
                    if ratio < target:
                        bar.set_hatch("//")
                        bar.set_edgecolor("red")
                ax.axhline(target, color=color, linestyle="--", linewidth=1,
                           label=f"{target}x target over {name} (hatched: below)")
    for ax, what in ((kernel_ax, "kernel time"), (host_ax, "host-inclusive time")):
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylabel(f"speedup, {what} (x)")
        ax.legend(fontsize=8)
    host_ax.set_xticks(range(len(rows)))
    host_ax.set_xticklabels([f"{r['pass']} {r['h_qk']}/{r['h_v']}\n{r['seqlens']}" for r in rows], fontsize=7)
    against = " and ".join(f"{OTHERS[o].name} {result['versions'].get(OTHERS[o].package, '?')}" for o in drawn)
    kernel_ax.set_title(f"deltatrain cuda GDN vs {against} on {result['gpu']} (commit {result['commit']})")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "gdn-h200.png"), dpi=110)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: gdn_report.py JSON [JSON ...] OUT_DIR")
    loaded = []
    for path in sys.argv[1:-1]:
        with open(path) as f:
            loaded.append(json.load(f))
    write(merge(loaded), sys.argv[-1])
