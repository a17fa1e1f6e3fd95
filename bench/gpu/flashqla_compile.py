"""Compiles FlashQLA 0.1.3's Hopper TileLang kernels for sm_90a on a machine without a GPU: the backward's (the fused
backward, and prepare_h, which recomputes the chunk states first) and the forward's (kkt_solve, each chunk's
(I + strictly lower beta K K^T)^-1, then the fused forward; the forward's chunk_local_cumsum of g, launched before
them, is left out). TileLang lowers each to CUDA C++ (OUT/NAME.cu), then nvcc builds it with the flags TileLang's CUDA
backend uses, plus -lineinfo and -Xptxas -v (OUT/NAME.cubin; OUT/NAME.ptxas.txt, with the launch TileLang makes: threads
and dynamic shared memory), so that its SASS can be set beside ours (bench/gpu/sass_roles.py; bench/gpu/flashqla_sass.sh
does it all).

Needs: python 3.12 (the anchors' wheels are cp312); on PYTHONPATH, the site-packages folder that
../shared/tools/anchor_site.sh packs, unpacked (tilelang 0.1.15 with its TVM, tvm_ffi, flash_qla 0.1.3); torch (the CPU
build will do), numpy, psutil, cloudpickle, ml-dtypes, tqdm; nvcc (tried with CUDA 13.0).

What it writes is FlashQLA's generated code (MIT licensed, the Qwen team's): for measurement only, kept outside the
repository and never committed.

  python bench/gpu/flashqla_compile.py --out /tmp/flashqla-sass/out [--h-qk 16 --h-v 32] [--kernels fused_fwd ...]
"""

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import types

# flash_qla's hopper module: its TileLang jit
FACTORIES = {"fused_bwd": "tilelang_fused_chunk_gdr_bwd", "prepare_h": "tilelang_prepare_h",
             "kkt_solve": "tilelang_kkt_solve", "fused_fwd": "tilelang_fused_chunk_gdr_fwd"}
KERNELS = tuple(FACTORIES)
HOPPER = "flash_qla.ops.gated_delta_rule.chunk.hopper"


def hopper_factories(site, names, torch, sms):
    """{name: its TileLang jit} from flash_qla's hopper modules. The package __init__s probe the GPU at import (and
    refuse a machine without one), so the packages above the modules are stood in for by empty ones with the same
    path; fused_fwd reads the SM count at import (for the block_DV choice of its launcher, not called here), so that
    is answered with `sms` meanwhile."""
    parts = HOPPER.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(site, *parts[:depth])]
            sys.modules[name] = package
    properties, torch.cuda.get_device_properties = (torch.cuda.get_device_properties,
                                                    lambda *_: types.SimpleNamespace(multi_processor_count=sms))
    try:
        return {n: getattr(importlib.import_module(f"{HOPPER}.{n}"), FACTORIES[n]) for n in names}
    finally:
        torch.cuda.get_device_properties = properties


def kernel_arguments(args, torch):
    """Each kernel's template arguments as FlashQLA's chunk_gated_delta_rule gives them for bench/gdn_h200.py's
    inputs (make_inputs, Impl): q, k, v, do bf16; g (logsigmoid, then FlashQLA's cumsum keeps the dtype) and beta
    (sigmoid) float32; cu_seqlens int64 (varlen); h0 and dht given, float32; output_final_state (float32); the chunk
    states h (stored by prepare_h, not by the forward) in k's dtype; the forward's block_DV as its launcher picks it
    (--block-dv); no context parallelism (no cp_seq_map: its automatic intra-card split declines 4 x 8192 tokens at
    32 value heads, though it takes a training call's 1 x 8192, which adds its CP kernels and is_cp)."""
    bf16, fp32 = torch.bfloat16, torch.float32
    common = dict(H=args.h_v, Hg=args.h_qk, DK=args.dim, DV=args.dim, chunk_size=args.chunk, accum_dtype="float32",
                  qkva_dtype=bf16, g_dtype=fp32, b_dtype=fp32, h_dtype=bf16, seqlen_dtype=torch.int64,
                  is_varlen=True, state_v_first=False)
    return {"fused_bwd": dict(common, scale=args.dim ** -0.5, o_dtype=bf16, use_dht=True),
            "prepare_h": dict(common, h0_dtype=fp32, ht_dtype=fp32, use_initial_state=True, store_final_state=False,
                              store_h=True, is_cp=False),
            "kkt_solve": dict(H=args.h_v, Hg=args.h_qk, DK=args.dim, chunk_size=args.chunk, accum_dtype="float32",
                              qkva_dtype=bf16, b_dtype=fp32, seqlen_dtype=torch.int64, is_varlen=True),
            "fused_fwd": dict(common, scale=args.dim ** -0.5, h0_dtype=fp32, ht_dtype=fp32, o_dtype=bf16,
                              use_initial_state=True, store_final_state=True, store_h=False, store_o=True, is_cp=False,
                              block_DV=args.block_dv)}


