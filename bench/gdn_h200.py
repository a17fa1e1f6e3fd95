"""deltatrain's cuda GDN backend beside fla and FlashQLA on the anchor grid (docs/cuda-backend.md, "Anchors"),
in one run.

For each cell (pass, h_qk/h_v, sequences): the same bf16 inputs (FlashQLA's recipe: q, k L2-normalised,
g = logsigmoid(randn)/16, beta = sigmoid(randn), h0 = randn, do = randn, dht = randn/8, packed B = 1 with
cu_seqlens, output_final_state) through deltatrain.torch, fla and FlashQLA, all through torch autograd:
  kernel time    the device time of one call (torch profiler): the union of its kernels' intervals, which is their
                 sum where they run one after another and counts kernels running side by side once; mean of a
                 few calls (each kernel's own time in {name}_kernels_ms);
  host-inclusive the median wall time of one call among back-to-back calls (CUDA events);
  rel err        relative Frobenius error against an fp64 evaluation of the same inputs (max over the
                 outputs o, final_state, or the gradients dq, dk, dv, dg, dbeta, dh0).
fla's gated backward guard for Triton 3.4-3.7.0 on Hopper is lifted here only (the anchor measurements,
docs/cuda-backend.md, time the same kernels with it lifted) and its dispatch to other backends is off
(FLA_DISABLE_BACKEND_DISPATCH), so that its column is fla's own kernels and not FlashQLA's.

FlashQLA (flash_qla.chunk_gated_delta_rule, TileLang; 0.1.3 in the anchors) is optional: put an unpacked
../shared/tools/anchor_site.sh folder on PYTHONPATH. Where it cannot be imported, is left out (--no-flashqla) or
refuses a cell (it serves K = V = 128 and 16-bit q/k/v only, on sm90, sm100, sm103, sm120 and sm121), its fields
are null, the reason is printed once and the run goes on. It runs with its defaults (its own choice of intra-card
context parallelism). It compiles each kernel on first use, 10-40 s apiece, cached under $TILELANG_CACHE_DIR
(default ~/.tilelang/cache; carry it to the next run): the warm-up calls before each timing take the compiles
(their seconds are printed) and count against --limit-s, so a cold cache gets fewer cells through.

Writes gdn-h200.json, gdn-h200.md and gdn-h200.png into --out (gdn_report.py); each row also holds each
implementation's time per kernel ({name}_kernels_ms). --ours-only times deltatrain alone and writes its rows to
gdn-h200-ours.json instead, the input of an A/B (bench/gdn_ab.py, `bench/gpu/gpu.sh ab`). With --merge, earlier runs' JSON
files fill the cells this run does not measure (each row keeps its run's date and commit), and --missing-only
runs only the cells none of them has: a grid can be completed over several GPU sessions.
Usage: python3 bench/gdn_h200.py --out DIR --commit HASH [--cells fwd|bwd|all] [--only I ...] [--limit-s SECONDS]
       [--ours-only [--cell PASS:HQK/HV:LENGTHS ...]] [--no-flashqla] [--merge JSON ... [--missing-only]]
"""

import argparse
import datetime
import json
import math
import os
import re
import statistics
import sys
import time

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gdn_report import busy_time, cell_of, merge, parse_cell, write  # noqa: E402

CHUNK = 64

