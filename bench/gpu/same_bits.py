"""Whether two settings of the cuda GDN backend give the same bits: the anchor grid's forward and backward
(bench/gdn_h200.py's cells and inputs, through deltatrain.torch and autograd, with and without the in-kernel L2 norm)
under the environment this process runs in, each output tensor written as a SHA-256 of its bytes; then a comparison
of two such files. For a change that claims the same bits as the path it replaces (a switch such as
DELTATRAIN_CUDA_FUSED_BACKWARD where two backward forms should agree, or two builds of the module), which the GPU
tests, comparing each path with the fp64 reference within a tolerance, do not show.

    python3 bench/gpu/same_bits.py run A.json [--only 12 13 14]              (with the module before the change)
    python3 bench/gpu/same_bits.py run B.json [--only 12 13 14]              (with the module after it)
    python3 bench/gpu/same_bits.py compare A.json B.json    (exit 1 where a tensor differs)
"""

import argparse
import hashlib
import json
import os
import sys

OUTPUTS = {"fwd": ("o", "ht"), "bwd": ("dq", "dk", "dv", "dg", "dbeta", "dh0")}
SETTINGS = ("DELTATRAIN_CUDA_FUSED_BACKWARD", "DELTATRAIN_CUDA_WGMMA")


def digest(tensor):
    import torch
    return hashlib.sha256(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def run(path, only):  # torch, CUDA and deltatrain only here: `compare` runs anywhere
    import torch

    import deltatrain.torch as ours_torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from gdn_h200 import GRID, Impl, make_inputs

    rows = {}
    for index in only if only else range(len(GRID)):
        pass_, h_qk, h_v, seqlens, lengths = GRID[index]
        for l2norm in (False, True):
            x = make_inputs(h_qk, h_v, lengths, seed=index)
            impl = Impl(ours_torch.chunk_gated_delta_rule, x, 128 ** -0.5, l2norm)
            if pass_ == "fwd":
                outputs = impl.forward()
            else:
                impl.prepare_backward()
                outputs = impl.backward()
            torch.cuda.synchronize()
            cell = f"{index} {pass_} {h_qk}/{h_v} {seqlens}{' l2norm' if l2norm else ''}"
            rows[cell] = {name: digest(t) for name, t in zip(OUTPUTS[pass_], outputs)}
            print(cell, flush=True)
    settings = {name: os.environ.get(name) for name in SETTINGS}
    with open(path, "w") as f:
        json.dump({"settings": settings, "gpu": torch.cuda.get_device_name(0), "cells": rows}, f, indent=1)


def compare(first, second):
    with open(first) as f:
        a = json.load(f)
    with open(second) as f:
        b = json.load(f)
    print(f"{first}: {a['settings']}\n{second}: {b['settings']}")
    differing = 0
    for cell in sorted(set(a["cells"]) | set(b["cells"]), key=lambda c: (int(c.split()[0]), c)):
        left, right = a["cells"].get(cell), b["cells"].get(cell)
        if left is None or right is None:
            print(f"{cell}: only in {first if right is None else second}")
            differing += 1
            continue
        names = [name for name in left if left[name] != right.get(name)]
        print(f"{cell}: {'same bits' if not names else 'differs in ' + ', '.join(names)}")
        differing += bool(names)
    print(f"{differing} of {len(set(a['cells']) | set(b['cells']))} cells differ")
    return 1 if differing else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    run_parser = sub.add_parser("run", help="hash every cell's outputs under this environment")
    run_parser.add_argument("out")
    run_parser.add_argument("--only", type=int, nargs="+", help="grid cell indices (bench/gdn_h200.py's GRID)")
    compare_parser = sub.add_parser("compare", help="compare two runs' hashes")
    compare_parser.add_argument("first")
    compare_parser.add_argument("second")
    args = parser.parse_args()
    if args.verb == "run":
        run(args.out, args.only)
        return 0
    return compare(args.first, args.second)


if __name__ == "__main__":
    sys.exit(main())
