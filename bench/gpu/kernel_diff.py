#!/usr/bin/env python3
"""Which kernels of one CUDA source a change touches, and what ptxas made of them, without a GPU.

Compiles SOURCE with the build's own nvcc command twice, as the working tree has it and as git revision BASE has
it (in a temporary worktree), and prints per __global__ kernel of one architecture (sm_90a unless --arch): its
registers and spill stores on both sides, ptxas's numbered performance notes (C7512 and C7514: its wgmma serialised;
C7517 and C7519: a wait or an arrive injected), and whether its SASS is the same instruction for instruction (cuobjdump,
addresses and encodings stripped; unless --exact, also the offsets of kernel parameters in constant bank 0, which
move for every kernel when a field is added to the parameter block). A kernel whose SASS is unchanged runs as it did, so an A/B need not measure it;
a kernel whose spills grew is the first suspect when one gets slower (bench/NOTES.md, GDN "Lessons").

Usage: python3 bench/gpu/kernel_diff.py --build build-state --base main gdn/cuda/state_hopper.cu [--match REGEX]
       [--rename PATTERN REPLACEMENT]   (applied to the base's kernel names, e.g. for a template argument added)

cuobjdump comes from $CUOBJDUMP, PATH or the nvidia-cuda-cuobjdump wheel in .venv, and runs the nvdisasm beside it
(the nvidia-cuda-nvdisasm wheel) or on PATH; c++filt demangles the names.
"""
import argparse
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The names nvcc gives anonymous namespaces and file-local symbols depend on the source's path, which differs
# between the worktree and the checkout.
FILE_LOCAL = re.compile(r"(_GLOBAL__N__|_INTERNAL_)[0-9a-f]{8}_\d+_\w+?_[0-9a-f]{8}")


def find_cuobjdump():
    for candidate in [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"),
                      *glob.glob(os.path.join(REPO, ".venv/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump"))]:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    sys.exit("kernel_diff: no cuobjdump (set CUOBJDUMP, or pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm "
             "into .venv)")


def compile_command(build, source):
    """The build's command that compiles `source` into its object, and that object's path."""
    source = os.path.abspath(source)
    with open(os.path.join(build, "build.ninja")) as f:
        for line in f:
            match = re.match(r"build (\S+\.o): \S+ (\S+)", line)
            if match and os.path.abspath(match.group(2)) == source:
                obj = match.group(1)
                commands = subprocess.run(["ninja", "-C", build, "-t", "commands", obj], check=True,
                                          capture_output=True, text=True).stdout.strip().splitlines()
                return commands[-1], obj
    sys.exit(f"kernel_diff: {source} is not compiled in {build}/build.ninja")


def compile_object(build, command, obj, root, out):
    """Runs the build's compile command with the repository at `root`, writing `out`; returns ptxas's -v report."""
    command = command.replace(REPO, root).replace(f"-o {obj}", f"-o {out}") + " -Xptxas -v"
    result = subprocess.run(command, shell=True, capture_output=True, text=True, cwd=build)
    if result.returncode != 0:
        sys.exit(f"kernel_diff: the compile failed in {root}:\n{result.stderr[-4000:]}")
    return result.stderr


def ptxas_resources(report, arch):
    """{mangled kernel: (registers, spill store bytes)} for the entries compiled for `arch`."""
    resources, current = {}, None
    for line in report.splitlines():
        entry = re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line)
        if entry:
            current = entry.group(1) if entry.group(2) == arch else None
            continue
        if current is None:
            continue
        spills = re.search(r"(\d+) bytes spill stores", line)
        if spills:
            resources[current] = [None, int(spills.group(1))]
        registers = re.search(r"Used (\d+) registers", line)
        if registers and current in resources:
            resources[current][0] = int(registers.group(1))
    return {name: tuple(values) for name, values in resources.items()}


def ptxas_notes(report):
    """{mangled kernel: "CODE xN, ..."} of ptxas's numbered notes on wgmma (e.g. C7512: its products serialised, each
    followed by a wait, which costs more than any spill); the report names the function, not the architecture."""
    counts = {}
    for line in report.splitlines():
        note = re.search(r"\((C\d{4})\) .* function '(\S+)'", line)
        if note:
            codes = counts.setdefault(note.group(2), {})
            codes[note.group(1)] = codes.get(note.group(1), 0) + 1
    return {name: ", ".join(f"{code} x{n}" for code, n in sorted(codes.items())) for name, codes in counts.items()}


