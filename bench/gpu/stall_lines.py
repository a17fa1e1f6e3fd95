"""Where a kernel's time goes, by source line: ncu's warp-state samples per SASS instruction joined with the line
table of the same build's cubin. The samples, on the GPU machine (README, "Reproducing the GPU results"):

  WRAP="ncu --clock-control none --kernel-name regex:prepare --launch-skip 2 --launch-count 1 --section SourceCounters
        --section WarpStateStats --import-source yes -f -o OUT/source" \
    bench/gpu/gpu.sh python OUT bench/gpu/profile_state.py 2 8 8192 fwd
  ncu --import OUT/source.ncu-rep --page source --csv --print-source sass | gzip > OUT/source-sass.csv.gz

then here:

  cuobjdump -xelf all build-li/gdn/CMakeFiles/deltatrain_gdn.dir/cuda/prepare.cu.o
  nvdisasm -gi -c prepare.sm_90a.cubin > prepare.sass
  python3 bench/gpu/stall_lines.py prepare.sass prepare_kernelI13__nv_bfloat16Li128 source-sass.csv.gz prepare.cu

The build must be the one the samples came from, compiled with -lineinfo. Each instruction is charged to the
innermost line of FILE in its inlining chain (--by outer: the line of FILE the chain starts from; --by inner:
the innermost line of any file). Prints the lines with the most samples, their executed instructions and
their main stall reasons.
"""

import argparse
import collections
import csv
import gzip
import re

STALLS = ("barrier", "short_sb", "long_sb", "wait", "mio", "lg", "math", "selected", "not_selected",
          "branch_resolving", "no_inst", "dispatch")
LINE = re.compile(r'\s*//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')
INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)")


def instruction_lines(sass_path, kernel, source, by):
    """Offset of each instruction of the kernel's section -> the line it is charged to."""
    lines, charged, inside = {}, None, False
    chain = []
    with open(sass_path) as f:
        for text in f:
            if text.startswith(".text."):
                if inside:
                    break
                inside = kernel in text
                continue
            if not inside:
                continue
            m = LINE.match(text)
            if m:
                chain.append(m.groups())
                continue
            m = INSTRUCTION.match(text)
            if not m:
                continue
            if chain:  # a new group of line comments: innermost first, then where it was inlined
                charged = charge(chain, source, by)
                chain = []
            lines[int(m.group(1), 16)] = charged
    if not lines:
        raise SystemExit(f"no section of {sass_path} names {kernel!r}")
    return lines


def charge(chain, source, by):
    if by == "inner":
        file, line = chain[0][0], chain[0][1]
        return f"{file.rsplit('/', 1)[-1]}:{line}"
    frames = [(f, n) for f, n, _, _ in chain]  # innermost first, each the call site of the one before
    if chain[-1][2]:
        frames.append((chain[-1][2], chain[-1][3]))
    in_source = [int(n) for f, n in frames if f.endswith(source)]
    if not in_source:
        return None
    return f"{source}:{in_source[0] if by == 'deep' else in_source[-1]}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sass", help="nvdisasm -gi -c output of the cubin")
    parser.add_argument("kernel", help="a piece of the kernel's mangled name that picks its section")
    parser.add_argument("samples", help="source-sass.csv.gz: ncu's source page of the kernel, per SASS instruction")
    parser.add_argument("source", help="the source file to charge lines of, e.g. prepare.cu")
    parser.add_argument("--by", choices=["deep", "outer", "inner"], default="deep")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()

    lines = instruction_lines(args.sass, args.kernel, args.source, args.by)
    with gzip.open(args.samples, "rt") as f:
        rows = list(csv.reader(f))
    header, data = rows[1], rows[2:]
    column = {name: i for i, name in enumerate(header)}
    first = int(data[0][0], 16)
    per_line = collections.defaultdict(collections.Counter)
    total = 0
    for row in data:
        count = int(row[column["Warp Stall Sampling (All Samples)"]] or 0)
        total += count
        entry = per_line[lines.get(int(row[0], 16) - first)]
        entry["samples"] += count
        entry["instructions"] += int(row[column["Instructions Executed"]] or 0)
        for stall in STALLS:
            entry[stall] += int(row[column[f"stall_{stall}"]] or 0)
    print(f"{total} samples")
    for line, entry in sorted(per_line.items(), key=lambda kv: -kv[1]["samples"])[:args.top]:
        reasons = " ".join(f"{s}={entry[s]}" for s in STALLS if entry[s] > 0.03 * entry["samples"])
        print(f"{str(line):>22} {100 * entry['samples'] / max(total, 1):5.1f}%  "
              f"warp instructions {entry['instructions']:>10}  {reasons}")


if __name__ == "__main__":
    main()