# (pass, h_qk, h_v, seqlens as written in the anchor table of docs/cuda-backend.md, sequence lengths)
GRID = [
    ("fwd", 16, 32, "1x32768", [32768]),
    ("fwd", 16, 32, "1x8192", [8192]),
    ("fwd", 16, 32, "8192x4", [8192] * 4),
    ("fwd", 16, 32, "1024x8", [1024] * 8),
    ("fwd", 16, 64, "1x32768", [32768]),
    ("fwd", 16, 64, "1x8192", [8192]),
    ("fwd", 16, 64, "8192x4", [8192] * 4),
    ("fwd", 16, 64, "1024x8", [1024] * 8),
    ("fwd", 2, 8, "1x32768", [32768]),
    ("fwd", 2, 8, "1x8192", [8192]),
    ("fwd", 2, 8, "8192x4", [8192] * 4),
    ("fwd", 2, 8, "1024x8", [1024] * 8),
    ("bwd", 16, 32, "1x8192", [8192]),
    ("bwd", 16, 32, "1x32768", [32768]),
    ("bwd", 16, 32, "8x4096", [4096] * 8),
    ("bwd", 2, 4, "1x8192", [8192]),
    ("bwd", 2, 4, "1x32768", [32768]),
    ("bwd", 2, 4, "8x4096", [4096] * 8),
]
# "Small" cells for the host-inclusive target: few tokens or few heads, where launch overhead matters.
SMALL = {"1x8192", "1024x8"}
# What each implementation contributes to a row, as {name}_{field}; null where it was not measured.
FIELDS = ("kernel_ms", "host_ms", "rel_err")
# The exceptions by which an implementation refuses a cell's inputs, whose fields then stay null. FlashQLA raises
# these before launching anything (AssertionError for the dtype and K = V = 128, ValueError for the packing,
# NotImplementedError for a backward its GPU lacks); any other failure, and any failure of ours or fla, stops the run.
REFUSALS = {"flashqla": (AssertionError, ValueError, NotImplementedError)}


def make_inputs(h_qk, h_v, lengths, seed, dim=128):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lengths)
    dev = "cuda"

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    q = F.normalize(randn(1, T, h_qk, dim), dim=-1).to(torch.bfloat16)
    k = F.normalize(randn(1, T, h_qk, dim), dim=-1).to(torch.bfloat16)
    v = randn(1, T, h_v, dim, dtype=torch.bfloat16)
    g = F.logsigmoid(randn(1, T, h_v)) / 16
    beta = torch.sigmoid(randn(1, T, h_v))
    h0 = randn(len(lengths), h_v, dim, dim)
    do = randn(1, T, h_v, dim, dtype=torch.bfloat16)
    dht = randn(len(lengths), h_v, dim, dim) / 8
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int64)
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, do=do, dht=dht, cu_cpu=cu, cu=cu.to(dev))


def reference_fp64(q, k, v, g, beta, h0, cu, scale, l2norm=False):
    """The chunked algorithm (docs/gdn-algorithm.md section 3) in float64 torch, differentiable: (o, final_state);
    l2norm: q and k through x / sqrt(sum x^2 + 1e-6) first, as use_qk_l2norm_in_kernel does."""
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))  # B = 1
    if l2norm:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    group = v.shape[1] // q.shape[1]
    q = q.repeat_interleave(group, dim=1)
    k = k.repeat_interleave(group, dim=1)
    outputs, finals = [], []
    for n in range(len(cu) - 1):
        S = h0[n]
        for c0 in range(int(cu[n]), int(cu[n + 1]), CHUNK):
            c1 = min(int(cu[n + 1]), c0 + CHUNK)
            L = c1 - c0
            Q, Kc, Vc = (x[c0:c1].transpose(0, 1) for x in (q, k, v))  # [HV, L, D]
            G, Bt = g[c0:c1].transpose(0, 1), beta[c0:c1].transpose(0, 1)  # [HV, L]
            gam = G.cumsum(-1)
            lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            decay = (gam[:, :, None] - gam[:, None, :]).masked_fill(~lower, -math.inf).exp()
            eye = torch.eye(L, dtype=q.dtype, device=q.device)
            A = (Bt[:, :, None] * (Kc @ Kc.transpose(1, 2)) * decay).tril(-1)
            T = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False)
            W = T @ ((Bt * gam.exp())[:, :, None] * Kc)
            U = T @ (Bt[:, :, None] * Vc)
            D = U - W @ S
            O = scale * gam.exp()[:, :, None] * (Q @ S) + (scale * (Q @ Kc.transpose(1, 2)) * decay) @ D
            outputs.append(O.transpose(0, 1))
            last = gam[:, -1:]
            S = last.exp()[:, :, None] * S + Kc.transpose(1, 2) @ ((last - gam).exp()[:, :, None] * D)
        finals.append(S)
    return torch.cat(outputs)[None], torch.stack(finals)


