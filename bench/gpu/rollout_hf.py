"""HF transformers' generate on the Qwen3.5-0.8B shape beside bench/gpu/rollout_benchmark.cpp, in the same run:
random weights (bf16, sdpa attention, fla's GDN kernels where importable), --batches of random prompts of
--prompt tokens, exactly --new-tokens greedy tokens each. The prefill is timed as generate(max_new_tokens=1), the
decode as the rest of a full generate; one JSON line per batch size on stdout, and all of them in --json.

    python bench/gpu/rollout_hf.py --batches 64,256 --json /tmp/hf.json
"""

import argparse
import json
import os
import sys
import time

import torch
import transformers
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from model_h200 import QWEN35_08B  # noqa: E402  (one definition of the shape)


def timed_generate(model, ids, new_tokens):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         pad_token_id=0, eos_token_id=None)
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    try:
        import fla  # noqa: F401
        gdn_kernels = "fla " + getattr(fla, "__version__", "?")
    except ImportError:
        gdn_kernels = "torch fallback (fla not importable)"
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**QWEN35_08B)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    model.eval()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = torch.randint(0, config.vocab_size, (batch, args.prompt), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            timed_generate(model, ids, 4)  # warm-up: kernels' JIT, allocator
            prefill_s, _ = timed_generate(model, ids, 1)
            total_s, out = timed_generate(model, ids, args.new_tokens)
        assert out.shape == (batch, args.prompt + args.new_tokens), out.shape
        decode_tokens = batch * (args.new_tokens - 1)
        row = {"batch": batch, "prompt": args.prompt, "new_tokens": args.new_tokens, "prefill_s": prefill_s,
               "generate_s": total_s, "decode_tokens_per_s": decode_tokens / (total_s - prefill_s),
               "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
        print(json.dumps(row), flush=True)
        rows.append(row)
    record = {"transformers": transformers.__version__, "torch": torch.__version__, "gdn_kernels": gdn_kernels,
              "gpu": torch.cuda.get_device_name(), "rows": rows}
    print(json.dumps({k: v for k, v in record.items() if k != "rows"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
