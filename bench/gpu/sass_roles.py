"""What each warp role of a kernel runs per iteration, from its SASS alone (no GPU): the kernel's section of an
`nvdisasm -c -gi` (or `cuobjdump -sass`) listing split into roles at its USETMAXREG instructions (a kernel split into
producer and consumer warpgroups gives each its registers with setmaxnreg, and ptxas keeps each role's code
contiguous after it), and each role's loops found by their back edges, with the loop body's instructions by class.

  cuobjdump -xelf all build/gdn/CMakeFiles/deltatrain_gdn.dir/cuda/role_split_backward.cu.o
  nvdisasm -c -gi role_split_backward.sm_90a.cubin > rs.sass
  python3 bench/gpu/sass_roles.py rs.sass role_split_backward_pair_kernelI13__nv_bfloat16E [--markdown]

A role is the code from one USETMAXREG to the next (the last one ends at the kernel's last EXIT: what follows it is
out-of-line code, e.g. mbarrier-wait retry stubs, jumped to from every role); code before the first is the prologue;
a kernel without USETMAXREG is one role. A loop is a BRA to a lower offset of the same role; its body runs from the
target to the branch (one loop per target: a second back edge to the same head, a `continue`, widens it). Counts are
static instructions, not executed ones: a loop body's mix is what one iteration issues when no branch inside is taken.
"""

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stall_lines import INSTRUCTION, kernel_instructions, kernel_section  # noqa: E402  (one parser of listings)

# Instruction classes counted per loop, by opcode; the first matching prefix wins (LDGSTS before LDG, BAR.SYNC
# and BAR.ARV apart from the other BAR forms), so "LDS" here must not catch LDSM: prefixes end at a "." or the end.
CLASSES = ("HGMMA", "MUFU", "BAR.SYNC", "BAR.ARV", "SYNCS", "SHFL", "LDS", "STS", "LDSM", "STSM", "LDG", "STG",
           "LDGSTS", "LDL", "STL", "FFMA", "FMUL", "FADD", "FSEL", "F2FP", "other")
PREDICATE = re.compile(r"@!?U?P(?:T|\d+)\s+")
NVDISASM_LABEL = re.compile(r"(\.L_x_\d+):\s*$")
TARGET = re.compile(r"`\((\.L_x_\d+)\)|\b(0x[0-9a-f]+)\s*;")  # nvdisasm names a label, cuobjdump an offset

Region = collections.namedtuple("Region", "name start end instructions loops")  # start, end: first and last offset
Loop = collections.namedtuple("Loop", "start end instructions classes")


def opcode(text):
    """`@!P0 BRA `(.L_x_1) ;` -> `BRA`: the mnemonic with its modifiers, without the predicate."""
    return PREDICATE.sub("", text.strip(), count=1).split(None, 1)[0].rstrip(";")


def instruction_class(op):
    return next((c for c in CLASSES[:-1] if op == c or op.startswith(c + ".")), "other")


def label_offsets(sass_path, kernel):
    """{label: offset of the instruction it marks} in the kernel's nvdisasm section (kernel_instructions keeps only
    instructions, and nvdisasm's branches name labels)."""
    labels, pending = {}, []
    for text in kernel_section(sass_path, kernel):
        m = NVDISASM_LABEL.match(text)
        if m:
            pending.append(m.group(1))
            continue
        m = INSTRUCTION.match(text)
        if m:
            labels.update((label, int(m.group(1), 16)) for label in pending)
            pending = []
    return labels


def branch_target(text, labels):
    m = TARGET.search(text)
    if not m:
        return None
    return labels.get(m.group(1)) if m.group(1) else int(m.group(2), 16)


def role_name(text):
    """`USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xb8 ;` -> `ALLOC 184`: what the role asks for, in registers a thread."""
    count = re.search(r"(0x[0-9a-f]+|\d+)\s*;", text)
    return f"{'DEALLOC' if 'DEALLOC' in opcode(text) else 'ALLOC'} {int(count.group(1), 0) if count else '?'}"


