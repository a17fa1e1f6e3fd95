"""Parity of deltatrain's model with HF transformers on the same weights: the contract of the model.

Builds small random Qwen3.5 text models in transformers (every weight random, norms included, so that a
misplaced weight cannot hide behind HF's zero/one initialisation), saves them with save_pretrained, loads
them into deltatrain, and compares on a packed batch of several sequences: the logits, the loss and the
gradient of every parameter. transformers has no packed path for the GDN layer on the CPU (its convolution
would cross sequences), so it runs each sequence alone; deltatrain runs them packed in one batch.

    python bench/hf_parity.py [--seed N] [--out bench/results/model-hf-parity]

Needs torch and transformers (>= 5, with Qwen3_5ForCausalLM) and the deltatrain module on the path.
Writes OUT.json and OUT.md (date, commit, versions, per-config errors) and exits non-zero on a miss.
"""

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5

from deltatrain import _deltatrain

FLOAT64_TOLERANCE = 1e-6  # the gates' float32 inputs in transformers' float64 run
FLOAT32_TOLERANCE = 1e-5

CONFIGS = {
    # Our tiny preset's shape with a small vocabulary.
    "tiny-shape": dict(vocab_size=211, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                       tie_word_embeddings=True),
    # Odd sizes, untied head, attention every second layer, a stronger RoPE (theta 1e4).
    "odd-untied": dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                       layer_types=["linear_attention", "full_attention"] * 2, num_attention_heads=6,
                       num_key_value_heads=2, head_dim=16, linear_num_key_heads=3, linear_num_value_heads=6,
                       linear_key_head_dim=12, linear_value_head_dim=10, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}
SEQUENCE_LENGTHS = [37, 1, 70, 12]  # one longer than a GDN chunk of 64, one of a single token


def randomize(model, generator):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.5, generator=generator))
            elif p.dim() == 1:  # norms (HF: zeros, or ones for the gated norm) and dt_bias
                p.add_(0.3 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def relative(ours, theirs):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1e-30))


