#!/usr/bin/env python3
"""Where the GPU waits: the idle gaps between a step's GPU activities in an nsys trace (its SQLite export),
summed by the kernel that ends each gap, with the step's busy and idle totals.

    nsys profile -o step --export sqlite BINARY ...   (or: nsys export --type sqlite step.nsys-rep)
    bench/gpu/timeline_gaps.py step.sqlite [--min-gap-us 5] [--top 25] [--window-start-ms X --window-ms Y]
"""
import argparse
import sqlite3


def activities(db):
    """(start_ns, end_ns, name) of every kernel, memset and memcpy, in start order."""
    names = dict(db.execute("SELECT id, value FROM StringIds"))
    rows = [(s, e, names.get(n, str(n))) for s, e, n in
            db.execute("SELECT start, end, shortName FROM CUPTI_ACTIVITY_KIND_KERNEL")]
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if "CUPTI_ACTIVITY_KIND_MEMSET" in tables:
        rows += [(s, e, "[memset]") for s, e in db.execute("SELECT start, end FROM CUPTI_ACTIVITY_KIND_MEMSET")]
    if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
        rows += [(s, e, "[memcpy]") for s, e in db.execute("SELECT start, end FROM CUPTI_ACTIVITY_KIND_MEMCPY")]
    return sorted(rows)


def gaps(rows, min_gap_ns):
    """Busy and idle ns over the rows' span, and the idle gaps over min_gap_ns by the activity ending them."""
    busy = idle = 0
    by_next = {}
    horizon = rows[0][0]
    for start, end, name in rows:
        if start > horizon:
            gap = start - horizon
            idle += gap
            if gap >= min_gap_ns:
                total, count = by_next.get(name, (0, 0))
                by_next[name] = (total + gap, count + 1)
        busy += max(0, end - max(start, horizon))
        horizon = max(horizon, end)
    return busy, idle, by_next


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sqlite")
    parser.add_argument("--min-gap-us", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--window-start-ms", type=float, default=None, help="from the first activity")
    parser.add_argument("--window-ms", type=float, default=None)
    args = parser.parse_args()
    rows = activities(sqlite3.connect(args.sqlite))
    if args.window_start_ms is not None:
        begin = rows[0][0] + args.window_start_ms * 1e6
        end = begin + (args.window_ms or 1e12) * 1e6
        rows = [r for r in rows if begin <= r[0] < end]
    busy, idle, by_next = gaps(rows, args.min_gap_us * 1e3)
    print(f"span {(busy + idle) / 1e6:.2f} ms: busy {busy / 1e6:.2f} ms, idle {idle / 1e6:.2f} ms "
          f"in {len(rows)} activities")
    print(f"| gaps of at least {args.min_gap_us} us, before | total (us) | gaps |\n|---|---|---|")
    for name, (total, count) in sorted(by_next.items(), key=lambda x: -x[1][0])[:args.top]:
        print(f"| {name[:90]} | {total / 1e3:.1f} | {count} |")


if __name__ == "__main__":
    main()
