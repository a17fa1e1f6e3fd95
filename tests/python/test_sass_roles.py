"""bench/gpu/sass_roles.py over listings written here: random warp-role regions (USETMAXREG), random loops (backward
BRAs, some nested, some sharing a head), forward branches and out-of-line stubs that branch back (neither is a loop of
a role), and a random mix of instructions from a fixed vocabulary; the expected counts are the generator's own."""

import collections
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu"))
import sass_roles  # noqa: E402

KERNEL = "_Z6kernelv"
VOCABULARY = {  # class -> SASS texts of it
    "HGMMA": ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0"], "MUFU": ["MUFU.EX2 R3, R3", "MUFU.RCP R2, R5"],
    "BAR.SYNC": ["BAR.SYNC.DEFER_BLOCKING 0x1, 0x100", "BAR.SYNC 0x0"], "BAR.ARV": ["BAR.ARV 0x2, 0x100"],
    "SYNCS": ["SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR4], RZ", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR13], R7"],
    "SHFL": ["SHFL.BFLY PT, R3, R2, 0x1, 0x1f"], "LDS": ["LDS.128 R4, [R2]", "LDS R4, [R2+0x10]"],
    "STS": ["STS.64 [R2], R4"], "LDSM": ["LDSM.16.M88.4 R4, [R2]"], "STSM": ["STSM.16.M88.4 [R2], R4"],
    "LDG": ["LDG.E.128 R4, desc[UR6][R2.64]"], "STG": ["STG.E desc[UR6][R2.64], R4"],
    "LDGSTS": ["LDGSTS.E.BYPASS.128 [R2], desc[UR6][R4.64]"], "LDL": ["LDL R4, [R1+0x10]"],
    "STL": ["STL [R1+0x10], R4"],
    "FFMA": ["FFMA R0, R1, R2, R3"], "FMUL": ["FMUL.FTZ R0, R1, R2"], "FADD": ["FADD R0, R0, R1"],
    "FSEL": ["FSEL R0, R1, RZ, P0"], "F2FP": ["F2FP.BF16.F32.PACK_AB R0, R1, R2"],
    "other": ["IMAD R0, R1, R2, R3", "ISETP.GE.AND P0, PT, R0, R1, PT", "NOP", "LDGDEPBAR",
              "BAR.RED.POPC.DEFER_BLOCKING 0x3, 0x80, P0", "UTMALDG.2D [UR8], [UR4]", "WARPGROUP.ARRIVE",
              "LDSMX R0", "FADD2 R0, R1, R2"],  # the last two: names that only begin like a class
}
PREDICATES = ["", "", "@P0 ", "@!P1 ", "@UP0 ", "@!PT "]


class Generator:
    """Emits a kernel instruction by instruction as (labels before it, its text, label it branches to), counting each
    into the region it is in and into every loop open around it."""

    def __init__(self, rng):
        self.rng, self.items, self.labels = rng, [], 0
        self.region, self.regions, self.open_loops, self.pending = None, [], [], []

    def label(self):
        self.labels += 1
        return f".L_x_{self.labels}"

    def emit(self, text, target=None, cls="other"):
        if self.region is not None:
            self.region["instructions"] += 1
        for loop in self.open_loops:
            loop["instructions"] += 1
            loop["classes"][cls] += 1
        self.items.append((self.pending, text, target))
        self.pending = []

    def random_instructions(self, n):
        for _ in range(n):
            cls = str(self.rng.choice(list(VOCABULARY)))
            self.emit(str(self.rng.choice(PREDICATES)) + str(self.rng.choice(VOCABULARY[cls])), cls=cls)
            if self.rng.random() < 0.03:  # a forward branch, to the end of the kernel: no loop
                self.emit("@P2 BRA", target=".L_x_end")

    def loop(self, depth):
        """A loop whose head is labelled and whose last instruction branches back to it; inside, maybe a nested loop
        and maybe an early back edge to the same head (a `continue`), which does not end the loop."""
        head, loop = self.label(), {"instructions": 0, "classes": collections.Counter()}
        self.pending.append(head)
        self.open_loops.append(loop)
        self.region["loops"].append(loop)  # in the order of their heads, as the tool lists them
        self.random_instructions(int(self.rng.integers(1, 30)))
        if self.rng.random() < 0.3:
            self.emit("@P3 BRA", target=head)
            self.random_instructions(int(self.rng.integers(1, 10)))
        if depth < 2 and self.rng.random() < 0.4:
            self.loop(depth + 1)
            self.random_instructions(int(self.rng.integers(0, 10)))
        self.emit(str(self.rng.choice(["@P0 BRA", "@!P1 BRA", "BRA", "@!UP0 BRA.U"])), target=head)
        self.open_loops.pop()
        self.heads.append(head)

    def kernel(self, roles):
        """Prologue, then `roles` regions each opening with USETMAXREG, then EXIT and out-of-line stubs."""
        self.heads = []
        self.region = {"name": "prologue", "instructions": 0, "loops": []}
        self.regions.append(self.region)
        self.random_instructions(int(self.rng.integers(0, 20)))
        if not self.region["instructions"]:
            self.regions.pop()
        for _ in range(roles):
            registers = int(self.rng.integers(3, 31)) * 8
            dealloc = self.rng.random() < 0.4
            self.region = {"name": f"{'DEALLOC' if dealloc else 'ALLOC'} {registers}", "instructions": 0, "loops": []}
            self.regions.append(self.region)
            self.emit(f"USETMAXREG.{'DEALLOC' if dealloc else 'TRY_ALLOC'}.CTAPOOL {'' if dealloc else 'UP0, '}"
                      f"{hex(registers)}")
            for _ in range(int(self.rng.integers(0, 4))):
                self.random_instructions(int(self.rng.integers(0, 15)))
                self.loop(0)
            self.random_instructions(int(self.rng.integers(1, 15)))
        self.pending.append(".L_x_end")
        self.emit("EXIT")
        self.region = None
        for _ in range(int(self.rng.integers(0, 4))):  # retry stubs: spin on themselves, then back into a role
            stub = self.label()
            self.pending.append(stub)
            self.emit("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR13], R7")
            self.emit("@!P0 BRA", target=stub)
            self.emit("BRA", target=str(self.rng.choice(self.heads)) if self.heads else stub)
        return [(r["name"], r["instructions"], [(l["instructions"], +l["classes"]) for l in r["loops"]])
                for r in self.regions]

    def write(self, path, cuobjdump=False):
        offsets, offset = {}, 0
        for labels, _, _ in self.items:
            offsets.update((label, offset) for label in labels)
            offset += 16
        with open(path, "w") as f:
            head = "\t\tFunction : {}\n" if cuobjdump else ".text.{}:\n"
            f.write(head.format("_Z5otherv") + "        /*0000*/                   NOP ;\n" + head.format(KERNEL))
            for i, (labels, text, target) in enumerate(self.items):
                if target and cuobjdump:
                    text += f" {hex(offsets[target])}"
                elif target:
                    text += f" `({target})"
                if not cuobjdump:
                    f.writelines(f"{label}:\n" for label in labels)
                    f.write('\t//## File "/src/kernel.cu", line 10\n')
                f.write(f"        /*{16 * i:04x}*/                   {text} ;")
                encoding = "   /* 0x000fe20003800000 */\n                   /* 0x000fc80003800000 */\n"
                f.write(encoding if cuobjdump else "\n")