def rel_err(actual, expected):
    actual, expected = actual.double(), expected.double()
    if not torch.isfinite(actual).all():
        return math.inf
    return ((actual - expected).norm() / expected.norm()).item()


class Impl:
    """One implementation's forward and backward on a cell's inputs, through torch autograd."""

    def __init__(self, fn, x, scale, l2norm=False, inference=False):
        self.fn, self.x, self.scale, self.l2norm, self.inference = fn, x, scale, l2norm, inference
        self.leaves = [x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "h0")]

    def forward(self):
        """A training forward (the grid's: it keeps what the backward reads), or with `inference` one under
        torch.no_grad(), as a rollout's prefill calls it."""
        q, k, v, g, beta, h0 = self.leaves
        with torch.set_grad_enabled(not self.inference):
            return self.fn(q, k, v, g, beta, scale=self.scale, initial_state=h0, output_final_state=True,
                           use_qk_l2norm_in_kernel=self.l2norm, cu_seqlens=self.x["cu"],
                           cu_seqlens_cpu=self.x["cu_cpu"])

    def prepare_backward(self):
        self.outputs = self.forward()

    def backward(self):
        return torch.autograd.grad(self.outputs, self.leaves, (self.x["do"], self.x["dht"]), retain_graph=True)


def kernel_ms(call, iterations=3):
    """Device time of one call, the union of its kernels' intervals, and each kernel's own: (ms, {kernel name: ms})."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            call()
        torch.cuda.synchronize()
    by_name, intervals = {}, []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernel = re.search(r"(\w+_kernel\w*)", e.name)
            name = kernel.group(1) if kernel else e.name[:48]
            by_name[name] = by_name.get(name, 0.0) + e.time_range.elapsed_us() / iterations / 1e3
            intervals.append((e.time_range.start, e.time_range.end))
    return busy_time(intervals) / iterations / 1e3, by_name


def host_ms(call, iterations=10):
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iterations + 1)]
    torch.cuda.synchronize()
    events[0].record()
    for i in range(iterations):
        call()
        events[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(iterations))


def measure(impl, pass_):
    """(outputs or gradients, kernel ms, {kernel name: ms}, host ms, warm-up s). The warm-up calls come first so
    that just-in-time compiles (fla's Triton kernels, FlashQLA's TileLang ones) stay out of the timings."""
    started = time.time()
    if pass_ == "fwd":
        call = impl.forward
    else:
        impl.prepare_backward()
        call = impl.backward
    for _ in range(3):
        result = call()
    torch.cuda.synchronize()
    warmup_s = time.time() - started
    kernel, by_name = kernel_ms(call)
    return result, kernel, by_name, host_ms(call), warmup_s


def load_flashqla():
    """FlashQLA's autograd entry behind Impl's call, and the versions to record; (None, {}) with the reason printed
    where it cannot be imported."""
    try:
        import flash_qla
        import tilelang
    except Exception as error:  # ImportError where absent; flash_qla raises ValueError on a GPU it does not serve
        print(f"FlashQLA not measured, its fields are null: {type(error).__name__}: {error}", flush=True)
        return None, {}

    def flashqla_gdn(*args, cu_seqlens_cpu, **kwargs):
        # FlashQLA takes no host copy of cu_seqlens: it reads the device tensor once to plan its intra-card split
        # and caches the plan per tensor, and every call of a cell passes the same one.
        return flash_qla.chunk_gated_delta_rule(*args, **kwargs)

    return flashqla_gdn, {"flash_qla": flash_qla.__version__, "tilelang": tilelang.__version__}


def load_fla():
    """fla's chunk_gated_delta_rule and its version to record. Imported only where it is measured, so that --ours-only
    runs (gpu.sh ab) need no anchors."""
    import fla
    import fla.ops.common.chunk_o as fla_chunk_o
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # lift the Hopper guard (fla #640), as the anchor measurements did
    return chunk_gated_delta_rule, {"fla": getattr(fla, "__version__", "?")}


def versions(anchor_versions):
    import triton

    import deltatrain

    return {"torch": torch.__version__, "triton": triton.__version__, **anchor_versions,
            "cuda_runtime": torch.version.cuda, "deltatrain": deltatrain.__version__, "driver": _driver()}


def _driver():
    try:
        import subprocess

        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def check_reference():
    """The fp64 torch evaluation above against deltatrain's fp64 token-by-token reference backend."""
    import deltatrain

    x = make_inputs(2, 4, [70, 1, 130], seed=7, dim=64)
    x64 = {n: t.double() if t.is_floating_point() else t for n, t in x.items()}
    o, ht = reference_fp64(x64["q"], x64["k"], x64["v"], x64["g"], x64["beta"], x64["h0"], x["cu_cpu"], 0.125)
    cpu = {n: t.cpu().numpy() for n, t in x64.items()}
    o_ref, ht_ref = deltatrain.chunk_gated_delta_rule(cpu["q"], cpu["k"], cpu["v"], cpu["g"], cpu["beta"], scale=0.125,
                                                      initial_state=cpu["h0"], output_final_state=True,
                                                      cu_seqlens=cpu["cu_cpu"], backend="reference")
    return max(rel_err(o.cpu(), torch.from_numpy(o_ref)), rel_err(ht.cpu(), torch.from_numpy(ht_ref)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--cells", default="all", choices=["fwd", "bwd", "all"])
    parser.add_argument("--only", type=int, nargs="*", help="indices into GRID (0-17) to run, in this order")
    parser.add_argument("--cell", action="append", default=[], metavar="PASS:HQK/HV:LENGTHS",
                        help="with --ours-only: a cell outside the grid, after --only's (e.g. fwd:2/4:32768, "
                             "bwd:16/32:4096*8); repeatable. With --cell and no --only, only these cells run")
    parser.add_argument("--limit-s", type=float, default=240.0, help="stop starting new cells after this long")
    parser.add_argument("--ours-only", action="store_true",
                        help="time deltatrain alone (a quick look, an A/B): gdn-h200-ours.json, no report")
    parser.add_argument("--l2norm-in-kernel", action="store_true",
                        help="with --ours-only: use_qk_l2norm_in_kernel=True (the anchors have it off)")
    parser.add_argument("--no-flashqla", action="store_true", help="leave FlashQLA out (its fields null)")
    parser.add_argument("--inference", action="store_true",
                        help="with --ours-only: forwards under torch.no_grad() (no saved buffer for a backward)")
    parser.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                        help="earlier runs' gdn-h200.json: their rows fill the cells this run does not measure")
    parser.add_argument("--missing-only", action="store_true", help="with --merge: run only the cells they lack")
    args = parser.parse_args()
    if args.inference and not args.ours_only:
        parser.error("--inference: only with --ours-only (the anchors' forwards are training forwards)")
    if args.l2norm_in_kernel and not args.ours_only:
        parser.error("--l2norm-in-kernel: only with --ours-only (the report is the anchors' recipe)")
    if args.missing_only and not args.merge:
        parser.error("--missing-only: needs --merge (the runs whose cells to skip)")
    if args.merge and args.ours_only:
        parser.error("--merge: not with --ours-only (which writes no report to merge into)")
    if args.cell and not args.ours_only:
        parser.error("--cell: only with --ours-only (the report is the anchor grid's)")
    try:
        extra_cells = [parse_cell(spec) for spec in args.cell]
    except ValueError as e:
        parser.error(str(e))
    earlier = []
    for path in args.merge:
        with open(path) as f:
            earlier.append(json.load(f))
    measured_before = {cell_of(row) for result in earlier for row in result["rows"]}
    started = time.time()

    import deltatrain.torch as ours_torch

    fla_gdn, fla_versions = (None, {}) if args.ours_only else load_fla()
    flashqla_gdn, flashqla_versions = (None, {}) if args.ours_only or args.no_flashqla else load_flashqla()
    scale = 128 ** -0.5
    print(f"fp64 torch evaluation vs deltatrain reference backend: {check_reference():.2e}", flush=True)

    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": args.commit, "gpu": torch.cuda.get_device_name(0),
              "versions": versions({**fla_versions, **flashqla_versions}), "rows": []}
    refused = set()  # the refusals printed so far, each once
    grid_cells = args.only if args.only else [] if extra_cells else range(len(GRID))
    # (cell, the seed of its inputs): a grid cell's index, so that its inputs are the same in every run
    cells = [(GRID[i], i) for i in grid_cells] + [(c, len(GRID) + i) for i, c in enumerate(extra_cells)]
    for (pass_, h_qk, h_v, seqlens, lengths), seed in cells:
        if args.cells != "all" and pass_ != args.cells:
            continue
        if args.missing_only and (pass_, h_qk, h_v, seqlens) in measured_before:
            continue
        if time.time() - started > args.limit_s:
            print(f"time limit: skipping {pass_} {h_qk}/{h_v} {seqlens} and later cells", flush=True)
            break
        x = make_inputs(h_qk, h_v, lengths, seed=seed)
        x64 = {n: t.double() if t.is_floating_point() else t for n, t in x.items()}
        leaves64 = [x64[n].requires_grad_(pass_ == "bwd") for n in ("q", "k", "v", "g", "beta", "h0")]
        with torch.set_grad_enabled(pass_ == "bwd"):
            o64, ht64 = reference_fp64(*leaves64, x["cu_cpu"], scale, args.l2norm_in_kernel)
        if pass_ == "fwd":
            expected = [o64, ht64]
        else:
            expected = list(torch.autograd.grad((o64, ht64), leaves64, (x64["do"], x64["dht"])))
        del o64, ht64, leaves64
        row = {"pass": pass_, "h_qk": h_qk, "h_v": h_v, "seqlens": seqlens}
        impls = [("ours", ours_torch.chunk_gated_delta_rule)]
        if not args.ours_only:
            impls += [("fla", fla_gdn), ("flashqla", flashqla_gdn)]
        for name, fn in impls:
            row.update((f"{name}_{field}", None) for field in FIELDS)
            if fn is None:
                continue
            impl = Impl(fn, x, scale, args.l2norm_in_kernel, args.inference and pass_ == "fwd")
            try:
                out, kernel, by_name, host, warmup_s = measure(impl, pass_)
            except REFUSALS.get(name, ()) as refusal:
                why = f"{type(refusal).__name__}: {refusal}"
                if why not in refused:
                    refused.add(why)
                    print(f"  {name} refuses this cell, its fields are null (printed once): {why}", flush=True)
                del impl
                continue
            print(f"  {name} kernels (ms per call; warm-up {warmup_s:.1f} s): " +
                  ", ".join(f"{k} {v:.3f}" for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])), flush=True)
            row[f"{name}_kernel_ms"] = round(kernel, 4)
            row[f"{name}_host_ms"] = round(host, 4)
            row[f"{name}_rel_err"] = max(rel_err(a, e) for a, e in zip(out, expected))
            row[f"{name}_kernels_ms"] = {k: round(v, 4) for k, v in by_name.items()}
            del impl, out
        torch.cuda.empty_cache()
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        save(args, earlier, result)
    save(args, earlier, result)


def save(args, earlier, result):
    """After every cell, so that a run stopped early keeps what it measured."""
    if args.ours_only:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gdn-h200-ours.json"), "w") as f:
            json.dump(result, f, indent=1)
    else:
        write(report(earlier, result), args.out)


def report(earlier, result):
    """This run over the earlier ones (its rows win where they share a cell), rows in the grid's order."""
    merged = merge(earlier + [result])
    merged["rows"].sort(key=lambda r: next(i for i, c in enumerate(GRID) if c[:4] == cell_of(r)))
    return merged


if __name__ == "__main__":
    sys.exit(main())
