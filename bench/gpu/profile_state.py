"""A few forwards (or backwards) of one implementation on one anchor shape, to run under ncu, e.g.
ncu --kernel-name regex:state_forward --launch-skip 2 --launch-count 1 python3 bench/gpu/profile_state.py 2 8 8192 fwd
(bwd 16/32 8x4096: 16 32 4096 bwd 8). --impl flashqla or fla profiles an anchor instead of the cuda backend (the
anchors from ../shared/tools/anchor_site.sh on PYTHONPATH, as gpu.sh python puts them); their just-in-time compiles
run in the first of the calls. The last call runs in an NVTX range named "profiled", so that
ncu --nvtx --nvtx-include "profiled/" takes its kernels alone, whatever their names and number. That range is the
Python thread's, and autograd launches a backward's kernels from a thread of its own, so the last call also runs
between cudaProfilerStart and cudaProfilerStop: ncu --profile-from-start off takes every kernel of it, the backward's
too (under the NVTX filter a bwd run showed only its forward's kernels)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gdn_h200 import Impl, load_fla, load_flashqla, make_inputs  # noqa: E402


def implementation(name):
    if name == "ours":
        import deltatrain.torch as ours

        return ours.chunk_gated_delta_rule
    if name == "flashqla":
        fn, _ = load_flashqla()
    else:
        os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
        fn, _ = load_fla()
    if fn is None:
        raise SystemExit(f"profile_state.py: --impl {name} cannot be imported (see above)")
    return fn


def positive(text):
    """--calls: at least one call, the one profiled."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--calls must be a positive integer, got {text!r}")
    return int(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("h_qk", type=int, nargs="?", default=2)
    parser.add_argument("h_v", type=int, nargs="?", default=8)
    parser.add_argument("length", type=int, nargs="?", default=8192)
    parser.add_argument("pass_", metavar="pass", choices=["fwd", "bwd"], nargs="?", default="fwd")
    parser.add_argument("sequences", type=int, nargs="?", default=1)
    parser.add_argument("--impl", choices=["ours", "flashqla", "fla"], default="ours")
    parser.add_argument("--calls", type=positive, default=3, help="calls of the pass, the last profiled (default 3)")
    args = parser.parse_args()
    fn = implementation(args.impl)
    x = make_inputs(args.h_qk, args.h_v, [args.length] * args.sequences, seed=0)
    impl = Impl(fn, x, 128 ** -0.5)
    for call in range(args.calls):
        if call == args.calls - 1:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            torch.cuda.nvtx.range_push("profiled")
        if args.pass_ == "fwd":
            impl.forward()
        else:
            impl.prepare_backward()
            impl.backward()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