def found(path):
    return [(r.name, r.instructions, [(l.instructions, +l.classes) for l in r.loops])
            for r in sass_roles.kernel_regions(str(path), KERNEL) if r.name != "out-of-line"]


@pytest.mark.parametrize("cuobjdump", [False, True], ids=["nvdisasm", "cuobjdump"])
def test_roles_and_loops_counted_as_generated(tmp_path, rng, cuobjdump):
    for trial in range(20):
        generator = Generator(rng)
        expected = generator.kernel(int(rng.integers(1, 5)))
        generator.write(tmp_path / f"k{trial}.sass", cuobjdump)
        assert found(tmp_path / f"k{trial}.sass") == expected


def test_without_usetmaxreg_one_role_covers_the_kernel(tmp_path, rng):
    generator = Generator(rng)
    generator.region = {"name": "kernel", "instructions": 0, "loops": []}
    generator.heads = []
    for _ in range(3):
        generator.random_instructions(int(rng.integers(1, 20)))
        generator.loop(0)
    generator.pending.append(".L_x_end")
    generator.emit("EXIT")
    generator.write(tmp_path / "k.sass")
    (role,) = found(tmp_path / "k.sass")
    region = generator.region
    assert role == ("kernel", len(generator.items),
                    [(l["instructions"], +l["classes"]) for l in region["loops"]])


def test_markdown_has_a_row_per_role_with_its_largest_loop(tmp_path, rng, capsys):
    generator = Generator(rng)
    expected = [r for r in generator.kernel(3) if r[0] != "prologue"]
    generator.write(tmp_path / "k.sass")
    sass_roles.main([str(tmp_path / "k.sass"), KERNEL, "--markdown"])
    rows = capsys.readouterr().out.splitlines()[2:]
    assert len(rows) == len(expected)
    for row, (name, instructions, loops) in zip(rows, expected):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[:2] == [name, str(instructions)]
        assert cells[3] == str(max(n for n, _ in loops)) if loops else cells[2] == "none"


def test_a_kernel_not_in_the_listing_is_refused_by_name(tmp_path, rng):
    generator = Generator(rng)
    generator.kernel(2)
    generator.write(tmp_path / "k.sass")
    with pytest.raises(SystemExit, match="kernel argument 'no_such_kernel'"):
        sass_roles.main([str(tmp_path / "k.sass"), "no_such_kernel"])
    with pytest.raises(SystemExit, match="sass argument"):
        sass_roles.main([str(tmp_path / "missing.sass"), KERNEL])



@pytest.mark.parametrize("with_loops", [True, False])
def test_markdown_rows_have_the_headers_cells(tmp_path, rng, capsys, with_loops):
    """Every line of the table has as many cells as the header names, and the header names each: with loops (a
    generated kernel) and without (a kernel of straight-line code, which once printed an empty column)."""
    if with_loops:
        generator = Generator(rng)
        generator.kernel(int(rng.integers(1, 4)))
        generator.write(tmp_path / "k.sass")
    else:
        body = "".join(f"        /*{16 * i:04x}*/                   FADD R{i}, R0, R1 ;\n"
                       for i in range(int(rng.integers(1, 20))))
        (tmp_path / "k.sass").write_text(f".text.{KERNEL}:\n{body}        /*ffff0*/                   EXIT ;\n")
    sass_roles.main([str(tmp_path / "k.sass"), KERNEL, "--markdown"])
    lines = capsys.readouterr().out.splitlines()
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    assert len({len(c) for c in cells}) == 1, lines
    assert all(cells[0])
