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

--regions NAME:FIRST-LAST,... sums them by named ranges of FILE's lines instead (e.g. the roles of a kernel split by
warpgroup, or its stages): each instruction goes to the innermost line of FILE in its chain that lies in a range, so a
helper inlined from several places is charged to each caller's region. Each region's share of the samples and of its
own samples per stall reason; a warp waiting at a barrier is sampled at the instruction after it, so a region's
"barrier" is the wait at the barrier it opens with.

--waits charges each line's (or region's) barrier samples to the wait they follow instead: the nearest waiting
instruction at most WAIT_REACH instructions before the sampled one (a named barrier by its number, an mbarrier, a
cluster barrier, a wgmma group), so that a kernel split by role shows which hand-over each role waits for.
"""

import argparse
import collections
import csv
import gzip
import re

STALLS = ("barrier", "short_sb", "long_sb", "wait", "mio", "lg", "math", "selected", "not_selected",
          "branch_resolving", "no_inst", "dispatch", "membar", "drain", "imc", "misc")
LINE = re.compile(r'\s*//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')
INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)")
CUOBJDUMP_FUNCTION = re.compile(r"[ \t]*Function : \S+")


# How far back from a sampled instruction its wait may lie (a warp that waited is sampled a few instructions on).
WAIT_REACH = 12
WAITS = ((re.compile(r"\bBAR\.SYNC\S*\s+(0x[0-9a-f]+|\d+)"), lambda m: f"bar {int(m.group(1), 0)}"),
         (re.compile(r"\bBAR\.SYNC\b"), lambda m: "bar 0"),
         (re.compile(r"\bSYNCS\.PHASECHK"), lambda m: "mbarrier"),
         (re.compile(r"\bUCGABAR_WAIT\b"), lambda m: "cluster barrier"),
         (re.compile(r"\bWARPGROUP\.DEPBAR"), lambda m: "wgmma group"))


def kernel_section(sass_path, kernel):
    """The lines of the first section of the listing whose header names `kernel` (a piece of it): nvdisasm's
    `.text.NAME:` or cuobjdump -sass's `Function : NAME`."""
    inside = False
    with open(sass_path) as f:
        for text in f:
            if text.startswith(".text.") or CUOBJDUMP_FUNCTION.match(text):
                if inside:
                    return
                inside = kernel in text
            elif inside:
                yield text


def kernel_instructions(sass_path, kernel):
    """The kernel's section, instruction by instruction: (offset, the line comments' chain in effect, innermost first
    as (file, line, inlined-at file, inlined-at line), the instruction's text)."""
    instructions, chain, group = [], [], []
    for text in kernel_section(sass_path, kernel):
        m = LINE.match(text)
        if m:
            group.append(m.groups())
            continue
        m = INSTRUCTION.match(text)
        if not m:
            continue
        if group:  # a new group of line comments: innermost first, then where it was inlined
            chain, group = group, []
        instructions.append((int(m.group(1), 16), chain, m.group(2)))
    if not instructions:
        raise SystemExit(f"no section of {sass_path} names {kernel!r}")
    return instructions


def charged_lines(instructions, source, by, regions=None):
    """Offset of each of kernel_instructions' instructions -> the line (or region) it is charged to."""
    return {offset: charge(chain, source, by, regions) if chain else None for offset, chain, _ in instructions}


def instruction_lines(sass_path, kernel, source, by, regions=None):
    """Offset of each instruction of the kernel's section -> the line it is charged to."""
    return charged_lines(kernel_instructions(sass_path, kernel), source, by, regions)


def wait_before(texts, index):
    """The wait that the instruction at `index` of the kernel's texts follows, or None."""
    for text in reversed(texts[max(index - WAIT_REACH, 0):index]):
        for pattern, name in WAITS:
            m = pattern.search(text)
            if m:
                return name(m)
    return None


def charge(chain, source, by, regions=None):
    if by == "inner":
        file, line = chain[0][0], chain[0][1]
        return f"{file.rsplit('/', 1)[-1]}:{line}"
    frames = [(f, n) for f, n, _, _ in chain]  # innermost first, each the call site of the one before
    if chain[-1][2]:
        frames.append((chain[-1][2], chain[-1][3]))
    in_source = [int(n) for f, n in frames if f.endswith(source)]
    if regions is not None:
        return next((name for line in in_source for name, (first, last) in regions.items() if first <= line <= last),
                    None)
    if not in_source:
        return None
    return f"{source}:{in_source[0] if by == 'deep' else in_source[-1]}"


