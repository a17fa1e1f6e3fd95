"""Device time of the cuda backend's chunked forward and backward per head dim, through the low-level binding
(preallocated outputs, no autograd), for comparing two builds of the module on the same GPU in one run.

Each shape: bf16, one packed row of 4 x 2048 tokens, outputs and final state; CUDA events around `--calls`
back-to-back calls after a warm-up, the median of `--repeats` such runs, per call. Head dims the kernels are
compiled for (64, 128, 256) and, where the module serves them, others (run on padded copies).
Prints one JSON object: {"module": path, "rows": [{shape, pass, ms} or {shape, pass, error}]}.
Usage: python3 bench/gpu/gdn_head_dims.py [--calls N] [--repeats R]   (deltatrain on PYTHONPATH)
"""

import argparse
import json
import statistics

import torch

import deltatrain
from deltatrain import _deltatrain

# (K, V, H, HV): heads as the anchor grid's 16/32 at K = V = 128, fewer at 256 so that each cell's work is alike.
SHAPES = [(64, 64, 16, 32), (128, 128, 16, 32), (256, 256, 4, 8), (60, 60, 16, 32), (100, 100, 16, 32),
          (200, 200, 4, 8)]
LENGTHS = [2048] * 4


def inputs(K, V, H, HV):
    gen = torch.Generator(device="cuda").manual_seed(0)
    T = sum(LENGTHS)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    q = torch.nn.functional.normalize(randn(1, T, H, K, dtype=torch.float32), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(randn(1, T, H, K, dtype=torch.float32), dim=-1).bfloat16()
    v = randn(1, T, HV, V)
    g = torch.nn.functional.logsigmoid(randn(1, T, HV, dtype=torch.float32)) / 16
    beta = torch.sigmoid(randn(1, T, HV, dtype=torch.float32))
    h0 = randn(len(LENGTHS), HV, K, V, dtype=torch.float32)
    cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int32)
    return q, k, v, g, beta, h0, cu


def timed(call, calls, repeats):
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    gdn = _deltatrain.gdn
    rows = []
    for K, V, H, HV in SHAPES:
        shape = f"K{K} V{V} {H}/{HV} heads {len(LENGTHS)}x{LENGTHS[0]}"
        q, k, v, g, beta, h0, cu = inputs(K, V, H, HV)
        options = dict(scale=None, use_qk_l2norm_in_kernel=False, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu,
                       backend="cuda", stream=torch.cuda.current_stream().cuda_stream)
        o, ht = torch.empty_like(v), torch.empty_like(h0)
        do, dht = torch.randn_like(v), torch.randn_like(h0)
        dq, dk, dv, dg, dbeta, dh0 = (torch.empty_like(x) for x in (q, k, v, g, beta, h0))
        passes = {
            "fwd": lambda: gdn.chunk_forward(q, k, v, g, beta, o, ht, h0, **options),
            "bwd": lambda: gdn.chunk_backward(q, k, v, g, beta, do, dq, dk, dv, dg, dbeta, dht, dh0, h0, **options),
        }
        for name, call in passes.items():
            try:
                rows.append(dict(shape=shape, K=K, V=V, pass_=name, ms=timed(call, args.calls, args.repeats)))
            except RuntimeError as error:  # a build without kernels (or padding) for this head dim
                rows.append(dict(shape=shape, K=K, V=V, pass_=name, error=str(error)[:160]))
        del q, k, v, o, ht, do, dht, dq, dk, dv, dg, dbeta, dh0
        torch.cuda.empty_cache()
    print(json.dumps(dict(module=deltatrain.__file__, gpu=torch.cuda.get_device_name(), rows=rows)))


if __name__ == "__main__":
    main()
