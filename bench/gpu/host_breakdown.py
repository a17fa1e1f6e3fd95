"""Where the host time of one deltatrain.torch call goes: microseconds of CPU per call for the whole call and
for its pieces (tensor exchange, allocation, stream query, autograd), on a shape so small that the GPU never
holds the host back; then, on the small anchor cells, the wall time per call as the benchmark measures it
beside the CPU time to issue a call. Prints a table; with --json PATH writes it too.
usage: python3 bench/gpu/host_breakdown.py [--json PATH] [--profile PATH]"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gdn_h200 import Impl, host_ms, make_inputs  # noqa: E402

import deltatrain.torch as ours
from deltatrain import _deltatrain

CALLS = 400


def us_per_call(fn, calls=CALLS):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):  # best of five: the figure the code allows, not the machine's noise
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--profile", help="write torch's CPU profile of 20 forward + backward calls here")
    args = parser.parse_args()
    T, h_qk, h_v, dim = 256, 2, 8, 128
    inputs = make_inputs(h_qk, h_v, [T], seed=0, dim=dim)
    names = ("q", "k", "v", "g", "beta", "h0", "cu", "cu_cpu", "do", "dht")
    q, k, v, g, beta, h0, cu, cu_cpu, do, dht = (inputs[n] for n in names)
    o, ht = torch.empty_like(v), torch.empty_like(h0)
    stream = torch.cuda.current_stream().cuda_stream
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, h0)]

    def call(*inputs):
        return ours.chunk_gated_delta_rule(*inputs[:5], scale=dim ** -0.5, initial_state=inputs[5],
                                           output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)

    def forward_backward():
        outputs = call(*leaves)
        torch.autograd.grad(outputs, leaves, (do, dht))

    def binding_forward():
        _deltatrain.gdn.chunk_forward(q, k, v, g, beta, o, ht, h0, scale=dim ** -0.5, cu_seqlens=cu,
                                      cu_seqlens_cpu=cu_cpu, backend="auto", stream=stream)

    grads = [torch.empty_like(x) for x in (q, k, v, g, beta, h0)]

    def binding_backward():
        _deltatrain.gdn.chunk_backward(q, k, v, g, beta, do, *grads[:5], dht, grads[5], h0, scale=dim ** -0.5,
                                       cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, backend="auto", stream=stream)

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *xs):
            return tuple(x.view_as(x) for x in xs)

        @staticmethod
        def backward(ctx, *gs):
            return gs

    def autograd_identity():
        outputs = Identity.apply(*leaves)
        torch.autograd.grad(outputs, leaves, [torch.ones_like(x) for x in leaves])

    tensors = [q, k, v, g, beta, o, ht, h0, cu, cu_cpu]
    rows = [
        ("deltatrain.torch forward, no grad", lambda: call(q, k, v, g, beta, h0)),
        ("deltatrain.torch forward, autograd", lambda: call(*leaves)),
        ("deltatrain.torch forward + backward", forward_backward),
        ("_deltatrain.gdn.chunk_forward (10 tensors)", binding_forward),
        ("_deltatrain.gdn.chunk_backward (15 tensors)", binding_backward),
        ("autograd.grad through an identity Function (6 leaves)", autograd_identity),
        ("10 x Tensor.__dlpack__()", lambda: [t.__dlpack__() for t in tensors]),
        ("torch.cuda.current_stream().cuda_stream", lambda: torch.cuda.current_stream(q.device).cuda_stream),
        ("2 x torch.empty_like", lambda: (torch.empty_like(v), torch.empty_like(h0))),
    ]
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

        rows.append(("fla forward, autograd", lambda: fla_gdn(*leaves[:5], scale=dim ** -0.5, initial_state=leaves[5],
                                                              output_final_state=True, cu_seqlens=cu)))
    except ImportError:
        pass
    results = {name: round(us_per_call(fn), 2) for name, fn in rows}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                forward_backward()
        with open(args.profile, "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    for pass_, h_qk, h_v, lengths in (("fwd", 2, 8, [8192]), ("fwd", 2, 8, [1024] * 8), ("bwd", 2, 4, [8192])):
        cell = f"{pass_} {h_qk}/{h_v} {len(lengths)}x{lengths[0]}"
        impl = Impl(ours.chunk_gated_delta_rule, make_inputs(h_qk, h_v, lengths, seed=1), 128 ** -0.5)
        if pass_ == "bwd":
            impl.prepare_backward()
        fn = impl.forward if pass_ == "fwd" else impl.backward
        results[f"{cell}: wall per call (events, as the benchmark)"] = round(host_ms(fn) * 1e3, 2)
        results[f"{cell}: CPU to issue one call"] = round(us_per_call(fn, calls=10), 2)
    width = max(len(name) for name in results)
    for name, us in results.items():
        print(f"{name:<{width}}  {us:8.2f} us per call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "tokens": T, "us_per_call": results}, f, indent=1)


if __name__ == "__main__":
    main()
