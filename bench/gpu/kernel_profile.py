#!/usr/bin/env python3
"""Per-kernel GPU time from an ncu CSV (`ncu --metrics gpu__time_duration.sum --csv --log-file F ...`).

The launches are split into segments, each starting at a launch whose kernel name matches --split (e.g. the
embedding gather that opens every forward, so that one segment is one prefill or one decode step); the table is
of one segment (--segment, Python's indexing) or of every launch:

    kernel_profile.py ncu.csv --split embedding --segment -2 [--top 30] [--markdown]

Kernels are grouped by their name without template arguments and parameters; the table gives each group's total,
launch count, mean and share of the segment, largest first.
"""
import argparse
import collections
import csv
import re
import sys

UNIT_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}


def launches(path):
    """(kernel name, microseconds) per launch, in launch order."""
    with open(path, newline="") as f:
        rows = [line for line in f if line.startswith('"')]  # ncu's own ==PROF== lines are not CSV
    out = []
    for row in csv.DictReader(rows):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = row["Metric Unit"]
        if unit not in UNIT_TO_US:
            raise ValueError(f"{path}: unknown time unit {unit!r}")
        out.append((row["Kernel Name"], float(row["Metric Value"].replace(",", "")) * UNIT_TO_US[unit]))
    return out


def short_name(kernel):
    """`void ns::kernel<T, 4>(Params)` -> `ns::kernel`: launches of one kernel with other arguments group together."""
    name = re.sub(r"<?unnamed>::", "", re.sub(r"^void ", "", kernel))  # ncu writes anonymous namespaces both ways
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):
        if ch in "<(" and depth == 0:
            cut = i
            break
    return name[:cut].strip()


def segments(rows, split):
    """Launch lists, a new one at each launch whose name matches `split` (the launches before the first: segment 0)."""
    pattern = re.compile(split)
    out = [[]]
    for row in rows:
        if pattern.search(row[0]) and out[-1]:
            out.append([])
        out[-1].append(row)
    return out


def table(rows, top, markdown):
    groups = collections.defaultdict(lambda: [0.0, 0])
    for name, us in rows:
        g = groups[short_name(name)]
        g[0] += us
        g[1] += 1
    total = sum(us for _, us in rows)
    lines = []
    if markdown:
        lines += ["| kernel | total (us) | launches | mean (us) | share |", "|---|---|---|---|---|"]
    for name, (us, n) in sorted(groups.items(), key=lambda item: -item[1][0])[:top]:
        cells = (name, f"{us:.1f}", str(n), f"{us / n:.2f}", f"{100 * us / total:.1f}%")
        lines.append("| " + " | ".join(cells) + " |" if markdown else
                     f"{cells[0][:70]:70s} {cells[1]:>10s} {cells[2]:>6s} {cells[3]:>9s} {cells[4]:>6s}")
    lines.append(f"total {total:.1f} us in {len(rows)} launches")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--split", help="regex of the kernel that opens a segment")
    parser.add_argument("--segment", type=int, help="which segment to tabulate (default: list the segments)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = launches(args.csv)
    if not rows:
        sys.exit(f"{args.csv}: no gpu__time_duration.sum rows")
    if args.split is None:
        print(table(rows, args.top, args.markdown))
        return
    parts = segments(rows, args.split)
    if args.segment is None:
        for i, part in enumerate(parts):
            print(f"segment {i}: {len(part)} launches, {sum(us for _, us in part):.1f} us")
        return
    print(table(parts[args.segment], args.top, args.markdown))


if __name__ == "__main__":
    main()
