"""`make demo`: the GDN operator on a Qwen3.5-shaped layer, on the best backend this machine has.

16 q/k heads, 32 value heads, head dims 128, four packed sequences of different lengths, the in-kernel
q/k L2 norm, and Qwen's gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b). Runs the
forward and backward with backend="auto", checks one sequence and four value heads of both against the
fp64 reference backend (exit code 1 when they disagree), and prints the throughput of each pass.
"""

import secrets
import sys
import time

import numpy as np

import deltatrain as dt

H, HV, DIM = 16, 32, 128
LENGTHS = [1536, 700, 1100, 760]  # packed along T, as a trainer feeds them (B = 1, cu_seqlens)
CHECKED_SEQUENCE, CHECKED_VALUE_HEADS = 1, slice(0, 4)  # value heads 0-3 read q/k heads 0-1 (GVA 2)
TOLERANCE = 1e-4  # float32 computation against float64, relative to the largest value


def softplus(x):
    return np.logaddexp(0.0, x)


def layer_inputs(rng):
    T = sum(LENGTHS)
    # What the depthwise conv + SiLU would hand the operator; the norm inside makes the scale irrelevant.
    q = rng.standard_normal((1, T, H, DIM), dtype=np.float32)
    k = rng.standard_normal((1, T, H, DIM), dtype=np.float32)
    v = rng.standard_normal((1, T, HV, DIM), dtype=np.float32)
    A_log = np.log(rng.uniform(0.0, 16.0, HV))  # Qwen's initialisation
    dt_bias = np.ones(HV)
    a, b = rng.standard_normal((1, T, HV)), rng.standard_normal((1, T, HV))
    g = (-np.exp(A_log) * softplus(a + dt_bias)).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-b))).astype(np.float32)
    cu_seqlens = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens)


def timed(function, repeat=3):
    """(result, best seconds) over `repeat` calls after one warm-up call."""
    result = function()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return result, best


def checked_slice(inputs, do, start, end):
    """The checked sequence and heads as their own float64 problem (q/k heads that those value heads read)."""
    group = HV // H
    heads = CHECKED_VALUE_HEADS
    qk_heads = slice(heads.start // group, heads.stop // group)
    part = dict(
        q=inputs["q"][:, start:end, qk_heads], k=inputs["k"][:, start:end, qk_heads],
        v=inputs["v"][:, start:end, heads], g=inputs["g"][:, start:end, heads],
        beta=inputs["beta"][:, start:end, heads])
    part = {name: np.ascontiguousarray(x, dtype=np.float64) for name, x in part.items()}
    return part, np.ascontiguousarray(do[:, start:end, heads], dtype=np.float64), qk_heads


def relative_error(actual, expected):
    return float(np.abs(np.asarray(actual, np.float64) - expected).max() / np.abs(expected).max())


def main():
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    inputs = layer_inputs(rng)
    T = sum(LENGTHS)
    do = rng.standard_normal((1, T, HV, DIM), dtype=np.float32)
    low = dt._deltatrain.gdn
    chosen = low.resolve_backend(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                                 cu_seqlens=inputs["cu_seqlens"], use_qk_l2norm_in_kernel=True)
    print(f"deltatrain {dt.__version__}: GDN layer, {H} q/k heads, {HV} value heads, dims {DIM}, "
          f"sequences {'+'.join(map(str, LENGTHS))} = {T} tokens, float32, backend auto -> {chosen} (seed {seed})")

    (o, _), forward_s = timed(lambda: dt.chunk_gated_delta_rule(**inputs, use_qk_l2norm_in_kernel=True))
    grads, backward_s = timed(lambda: dt.chunk_gated_delta_rule_bwd(**inputs, do=do, use_qk_l2norm_in_kernel=True))

    start = sum(LENGTHS[:CHECKED_SEQUENCE])
    end = start + LENGTHS[CHECKED_SEQUENCE]
    part, part_do, qk_heads = checked_slice(inputs, do, start, end)
    want_o, _ = dt.chunk_gated_delta_rule(**part, use_qk_l2norm_in_kernel=True, backend="reference")
    want = dt.chunk_gated_delta_rule_bwd(**part, do=part_do, use_qk_l2norm_in_kernel=True, backend="reference")
    heads = CHECKED_VALUE_HEADS
    got = {"o": o[:, start:end, heads]}
    for name, value in zip(["dq", "dk", "dv", "dg", "dbeta"], grads):
        got[name] = value[:, start:end, qk_heads if name in ("dq", "dk") else heads]
    expected = dict(zip(["o", "dq", "dk", "dv", "dg", "dbeta"], [want_o, *want[:5]]))
    errors = {name: relative_error(got[name], expected[name]) for name in got}
    passed = all(error <= TOLERANCE for error in errors.values())

    print(f"check against the fp64 reference: sequence {CHECKED_SEQUENCE} ({end - start} tokens), value heads "
          f"{heads.start}-{heads.stop - 1}: max relative error " +
          ", ".join(f"{name} {error:.1e}" for name, error in errors.items()) +
          f" -> {'PASS' if passed else 'FAIL'} (tolerance {TOLERANCE:g})")
    for name, seconds in (("forward", forward_s), ("backward", backward_s)):
        print(f"{name:9s} {seconds * 1e3:8.1f} ms  {T / seconds:10,.0f} tokens/s")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