def cuda_source(jit, arguments):
    """TileLang's CUDA C++ for the kernel, lowered for sm_90a, and a line per kernel of its launch (threads a CTA,
    dynamic shared memory, which ptxas does not see); lower() compiles nothing, so no GPU or driver is asked."""
    import tilelang
    from tilelang import tvm
    from tilelang.engine.lower import lower
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with target, tvm.transform.PassContext(opt_level=3, config=jit.pass_configs or {}):  # its passes ask for both
        lowered = lower(jit.get_tir(**arguments), target=target)
    launches = [f"launch {f.attrs['global_symbol']}: {dict(f.attrs['thread_extent'])}, "
                f"{int(f.attrs.get('dyn_shared_memory_buf', 0))} bytes dynamic smem"
                for f in lowered.device_mod.functions.values()]
    return lowered.kernel_source, "\n".join(launches), os.path.dirname(tilelang.__file__)


def nvcc(source, cubin, tilelang_dir):
    """nvcc's cubin of the source with TileLang's CUDA backend flags; returns ptxas's -v report."""
    compiler = os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.access(compiler, os.X_OK):
        sys.exit("flashqla_compile: no nvcc (set NVCC, or put CUDA's bin on PATH)")
    command = [compiler, "--cubin", "-O3", "-lineinfo", "-arch=sm_90a", "-std=c++20", "--use_fast_math",
               "-I" + os.path.join(tilelang_dir, "src"), "-I" + os.path.join(tilelang_dir, "3rdparty/cutlass/include"),
               "-Xptxas", "-v", "-o", cubin, source]
    if os.environ.get("CCBIN"):
        command.insert(1, "-ccbin=" + os.environ["CCBIN"])
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"flashqla_compile: nvcc failed on {source}:\n{result.stderr[-4000:]}")
    return "\n".join(line for line in result.stderr.splitlines() if line.startswith("ptxas info"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for NAME.cu, NAME.cubin, NAME.ptxas.txt (not the repo)")
    parser.add_argument("--h-qk", type=int, default=16, help="query/key heads (FlashQLA's Hg)")
    parser.add_argument("--h-v", type=int, default=32, help="value heads (FlashQLA's H)")
    parser.add_argument("--dim", type=int, default=128, help="head dimension, keys and values (FlashQLA: 128 only)")
    parser.add_argument("--chunk", type=int, default=64, help="chunk length (FlashQLA: 64 only)")
    parser.add_argument("--block-dv", type=int, choices=(32, 64, 128), default=128,
                        help="the forward's value columns a CTA: its launcher takes 128 where sequences x value heads "
                        "reach 0.7 x the SMs (92 on 132: 3 sequences at 32 heads), 64 where twice that does, else 32")
    parser.add_argument("--sms", type=int, default=132, help="the SM count fused_fwd's import is told (H100/H200: 132)")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS),
                        help="backward: fused_bwd prepare_h; forward: kkt_solve fused_fwd (default: all)")
    parser.add_argument("--site", help="the unpacked anchors' site-packages (default: the entry of PYTHONPATH holding "
                        "flash_qla)")
    args = parser.parse_args()
    site = args.site or next((p for p in sys.path if os.path.isdir(os.path.join(p, "flash_qla"))), None)
    if site is None:
        sys.exit("flashqla_compile: flash_qla is not on PYTHONPATH (unpack the anchors' site-packages, made by "
                 "../shared/tools/anchor_site.sh, and put it there, or pass --site)")
    sys.path.insert(0, site)
    import torch

    jits = hopper_factories(site, args.kernels, torch, args.sms)
    arguments = kernel_arguments(args, torch)
    os.makedirs(args.out, exist_ok=True)
    for name in args.kernels:
        source, launches, tilelang_dir = cuda_source(jits[name], arguments[name])
        path = os.path.join(args.out, f"{name}.cu")
        with open(path, "w") as f:
            f.write(source)
        report = nvcc(path, os.path.join(args.out, f"{name}.cubin"), tilelang_dir)
        with open(os.path.join(args.out, f"{name}.ptxas.txt"), "w") as f:
            f.write(f"{report}\n{launches}\n")
        used = next((line for line in report.splitlines() if "Used" in line), "")
        print(f"{name}: {path}, {name}.cubin; {used.split(':', 1)[-1].strip()}; {launches}")


if __name__ == "__main__":
    main()