def regions(instructions, labels):
    """[Region] of the kernel in offset order: the prologue (if any), each role, then the out-of-line code after the
    last EXIT (if any). `instructions`: kernel_instructions' (offset, chain, text); `labels`: label_offsets'."""
    ops = [opcode(text) for _, _, text in instructions]
    exits = [i for i, op in enumerate(ops) if op == "EXIT"]
    main_end = exits[-1] + 1 if exits else len(instructions)  # index past the main code
    marks = [i for i, op in enumerate(ops[:main_end]) if op.startswith("USETMAXREG")]
    spans = [("kernel", 0, main_end)] if not marks else (
        ([("prologue", 0, marks[0])] if marks[0] else [])
        + [(role_name(instructions[i][2]), i, j) for i, j in zip(marks, marks[1:] + [main_end])])
    if main_end < len(instructions):
        spans.append(("out-of-line", main_end, len(instructions)))
    result = []
    for name, first, past in spans:
        offsets = [offset for offset, _, _ in instructions[first:past]]
        heads = {}  # loop head offset -> index of its furthest back edge
        for i in range(first, past):
            if ops[i].startswith("BRA"):
                target = branch_target(instructions[i][2], labels)
                if target is not None and offsets[0] <= target < instructions[i][0]:
                    heads[target] = max(heads.get(target, i), i)
        loops = []
        for head, last in sorted(heads.items()):
            body = [op for (offset, _, _), op in zip(instructions[first:last + 1], ops[first:last + 1])
                    if offset >= head]
            loops.append(Loop(head, instructions[last][0], len(body),
                              collections.Counter(instruction_class(op) for op in body)))
        result.append(Region(name, offsets[0], offsets[-1], past - first, loops))
    return result


def kernel_regions(sass_path, kernel):
    try:
        instructions = kernel_instructions(sass_path, kernel)
    except SystemExit:
        raise SystemExit(f"sass_roles: the kernel argument {kernel!r} names no section of {sass_path}") from None
    return regions(instructions, label_offsets(sass_path, kernel))


def class_counts(counter):
    return " ".join(f"{c}={counter[c]}" for c in CLASSES if counter[c])


def markdown(found):
    """One row per role (the prologue and out-of-line code left out): its largest loop's mix, in the classes that
    any row has."""
    roles = [r for r in found if r.name not in ("prologue", "out-of-line")]
    largest = [max(r.loops, key=lambda loop: loop.instructions, default=None) for r in roles]
    columns = [c for c in CLASSES if any(loop and loop.classes[c] for loop in largest)]
    def row(cells):
        return "| " + " | ".join(cells) + " |"
    lines = [row(["role", "role instrs", "loop", "loop instrs", *columns]), "|" + "---|" * (4 + len(columns))]
    for r, loop in zip(roles, largest):
        cells = ([f"0x{loop.start:x}-0x{loop.end:x}", str(loop.instructions)] + [str(loop.classes[c]) for c in columns]
                 if loop else ["none", ""] + [""] * len(columns))
        lines.append(row([r.name, str(r.instructions), *cells]))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sass", help="nvdisasm -c -gi (or cuobjdump -sass) listing of the cubin")
    parser.add_argument("kernel", help="a piece of the kernel's mangled name that picks its section")
    parser.add_argument("--markdown", action="store_true", help="a table of each role's largest loop, for NOTES.md")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.sass):
        raise SystemExit(f"sass_roles: the sass argument {args.sass!r} is not a file")
    found = kernel_regions(args.sass, args.kernel)
    if args.markdown:
        print(markdown(found))
        return
    for r in found:
        print(f"{r.name:>12}  0x{r.start:x}-0x{r.end:x}: {r.instructions} instructions")
        for loop in r.loops if r.name != "out-of-line" else []:  # its loops are retry spins, one per wait
            print(f"{'':>14}loop 0x{loop.start:x}-0x{loop.end:x}: {loop.instructions} instructions  "
                  f"{class_counts(loop.classes)}")


if __name__ == "__main__":
    main()
