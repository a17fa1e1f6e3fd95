"""The fused GDN backward against the unfused kernels as its CTAs fill more or less of the GPU's last wave: the
measurement behind gdn/cuda/plan.cpp's fused_backward_applies.

The fused backward runs a CTA per (sequence, value head) through all of the sequence's chunks, so it costs whole
waves of CTAs, while the unfused kernels' cost follows the work. This times deltatrain's backward (kernel time,
bench/gdn_h200.py's inputs and measure) on sequences of 4096 tokens at K = V = 128 for each head layout and
sequence count given, under the process's DELTATRAIN_CUDA_FUSED_BACKWARD (read once per process: run the script
once per setting, 0 and 1) and appends one JSON line per shape to --out: the setting, h_qk, h_v, sequences,
units (sequences x value heads), the last wave's fill (units over the wave slots they take) and kernel_ms.
Usage: DELTATRAIN_CUDA_FUSED_BACKWARD=0|1 python3 bench/gdn_fused_fill.py --out FILE
       [--heads 16/32 16/16 ...] [--sequences 1 2 ...] [--length 4096]
"""

import argparse
import json
import math
import os

import torch

from gdn_h200 import Impl, make_inputs, measure


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON lines, appended")
    parser.add_argument("--heads", nargs="+", default=["16/32", "16/16"], help="h_qk/h_v layouts")
    parser.add_argument("--sequences", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument("--length", type=int, default=4096, help="tokens a sequence")
    args = parser.parse_args()
    setting = os.environ.get("DELTATRAIN_CUDA_FUSED_BACKWARD")
    if setting not in ("0", "1"):
        parser.error("DELTATRAIN_CUDA_FUSED_BACKWARD: set it to 0 or 1 (this compares the two paths)")
    layouts = []
    for heads in args.heads:
        h_qk, _, h_v = heads.partition("/")
        if not (h_qk.isdigit() and h_v.isdigit()) or int(h_v) % int(h_qk) != 0:
            parser.error(f"--heads {heads}: expected h_qk/h_v with h_v a multiple of h_qk, e.g. 16/32")
        layouts.append((int(h_qk), int(h_v)))
    if any(n < 1 for n in args.sequences) or args.length < 1:
        parser.error("--sequences and --length: at least 1")

    import deltatrain.torch as ours_torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with open(args.out, "a") as out:
        for h_qk, h_v in layouts:
            for n in args.sequences:
                x = make_inputs(h_qk, h_v, [args.length] * n, seed=n)
                _, kernel, _, _, _ = measure(Impl(ours_torch.chunk_gated_delta_rule, x, 128 ** -0.5), "bwd")
                units = n * h_v
                row = {"fused_setting": int(setting), "h_qk": h_qk, "h_v": h_v, "sequences": n,
                       "length": args.length, "units": units, "fill": units / (math.ceil(units / sms) * sms),
                       "kernel_ms": round(kernel, 4)}
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
