"""One training step of the Qwen3.5-0.8B shape on one GPU: deltatrain beside HF transformers (with fla's GDN kernels
installed), in the same run.

A step is forward + next-token loss + backward on random tokens packed as sequences of --seq-len; transformers
runs a [B, seq_len] batch (B sequences, no padding), bf16 weights, sdpa attention. deltatrain runs
build/bin/model_step_benchmark (or --ours BINARY). Reports tokens/s, MFU (deltatrain's FLOP count for both:
cost.h, training FLOPs per token at --seq-len, against --peak-tflops) and peak memory; writes OUT.json / OUT.md.

    python bench/model_h200.py --ours build/bin/model_step_benchmark --out bench/results/model-h200
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch
import transformers
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

QWEN35_08B = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                  tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def hf_step(batch, seq_len, steps, warmup):
    """Median step time (ms) and peak memory (GiB) of transformers' forward + loss + backward, or None (OOM)."""
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**QWEN35_08B)
    config._attn_implementation = "sdpa"
    model = Qwen3_5ForCausalLM(config).to("cuda", torch.bfloat16)
    model.train()
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for s in range(warmup + steps):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            torch.cuda.synchronize()
            if s >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
    except torch.OutOfMemoryError:
        return {"error": "out of memory"}
    except RuntimeError as e:  # e.g. fla refusing a backward on this Triton
        return {"error": str(e).splitlines()[0][:200]}
    finally:
        peak = torch.cuda.max_memory_allocated() / 2**30
        del model
        torch.cuda.empty_cache()
    times.sort()
    return {"step_ms": times[len(times) // 2], "peak_gib": peak, "loss": loss.item()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", default="build/bin/model_step_benchmark")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batches", default="2,4,8", help="sequences per step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import fla  # noqa: F401  (the anchor a user would pick: transformers with fla's GDN kernels)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ours_json = f"/tmp/model_step_{batch}.json"
        run = subprocess.run([args.ours, "--sequences", str(batch), "--seq-len", str(args.seq_len),
                              "--steps", str(args.steps), "--warmup", str(args.warmup),
                              "--peak-tflops", str(args.peak_tflops), "--json", ours_json],
                             capture_output=True, text=True)
        print(run.stdout[-2000:], run.stderr[-2000:])
        ours = json.load(open(ours_json)) if run.returncode == 0 else None
        hf = hf_step(batch, args.seq_len, args.steps, args.warmup)
        tokens = batch * args.seq_len
        row = {"sequences": batch, "seq_len": args.seq_len, "tokens": tokens}
        if ours:
            row.update(ours_tokens_per_s=ours["tokens_per_s"], ours_mfu=ours["mfu"], ours_step_ms=ours["step_ms"],
                       ours_forward_ms=ours["forward_ms"], ours_memory_gib=ours["memory_used_gib"],
                       gflop_per_token=ours["training_gflop_per_token"])
        if "error" in hf:
            row["hf"] = hf["error"]
        else:
            row.update(hf_tokens_per_s=tokens / (hf["step_ms"] / 1e3), hf_step_ms=hf["step_ms"],
                       hf_peak_gib=hf["peak_gib"])
            if ours:
                row["hf_mfu"] = row["hf_tokens_per_s"] * ours["training_gflop_per_token"] * 1e9 / (args.peak_tflops * 1e12)
                row["speedup"] = row["ours_tokens_per_s"] / row["hf_tokens_per_s"]
        rows.append(row)
        print(json.dumps(row))
    record = {"date": datetime.date.today().isoformat(), "commit": args.commit, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "fla": getattr(fla, "__version__", "unknown"), "rows": rows}
    if args.out:
        json.dump(record, open(args.out + ".json", "w"), indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(f"# One training step of the Qwen3.5-0.8B shape, {record['gpu']}\n\n{record['date']}, commit "
                    f"{record['commit']}; transformers {record['transformers']} + fla {record['fla']}, torch "
                    f"{record['torch']}. Forward + loss + backward, bf16, random tokens, sequences of "
                    f"{args.seq_len}. MFU: deltatrain's training FLOPs per token (cost.h) / {args.peak_tflops:g} "
                    "TFLOP/s.\n\n| sequences x 4096 | deltatrain tokens/s | MFU | memory GiB | transformers tokens/s | "
                    "MFU | peak GiB | speedup |\n|---|---|---|---|---|---|---|---|\n")
            for r in rows:
                f.write(f"| {r['sequences']} | {r.get('ours_tokens_per_s', float('nan')):,.0f} | "
                        f"{r.get('ours_mfu', float('nan')):.1%} | {r.get('ours_memory_gib', float('nan')):.1f} | "
                        f"{r.get('hf_tokens_per_s', float('nan')):,.0f} | {r.get('hf_mfu', float('nan')):.1%} | "
                        f"{r.get('hf_peak_gib', float('nan')):.1f} | {r.get('speedup', float('nan')):.2f}x |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
