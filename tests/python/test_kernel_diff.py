"""bench/gpu/kernel_diff.py's parsing, on ptxas reports and cuobjdump listings written here: resources per kernel of
one architecture, and SASS digests that ignore what moves without the code changing (addresses, encodings, the
path-dependent names nvcc gives file-local symbols, parameter offsets unless exact) and nothing else."""
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu"))
import kernel_diff  # noqa: E402

REPORT = """ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_80'
ptxas info    : Function properties for _Z3fooPf
    0 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 96 registers, used 0 barriers
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90a'
ptxas info    : Function properties for _Z3fooPf
    8 bytes stack frame, {spills} bytes spill stores, 8 bytes spill loads
ptxas info    : Used {registers} registers, used 1 barriers, 8 bytes cumulative stack size
ptxas info    : Compiling entry function '_Z3barv' for 'sm_90a'
ptxas info    : Function properties for _Z3barv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers
"""


def test_resources_of_one_architecture():
    registers, spills = random.randint(33, 255), 4 * random.randint(0, 40)
    report = REPORT.format(registers=registers, spills=spills)
    assert kernel_diff.ptxas_resources(report, "sm_90a") == {"_Z3fooPf": (registers, spills), "_Z3barv": (32, 0)}
    assert kernel_diff.ptxas_resources(report, "sm_80") == {"_Z3fooPf": (96, 4)}


def test_notes_counted_per_kernel():
    serialised, injected = random.randint(1, 3), random.randint(1, 5)
    lines = [f"ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
             f"insufficient register resources for the function '_Z3fooPf'"] * serialised
    lines += [f"ptxas info    : (C7517) warpgroup.wait is injected in around line {random.randint(1, 9999)} by compiler "
              f"to allow use of registers defined by GMMA in function '_Z3barv'"] * injected
    random.shuffle(lines)
    report = "\n".join(lines) + "\n" + REPORT.format(registers=64, spills=0)
    assert kernel_diff.ptxas_notes(report) == {"_Z3fooPf": f"C7512 x{serialised}", "_Z3barv": f"C7517 x{injected}"}
    assert kernel_diff.ptxas_notes(REPORT.format(registers=64, spills=0)) == {}


def listing(path_hash, address, parameter, opcode="FFMA"):
    """A cuobjdump -sass listing of two kernels; the arguments vary what a rebuild elsewhere may vary."""
    return f"""
	code for sm_90a
		Function : _ZN10deltatrain12_GLOBAL__N__{path_hash}_15_state_hopper_cu_2d3ba0a63fooEv
	.headerflags	@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*{address:04x}*/                   ULDC.64 UR4, c[0x0][{parameter}] ;                   /* 0x0000000000047ab9 */
        /*{address + 16:04x}*/                   {opcode} R1, R2, R3, R4 ;                       /* 0x{random.getrandbits(60):016x} */
        /*{address + 32:04x}*/                   CALL.REL.NOINC `(_INTERNAL_{path_hash}_15_state_hopper_cu_2d3ba0a6_bar) ;
		Function : _Z3barv
        /*0000*/                   EXIT ;                                    /* 0x000000000000794d */
"""


def test_digests_ignore_what_moves_without_the_code():
    base = kernel_diff.digests_of_sass(listing("81a64cae", 0, "0x210"))
    moved = kernel_diff.digests_of_sass(listing("cf010594", 0x40, "0x218"))
    assert len(base) == 2 and set(base.values()) == set(moved.values())
    exact_base = kernel_diff.digests_of_sass(listing("81a64cae", 0, "0x210"), exact=True)
    exact_moved = kernel_diff.digests_of_sass(listing("cf010594", 0x40, "0x218"), exact=True)
    assert sorted(exact_base.values()) != sorted(exact_moved.values()), "exact: the parameter offset counts"


def test_digests_see_a_changed_instruction():
    base = kernel_diff.digests_of_sass(listing("81a64cae", 0, "0x210"))
    changed = kernel_diff.digests_of_sass(listing("81a64cae", 0, "0x210", opcode="FMUL"))
    differing = [name for name in base if base[name] != changed[name]]
    assert len(differing) == 1 and "foo" in differing[0], "only the kernel whose instruction changed"