def gdn_float64(query, key, value, g, beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule by its recurrence in float64 (transformers' own computes in float32)."""
    heads, value_heads = key.shape[2], value.shape[2]
    query, key = (x.double().repeat_interleave(value_heads // heads, dim=2) for x in (query, key))
    value, g, beta = value.double(), g.double(), beta.double()
    if use_qk_l2norm_in_kernel:
        query, key = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (query, key))
    query = query / query.shape[-1] ** 0.5
    batch, length, _, dk = key.shape
    state = torch.zeros(batch, value_heads, dk, value.shape[-1], dtype=torch.float64)
    outputs = []
    for t in range(length):
        state = state * g[:, t].exp()[..., None, None]
        delta = (value[:, t] - (state * key[:, t, ..., None]).sum(-2)) * beta[:, t, :, None]
        state = state + key[:, t, ..., None] * delta[..., None, :]
        outputs.append((state * query[:, t, ..., None]).sum(-2))
    return torch.stack(outputs, dim=1), (state if output_final_state else None)


def rmsnorm_float64(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def gated_rmsnorm_float64(self, x, gate):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x * torch.nn.functional.silu(gate)


def rotary_float64(self, x, position_ids):
    positions = position_ids[0] if position_ids.dim() == 3 else position_ids  # text: the three mrope rows agree
    dim = 2 * self.inv_freq.shape[0]
    inv_freq = 1.0 / self.config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions[..., None].double() * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


# transformers computes these in float32 whatever the model's dtype; in the float64 reference run they are
# replaced by the same formulas in float64. What stays float32 there: the GDN gates' inputs (A_log.float(),
# a.float()), rounding g to ~1e-7 relative.
FLOAT64_PATCHES = [(modeling_qwen3_5, "torch_chunk_gated_delta_rule", gdn_float64),
                   (modeling_qwen3_5.Qwen3_5RMSNorm, "forward", rmsnorm_float64),
                   (modeling_qwen3_5.Qwen3_5RMSNormGated, "forward", gated_rmsnorm_float64),
                   (modeling_qwen3_5.Qwen3_5TextRotaryEmbedding, "forward", rotary_float64)]


@contextlib.contextmanager
def float64_internals():
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in FLOAT64_PATCHES]
    for owner, name, replacement in FLOAT64_PATCHES:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def run_hf(hf, tokens, cu):
    """transformers on each sequence alone: logits, the mean next-token loss of the batch, every gradient."""
    lengths = np.diff(cu)
    targets = int(sum(n - 1 for n in lengths))
    hf.zero_grad()
    logits_all, loss_total = [], 0.0
    for n in range(len(lengths)):
        seq = tokens[cu[n]:cu[n + 1]][None]
        logits = hf(input_ids=seq).logits[0]
        if lengths[n] > 1:
            loss = torch.nn.functional.cross_entropy(logits[:-1].to(torch.float64), seq[0, 1:], reduction="sum")
            (loss / targets).backward()
            loss_total += loss.item() / targets
        logits_all.append(logits.detach().to(torch.float64).numpy())
    grads = {n: p.grad.to(torch.float64).numpy() for n, p in hf.named_parameters() if p.grad is not None}
    return np.concatenate(logits_all), loss_total, grads


def run_ours(path, dtype, tokens, cu):
    ours = _deltatrain.model.Model(path, dtype=dtype)
    ours.load(path)
    token_list, cu_list = tokens.tolist(), cu.tolist()
    logits = ours.logits(token_list, cu_list)
    ours.zero_grads()
    loss = ours.forward(token_list, cu_list)
    ours.backward()
    names = set(ours.param_names())
    return logits, loss, lambda hf_name: ours.grad(
        "model.embed_tokens.weight" if hf_name == "lm_head.weight" and hf_name not in names else hf_name)


def errors(a, b):
    """Relative differences of two runs (logits, loss, gradients): max |a - b| / max |b|."""
    logits_a, loss_a, grad_a = a
    logits_b, loss_b, grads_b = b
    worst, worst_name = 0.0, ""
    for name, g in grads_b.items():
        e = relative(grad_a(name), g)
        if e > worst:
            worst, worst_name = e, name
    return {"loss": abs(loss_a - loss_b) / abs(loss_b), "logits": relative(logits_a, logits_b),
            "grads": worst, "worst_grad": worst_name}


def compare(name, kwargs, seed):
    """HF's math in float64 (its GDN layer computed in float64 too) is the truth; deltatrain in float64 must
    equal it to rounding, and deltatrain in float32 must be as close to it as transformers in float32 is."""
    generator = torch.Generator().manual_seed(seed)
    config = Qwen3_5TextConfig(**kwargs)
    config._attn_implementation = "sdpa"  # float64 throughout for float64 inputs
    hf64 = Qwen3_5ForCausalLM(config).double()
    randomize(hf64, generator)
    hf32 = copy.deepcopy(hf64).float()
    tokens = torch.randint(0, config.vocab_size, (sum(SEQUENCE_LENGTHS),), generator=generator)
    cu = np.concatenate([[0], np.cumsum(SEQUENCE_LENGTHS)]).astype(np.int32)

    with float64_internals():
        truth = run_hf(hf64, tokens, cu)
    hf_float32 = run_hf(hf32, tokens, cu)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model")
        hf64.save_pretrained(path)  # float64 safetensors: each run rounds them to its own dtype
        ours64 = run_ours(path, "float64", tokens, cu)
        ours32 = run_ours(path, "float32", tokens, cu)
    hf32_as_ours = (hf_float32[0], hf_float32[1], lambda n: hf_float32[2][n])
    result = {"config": name, "tokens": int(cu[-1]), "sequences": SEQUENCE_LENGTHS,
              "gradients_compared": len(truth[2]),
              "ours_float64_vs_hf_float64": errors(ours64, truth),
              "ours_float32_vs_hf_float64": errors(ours32, truth),
              "hf_float32_vs_hf_float64": errors(hf32_as_ours, truth),
              "ours_float32_vs_hf_float32": errors(ours32, hf_float32)}
    exact = result["ours_float64_vs_hf_float64"]
    ours, theirs = result["ours_float32_vs_hf_float64"], result["hf_float32_vs_hf_float64"]
    # float64: the same function to rounding. float32: within 1e-5 of the truth, or no further from it than
    # transformers' own float32 run is.
    result["pass"] = (max(exact["loss"], exact["logits"], exact["grads"]) <= FLOAT64_TOLERANCE and
                      all(ours[k] <= max(FLOAT32_TOLERANCE, 1.5 * theirs[k]) for k in ("loss", "logits", "grads")))
    return result


def commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return "unknown"


COMPARISONS = [("ours_float64_vs_hf_float64", "deltatrain float64 vs HF float64"),
               ("ours_float32_vs_hf_float64", "deltatrain float32 vs HF float64"),
               ("hf_float32_vs_hf_float64", "HF float32 vs HF float64"),
               ("ours_float32_vs_hf_float32", "deltatrain float32 vs HF float32")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    parser.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    results = []
    for name, kwargs in CONFIGS.items():
        r = compare(name, kwargs, args.seed)
        results.append(r)
        print(f"{name} ({r['gradients_compared']} gradient tensors): {'PASS' if r['pass'] else 'FAIL'}")
        for key, label in COMPARISONS:
            e = r[key]
            print(f"  {label:34s} loss {e['loss']:.2e}  logits {e['logits']:.2e}  grads {e['grads']:.2e}"
                  f"  ({e['worst_grad']})")
    record = {"date": datetime.date.today().isoformat(), "commit": commit(), "seed": args.seed,
              "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "device": "cpu", "results": results}
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(record, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(f"# deltatrain's model against HF transformers on the same weights\n\n{record['date']}, commit "
                    f"{record['commit']}, transformers {record['transformers']}, torch {record['torch']}, CPU, "
                    f"seed {args.seed}. `python bench/hf_parity.py --out bench/results/model-hf-parity`.\n\n"
                    f"A packed batch of sequences of {SEQUENCE_LENGTHS} tokens (deltatrain packed, transformers one "
                    "sequence at a time). The truth is transformers' Qwen3_5ForCausalLM in float64 with its GDN layer "
                    "computed in float64 too (its own runs in float32 whatever the model's dtype). Each cell is "
                    "max |a - b| / max |b|; gradients: the worst parameter tensor.\n\n"
                    "| config | comparison | loss | logits | gradients (worst tensor) |\n|---|---|---|---|---|\n")
            for r in results:
                for key, label in COMPARISONS:
                    e = r[key]
                    f.write(f"| {r['config']} | {label} | {e['loss']:.2e} | {e['logits']:.2e} | "
                            f"{e['grads']:.2e} ({e['worst_grad']}) |\n")
            f.write(f"\nPass rule: deltatrain float64 within {FLOAT64_TOLERANCE:g} of the truth; deltatrain float32 "
                    f"within {FLOAT32_TOLERANCE:g} of it or no further than 1.5x transformers' own float32 error. "
                    f"Result: {'pass' if all(r['pass'] for r in results) else 'FAIL'}.\n")
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