def sample_rows(samples_path):
    """ncu's per-instruction CSV as (offset from the kernel's first instruction, {column: value}) rows."""
    with gzip.open(samples_path, "rt") as f:
        rows = list(csv.reader(f))
    header, data = rows[1], rows[2:]
    first = int(data[0][0], 16)
    return [(int(row[0], 16) - first, dict(zip(header, row))) for row in data]


def count(row, column):
    return int(row.get(column) or 0)


def samples_by(lines, rows):
    """(all samples, {what an instruction is charged to: Counter of samples, instructions and each stall}) from ncu's
    per-instruction rows (sample_rows). A stall the report lacks counts nothing."""
    per_key = collections.defaultdict(collections.Counter)
    total = 0
    for offset, row in rows:
        samples = count(row, "Warp Stall Sampling (All Samples)")
        total += samples
        entry = per_key[lines.get(offset)]
        entry["samples"] += samples
        entry["instructions"] += count(row, "Instructions Executed")
        for stall in STALLS:
            entry[stall] += count(row, f"stall_{stall}")
    return total, per_key


def barrier_waits_by(instructions, lines, rows):
    """{what an instruction is charged to: Counter of its barrier samples by the wait they follow (wait_before)}, from
    ncu's per-instruction rows (sample_rows)."""
    offsets = {offset: i for i, (offset, _, _) in enumerate(instructions)}
    texts = [text for _, _, text in instructions]
    per_key = collections.defaultdict(collections.Counter)
    for offset, row in rows:
        samples = count(row, "stall_barrier")
        if samples:
            per_key[lines.get(offset)][wait_before(texts, offsets[offset])] += samples
    return per_key


def parse_regions(text):
    """NAME:FIRST-LAST,... -> {name: (first, last)}, in the order given."""
    regions = {}
    for part in text.split(","):
        name, _, span = part.partition(":")
        first, _, last = span.partition("-")
        if not (name and first.isdigit() and last.isdigit() and int(first) <= int(last)):
            raise argparse.ArgumentTypeError(f"--regions: {part!r} is not NAME:FIRST-LAST with FIRST <= LAST")
        regions[name] = (int(first), int(last))
    return regions


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sass", help="nvdisasm -gi -c output of the cubin")
    parser.add_argument("kernel", help="a piece of the kernel's mangled name that picks its section")
    parser.add_argument("samples", help="source-sass.csv.gz: ncu's source page of the kernel, per SASS instruction")
    parser.add_argument("source", help="the source file to charge lines of, e.g. prepare.cu")
    parser.add_argument("--by", choices=["deep", "outer", "inner"], default="deep")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--regions", type=parse_regions, help="NAME:FIRST-LAST,...: sum by ranges of FILE's lines")
    parser.add_argument("--waits", action="store_true", help="each line's or region's barrier samples by the wait "
                        "they follow")
    args = parser.parse_args()

    instructions = kernel_instructions(args.sass, args.kernel)
    lines = charged_lines(instructions, args.source, args.by, args.regions)
    rows = sample_rows(args.samples)
    total, per_line = samples_by(lines, rows)
    print(f"{total} samples")
    if args.waits:
        waits = barrier_waits_by(instructions, lines, rows)
        for key, entry in sorted(waits.items(), key=lambda kv: -sum(kv[1].values()))[:args.top]:
            share = lambda n: f"{100 * n / max(per_line[key]['samples'], 1):.0f}%"
            print(f"{str(key):>22}  " + "  ".join(f"{wait}: {share(n)}" for wait, n in entry.most_common()))
        return
    if args.regions is not None:
        for name in [*args.regions, None]:
            entry = per_line[name]
            reasons = " ".join(f"{s}={100 * entry[s] / max(entry['samples'], 1):.0f}%" for s in STALLS
                               if entry[s] > 0.02 * entry["samples"])
            print(f"{str(name):>12} {100 * entry['samples'] / max(total, 1):5.1f}%  "
                  f"warp instructions {entry['instructions']:>10}  {reasons}")
        return
    for line, entry in sorted(per_line.items(), key=lambda kv: -kv[1]["samples"])[:args.top]:
        reasons = " ".join(f"{s}={entry[s]}" for s in STALLS if entry[s] > 0.03 * entry["samples"])
        print(f"{str(line):>22} {100 * entry['samples'] / max(total, 1):5.1f}%  "
              f"warp instructions {entry['instructions']:>10}  {reasons}")


if __name__ == "__main__":
    main()