def digests_of_sass(text, exact=False):
    """{mangled kernel: digest of its SASS} from cuobjdump -sass output, without addresses, encodings and the
    path-dependent names of file-local symbols (and, unless exact, the offsets of kernel parameters)."""
    digests, name, body = {}, None, []
    for line in text.splitlines() + ["Function : <end>"]:
        function = re.search(r"Function : (\S+)", line)
        if function:
            if name is not None:
                digests[name] = hashlib.sha1("\n".join(body).encode()).hexdigest()
            name, body = function.group(1), []
            continue
        instruction = FILE_LOCAL.sub(r"\1", re.sub(r"/\*[0-9a-f]{4,}\*/|/\* 0x[0-9a-f]+ \*/", "", line)).strip()
        if not exact:
            instruction = re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][param]", instruction)
        if instruction:
            body.append(instruction)
    return digests


def sass_digests(cuobjdump, obj, arch, exact):
    # cuobjdump disassembles through nvdisasm, which the wheels install beside it but not on PATH.
    env = dict(os.environ, PATH=os.path.dirname(cuobjdump) + os.pathsep + os.environ.get("PATH", ""))
    text = subprocess.run([cuobjdump, "-sass", "-arch", arch, obj], check=True, capture_output=True, text=True,
                          env=env).stdout
    return digests_of_sass(text, exact)


def readable(table):
    """The table keyed by demangled names without namespaces (c++filt, where there is one)."""
    names = list(table)
    pretty = names
    if shutil.which("c++filt"):
        pretty = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    shorten = lambda s: re.sub(r"\(Params\)$|^void ", "", re.sub(r"\(anonymous namespace\)::|deltatrain::\w+::(\w+::)?", "", s))
    return {shorten(p): table[name] for name, p in zip(names, pretty)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a .cu file of the repository that the build compiles")
    parser.add_argument("--build", required=True, help="a configured CMake build folder (Ninja)")
    parser.add_argument("--base", required=True, help="the git revision to compare against (e.g. main)")
    parser.add_argument("--arch", default="sm_90a", help="the architecture whose kernels to compare")
    parser.add_argument("--match", default="", help="only kernels whose demangled name matches this regex")
    parser.add_argument("--exact", action="store_true", help="parameter offsets count as a change too")
    parser.add_argument("--rename", nargs=2, metavar=("PATTERN", "REPLACEMENT"),
                        help="re.sub applied to the base's kernel names, so that renamed kernels pair up")
    args = parser.parse_args(argv)
    build = os.path.abspath(args.build)
    cuobjdump = find_cuobjdump()
    command, obj = compile_command(build, args.source)
    with tempfile.TemporaryDirectory(prefix="kernel_diff-") as scratch:
        worktree = os.path.join(scratch, "base")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "--quiet", worktree, args.base], check=True)
        try:
            sides = {}
            for side, root in (("base", worktree), ("new", REPO)):
                out = os.path.join(scratch, f"{side}.o")
                report = compile_object(build, command, obj, root, out)
                resources, digests = ptxas_resources(report, args.arch), sass_digests(cuobjdump, out, args.arch, args.exact)
                notes = {name: text for name, text in ptxas_notes(report).items() if name in resources}
                resources, digests, notes = readable(resources), readable(digests), readable(notes)
                if side == "base" and args.rename:
                    rename = lambda name: re.sub(args.rename[0], args.rename[1], name)
                    resources = {rename(k): v for k, v in resources.items()}
                    digests = {rename(k): v for k, v in digests.items()}
                    notes = {rename(k): v for k, v in notes.items()}
                sides[side] = (resources, digests, notes)
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", worktree], check=False)
    print(f"| kernel ({args.arch}) | base registers / spills | new registers / spills | SASS | "
          "ptxas notes, base -> new |")
    print("|---|---|---|---|---|")
    for kernel in sorted(set(sides["base"][0]) | set(sides["new"][0])):
        if args.match and not re.search(args.match, kernel):
            continue
        cells = []
        for side in ("base", "new"):
            resources = sides[side][0].get(kernel)
            cells.append(f"{resources[0]} / {resources[1]} B" if resources else "absent")
        base_digest, new_digest = sides["base"][1].get(kernel), sides["new"][1].get(kernel)
        same = "same" if base_digest and base_digest == new_digest else "changed" if base_digest and new_digest else "-"
        base_notes, new_notes = (sides[side][2].get(kernel, "") for side in ("base", "new"))
        notes = "-" if not (base_notes or new_notes) else f"{base_notes or 'none'} -> {new_notes or 'none'}"
        print(f"| {kernel} | {cells[0]} | {cells[1]} | {same} | {notes} |")


if __name__ == "__main__":
    main()
