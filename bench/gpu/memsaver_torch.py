"""The memory saver inside a PyTorch process, on a GPU: deltatrain's LD_PRELOAD shim or torch_memory_saver.

    LD_PRELOAD=<shim> python3 bench/gpu/memsaver_torch.py --saver deltatrain --check --sizes-gib 1,8 --out r.json
    LD_PRELOAD=<tms preload .so> python3 bench/gpu/memsaver_torch.py --saver tms --sizes-gib 1,8,32 --out t.json

--check: tensors under three tags (optimizer: cpu, params: restore_from the trainer's pinned copy, grads: none);
the device's free memory must rise by their size at pause, and after resume the optimizer state must equal its
copy and the parameters the pinned weights as updated while parked.
Timings: one uint8 tensor of each size per policy (cpu, none), pause and resume per cycle, beside torch's own
pinned copy of the same bytes (the better of two, each direction). JSON lines go to --out.
"""

import argparse
import importlib.util
import json
import os
import sys
import time

import torch

GIB = 1 << 30


def load_deltatrain_memsaver():
    # By path: the compiled module (and so the deltatrain package's __init__) is not built on this machine.
    path = os.path.join(os.path.dirname(__file__), "..", "..", "python", "deltatrain", "memsaver.py")
    spec = importlib.util.spec_from_file_location("deltatrain_memsaver", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class DeltatrainSaver:
    name = "deltatrain"

    def __init__(self):
        self.module = load_deltatrain_memsaver()
        self.saver = self.module.preloaded()

    def region(self, tag, backup):
        return self.saver.region(tag, backup)

    def pause(self, tag):
        self.saver.pause(tag)

    def resume(self, tag):
        self.saver.resume(tag)


class TmsSaver:
    name = "torch_memory_saver"

    def __init__(self, retain):
        from torch_memory_saver import torch_memory_saver

        self.saver = torch_memory_saver
        if retain:
            self.saver.retain_cpu_backup = True
            self.name += " (retain_cpu_backup)"

    def region(self, tag, backup):
        return self.saver.region(tag=tag, enable_cpu_backup=backup == "cpu")

    def pause(self, tag):
        self.saver.pause(tag)

    def resume(self, tag):
        self.saver.resume(tag)


def free_bytes():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def pinned_copy_rates(nbytes):
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device.random_(0, 256)
    rates = {}
    for name, copy in (("d2h", lambda: host.copy_(device, non_blocking=True)),
                       ("h2d", lambda: device.copy_(host, non_blocking=True))):
        best = float("inf")
        for _ in range(2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        rates[name + "_gibps"] = nbytes / best / GIB
    del device, host
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()
    return rates


def time_cycles(saver, nbytes, backup, cycles):
    tag = f"bench-{backup}-{nbytes}"
    with saver.region(tag, backup):
        tensor = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    tensor.random_(0, 256)
    reference = tensor.clone() if backup == "cpu" else None
    before = free_bytes()
    result = {"saver": saver.name, "bytes": nbytes, "backup": backup, "pause_s": [], "resume_s": []}
    for cycle in range(cycles):
        torch.cuda.synchronize()
        start = time.perf_counter()
        saver.pause(tag)
        result["pause_s"].append(time.perf_counter() - start)
        if cycle == 0:
            result["free_rise_bytes"] = free_bytes() - before
        start = time.perf_counter()
        saver.resume(tag)
        torch.cuda.synchronize()
        result["resume_s"].append(time.perf_counter() - start)
    if reference is not None:
        result["contents_restored"] = bool(torch.equal(tensor, reference))
    del tensor, reference
    torch.cuda.empty_cache()
    for key in ("pause", "resume"):
        result[key + "_gibps"] = [nbytes / seconds / GIB for seconds in result[key + "_s"]]
    return result


def check(saver):
    """Free memory rises at pause; tensors are intact after resume where the policy says so."""
    module = saver.module
    elements = 64 << 20  # 256 MiB of float32 per tensor
    with saver.saver.region("optimizer", "cpu"):
        exp_avg = torch.randn(elements, device="cuda")
    with saver.saver.region("params", "restore_from"):
        params = torch.randn(elements, device="cuda")
    with saver.saver.region("grads", "none"):
        grads = torch.randn(elements, device="cuda")
    outside = torch.randn(elements, device="cuda")  # not in a region: must survive untouched
    weights = params.cpu().pin_memory()  # the trainer's one pinned copy of the weights
    saver.saver.register_tensor_backup("params", [(params, weights)])
    exp_avg_copy, outside_copy = exp_avg.cpu(), outside.cpu()

    before = free_bytes()
    saver.saver.pause()
    rise = free_bytes() - before
    parked = sum(entry.reserved_bytes for entry in saver.saver.stats().values())
    weights.mul_(0.5)  # the trainer updates its copy while the GPU memory is parked
    try:
        saver.saver.pause("optimizer")
        paused_twice = "no error"
    except module.StateError as error:
        paused_twice = f"StateError: {error}"
    saver.saver.resume()
    grads.zero_()  # contents undefined: it must be usable again
    torch.cuda.synchronize()
    result = {
        "check": "torch",
        "free_rise_bytes": rise,
        "parked_bytes": parked,
        "free_rise_covers_parked": rise >= parked,
        "optimizer_restored": bool(torch.equal(exp_avg.cpu(), exp_avg_copy)),
        "params_restored_from_backup": bool(torch.equal(params.cpu(), weights)),
        "outside_untouched": bool(torch.equal(outside.cpu(), outside_copy)),
        "grads_usable": float(grads.sum()) == 0.0,
        "pause_paused_tag": paused_twice,
        "stats": {tag: vars(entry) for tag, entry in saver.saver.stats().items()},
    }
    del exp_avg, params, grads
    torch.cuda.empty_cache()  # segments go back through the shim's cudaFree
    result["allocations_after_free"] = {tag: entry.allocations for tag, entry in saver.saver.stats().items()}
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--saver", choices=["deltatrain", "tms", "tms-retain"], required=True)
    parser.add_argument("--sizes-gib", default="1,8,32")
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.cuda.init()
    saver = DeltatrainSaver() if args.saver == "deltatrain" else TmsSaver(retain=args.saver == "tms-retain")
    with open(args.out, "a") as out:
        def emit(record):
            record.update(torch=torch.__version__, gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(json.dumps(record), flush=True)

        if args.check:
            emit(check(saver))
        for size in (float(text) for text in args.sizes_gib.split(",") if text):
            nbytes = int(size * GIB)
            emit({"reference": "torch pinned copy", "bytes": nbytes, **pinned_copy_rates(nbytes)})
            for backup in ("cpu", "none"):
                emit(time_cycles(saver, nbytes, backup, args.cycles))


if __name__ == "__main__":
    main()
