"""bench/gpu/stall_lines.py over an nvdisasm listing and an ncu per-instruction CSV written here: each instruction's
samples charged to the innermost line of the source file (or, with --regions, to the range holding the innermost of its
lines that any range holds), with random sample counts; the expected sums are the generator's own."""

import argparse
import collections
import csv
import gzip
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu"))
import stall_lines  # noqa: E402

SOURCE = "/src/kernel.cu"
KERNEL = "_Z6kernelv"


def write_listing(path, instructions, texts=None):
    """instructions: per instruction, its inlining chain, innermost first, as (file, line) frames; texts: each one's
    SASS (FADD where not given)."""
    with open(path, "w") as f:
        f.write(".text._Z5otherv:\n        /*0000*/                   NOP ;\n")
        f.write(f".text.{KERNEL}:\n")
        for i, frames in enumerate(instructions):
            for (file, line), caller in zip(frames, frames[1:] + [None]):
                at = f' inlined at "{caller[0]}", line {caller[1]}' if caller else ""
                f.write(f'        //## File "{file}", line {line}{at}\n')
            text = texts[i] if texts else "FADD R0, R0, R1"
            f.write(f"        /*{16 * i:04x}*/                   {text} ;\n")


def write_samples(path, counts):
    """counts: per instruction, (samples, instructions executed, {stall: samples})."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              *(f"stall_{s}" for s in stall_lines.STALLS)]
    with gzip.open(path, "wt", newline="") as f:
        writer = csv.writer(f, quoting=csv.QUOTE_ALL)
        writer.writerow(["Kernel Name", "kernel"])
        writer.writerow(header)
        for i, (samples, executed, stalls) in enumerate(counts):
            writer.writerow([hex(0x7f0000000000 + 16 * i), "FADD", samples, executed,
                             *(stalls.get(s, 0) for s in stall_lines.STALLS)])


@pytest.fixture
def kernel(tmp_path, rng):
    """A kernel whose instructions each sit in a helper (line 5 of the source, or another file's line) inlined from
    one of the source's lines 10-40; and their random samples."""
    callers = [int(rng.integers(10, 41)) for _ in range(60)]
    instructions = []
    for caller in callers:
        helper = ("/src/helpers.cuh", 7) if rng.random() < 0.5 else (SOURCE, 5)
        instructions.append([helper, (SOURCE, caller), (SOURCE, 100)])
    counts = []
    for _ in callers:
        stalls = {s: int(rng.integers(0, 50)) for s in rng.choice(stall_lines.STALLS, size=3, replace=False)}
        counts.append((sum(stalls.values()), int(rng.integers(1, 10000)), stalls))
    write_listing(tmp_path / "k.sass", instructions)
    write_samples(tmp_path / "k.csv.gz", counts)
    return tmp_path, callers, instructions, counts


def test_samples_by_source_line(kernel):
    path, callers, instructions, counts = kernel
    lines = stall_lines.instruction_lines(str(path / "k.sass"), KERNEL, "kernel.cu", "deep")
    total, per_key = stall_lines.samples_by(lines, stall_lines.sample_rows(str(path / "k.csv.gz")))
    expected = collections.defaultdict(collections.Counter)
    for frames, (samples, executed, stalls) in zip(instructions, counts):
        line = frames[0][1] if frames[0][0] == SOURCE else frames[1][1]  # the deepest frame in kernel.cu
        expected[f"kernel.cu:{line}"].update(samples=samples, instructions=executed, **stalls)
    assert total == sum(c[0] for c in counts)
    assert {k: dict(+v) for k, v in per_key.items()} == {k: dict(+v) for k, v in expected.items()}


def test_samples_by_region(kernel):
    path, callers, _, counts = kernel
    regions = stall_lines.parse_regions("low:10-19,mid:20-29,high:30-40")
    lines = stall_lines.instruction_lines(str(path / "k.sass"), KERNEL, "kernel.cu", "deep", regions)
    total, per_key = stall_lines.samples_by(lines, stall_lines.sample_rows(str(path / "k.csv.gz")))
    expected = collections.Counter()
    for caller, (samples, _, _) in zip(callers, counts):
        expected["low" if caller < 20 else "mid" if caller < 30 else "high"] += samples
    assert {k: v["samples"] for k, v in per_key.items() if v["samples"]} == {k: v for k, v in expected.items() if v}
    assert total == sum(expected.values())


@pytest.mark.parametrize("text", ["a:10", "a:20-10", ":1-2", "a:x-3"])
def test_regions_that_are_not_ranges_are_refused_by_name(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--regions"):
        stall_lines.parse_regions(text)


def test_barrier_samples_charged_to_the_wait_they_follow(tmp_path, rng):
    """Waits of each kind at random places among plain instructions; each instruction's barrier samples go to the
    last wait at most WAIT_REACH instructions before it (found here by a forward scan), per region."""
    waits = {"BAR.SYNC.DEFER_BLOCKING 0x5, 0x100": "bar 5", "BAR.SYNC 0xc": "bar 12",
             "BAR.SYNC.DEFER_BLOCKING 0x0": "bar 0",
             "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR13], R7": "mbarrier", "UCGABAR_WAIT": "cluster barrier",
             "WARPGROUP.DEPBAR.LE gsb0, 0x0": "wgmma group"}
    n = 200
    texts = [str(rng.choice(list(waits))) if rng.random() < 0.15 else "FADD R0, R0, R1" for _ in range(n)]
    callers = [int(rng.integers(10, 41)) for _ in range(n)]
    write_listing(tmp_path / "k.sass", [[(SOURCE, c)] for c in callers], texts)
    counts = []
    for _ in range(n):
        barrier = int(rng.integers(0, 30)) if rng.random() < 0.5 else 0
        counts.append((barrier + 1, 1, {"barrier": barrier, "selected": 1}))
    write_samples(tmp_path / "k.csv.gz", counts)

    expected = collections.defaultdict(collections.Counter)
    last_wait = None  # (index, name) of the last wait seen
    for i, (text, caller, (_, _, stalls)) in enumerate(zip(texts, callers, counts)):
        wait = last_wait[1] if last_wait and i - last_wait[0] <= stall_lines.WAIT_REACH else None
        if stalls["barrier"]:
            expected["low" if caller < 25 else "high"][wait] += stalls["barrier"]
        if text in waits:
            last_wait = (i, waits[text])

    regions = stall_lines.parse_regions("low:10-24,high:25-40")
    instructions = stall_lines.kernel_instructions(str(tmp_path / "k.sass"), KERNEL)
    lines = stall_lines.charged_lines(instructions, "kernel.cu", "deep", regions)
    got = stall_lines.barrier_waits_by(instructions, lines, stall_lines.sample_rows(str(tmp_path / "k.csv.gz")))
    assert {k: dict(v) for k, v in got.items()} == {k: dict(v) for k, v in expected.items()}
    assert sum(sum(v.values()) for v in got.values()) == sum(c[2]["barrier"] for c in counts)
