"""An A/B of the cuda backend's GDN kernels: runs of `bench/gdn_h200.py --ours-only` with a baseline module and
with the change, alternated in one lease (`bench/gpu/gpu.sh ab`), compared cell by cell.

For each cell both sides measured: every run's kernel time, the change of the medians (negative: the change is
faster), whether every run of both sides gave the same error against fp64 (a change meant to keep the arithmetic
must leave it equal to the last digit; one that changes it on purpose is read by each side's errors), and per kernel
the fastest run of each side where that moved by more than 1% (a kernel on one side only, renamed or new, is listed
with the other side empty). A cell that one side did not
measure (a run's time limit) is named, not compared.

Writes gdn-ab.json (the comparison and every run it read) and gdn-ab.md into --out.
Usage: python3 bench/gdn_ab.py --base RUN.json [RUN.json ...] --new RUN.json [RUN.json ...] --out DIR
       [--label-base NAME] [--label-new NAME]
"""

import statistics
import sys

import ab_runs
from gdn_report import cell_of

MOVED = 0.01  # a kernel whose fastest run changed by more than this fraction is listed


def cell_name(cell):
    pass_, h_qk, h_v, seqlens = cell
    return f"{pass_} {h_qk}/{h_v} {seqlens}"


def fastest(rows, kernel):
    """The least time of `kernel` over the runs' rows that have it, or None."""
    times = [row["ours_kernels_ms"][kernel] for row in rows if kernel in row.get("ours_kernels_ms", {})]
    return min(times) if times else None


def compare(base_runs, new_runs):
    """Cells in the order the first base run measured them (the grid's), then the new runs' others."""
    def rows_by_cell(runs):
        cells = {}
        for run in runs:
            for row in run["rows"]:
                if row.get("ours_kernel_ms") is not None:
                    cells.setdefault(cell_of(row), []).append(row)
        return cells

    base, new = rows_by_cell(base_runs), rows_by_cell(new_runs)
    order = list(dict.fromkeys(list(base) + list(new)))
    compared, one_side = [], []
    for cell in order:
        if cell not in base or cell not in new:
            one_side.append({"cell": cell_name(cell), "side": "base" if cell in base else "new"})
            continue
        base_ms = [row["ours_kernel_ms"] for row in base[cell]]
        new_ms = [row["ours_kernel_ms"] for row in new[cell]]
        errors = {side: sorted({row["ours_rel_err"] for row in rows}) for side, rows in (("base", base[cell]),
                                                                                     ("new", new[cell]))}
        kernels = {}
        names = dict.fromkeys(k for row in base[cell] + new[cell] for k in row.get("ours_kernels_ms", {}))
        for kernel in names:
            before, after = fastest(base[cell], kernel), fastest(new[cell], kernel)
            if before is None or after is None or abs(after / before - 1) > MOVED:
                kernels[kernel] = {"base": before, "new": after}
        compared.append({"cell": cell_name(cell), "base_kernel_ms": base_ms, "new_kernel_ms": new_ms,
                         "change": statistics.median(new_ms) / statistics.median(base_ms) - 1,
                         "errors_equal": len(set(errors["base"]) | set(errors["new"])) == 1, "rel_err": errors,
                         "kernels_moved": kernels})
    return compared, one_side


def markdown(compared, one_side, labels):
    def times(values):
        return " / ".join(f"{v:.4f}" for v in values)

    def kernel_ms(value):
        return "-" if value is None else f"{value:.3f}"

    lines = [f"# GDN A/B: {labels['base']} (base) against {labels['new']} (new)", "",
             "Kernel ms per call, each run (runs alternated in one lease); change of the medians; the errors "
             "against fp64 equal in every run of both sides, or each side's (base -> new, every distinct value); "
             f"kernels whose fastest run moved by more than {MOVED:.0%} (base -> new).", "",
             "| cell | base kernel ms | new kernel ms | change | errors | kernels moved |",
             "|---|---|---|---|---|---|"]

    def errors(row):
        if row["errors_equal"]:
            return "equal"
        return " -> ".join(" / ".join(f"{e:.5e}" for e in row["rel_err"][side]) for side in ("base", "new"))

    for row in compared:
        moved = ", ".join(f"{k} {kernel_ms(v['base'])} -> {kernel_ms(v['new'])}"
                          for k, v in row["kernels_moved"].items())
        lines.append(f"| {row['cell']} | {times(row['base_kernel_ms'])} | {times(row['new_kernel_ms'])} | "
                     f"{row['change']:+.1%} | {errors(row)} | {moved or '-'} |")
    if one_side:
        lines += ["", "Measured on one side only (not compared): " +
                  ", ".join(f"{c['cell']} ({c['side']})" for c in one_side) + "."]
    return "\n".join(lines) + "\n"


def summarise(base_runs, new_runs, labels):
    compared, one_side = compare(base_runs, new_runs)
    return {"cells": compared, "one_side": one_side}, markdown(compared, one_side, labels)


def main(argv=None):
    return ab_runs.main(argv, __doc__, "gdn-ab", summarise)


if __name__ == "__main__":
    sys.exit(main())
