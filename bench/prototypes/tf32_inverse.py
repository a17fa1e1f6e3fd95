"""How precise prepare's inverse must be: the forward's errors against the float64 recurrence when T = (I + A)^-1 is
formed as prepare forms it (16 x 16 diagonal blocks by substitution in float32, then the two doubling merges
T_21 = -T_22 (A_21 T_11)) with the merges' products in 3xTF32 (today: about float32), in one TF32 product (operands
rounded to TF32's 10 mantissa bits, float32 accumulation: a third of the tensor-core instructions and no split), or in
bfloat16 operands; and with T exact (float64). Everything after the inverse is the wgmma forward's rounding as
transition_chain.py emulates it: T stored in bfloat16, scaled by beta (and beta e^gamma for W) into bfloat16 operands,
W, U, P, S, Delta and K~ rounded where a product reads them, the state kept unrounded between chunks.

The question it answers: whether one TF32 product a merge (bench/NOTES.md, session 47) moves the forward's error
against float64 by more than noise. T reaches the passes in bfloat16 (unit roundoff 2^-8), so a merge error of
TF32's 2^-11 is expected to add an eighth of that rounding at most.

Run: python3 bench/prototypes/tf32_inverse.py   (relative errors of T, o and the final state for each inverse)
"""
import sys

import numpy as np

from segmented_state import C, bf16, recurrence
from transition_chain import draw, relative

BLOCK = 16  # prepare's diagonal blocks


def tf32(x):
    """x rounded to TF32 (10 mantissa bits, ties away from zero: tf32_rounding.h's tf32_value), as float64."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return rounded.view(np.float32).astype(np.float64)


def float32_product(a, b):
    """A product accumulated in float32 from the operands as given (3xTF32 is within 2^-22 of this)."""
    return (np.asarray(a, dtype=np.float32) @ np.asarray(b, dtype=np.float32)).astype(np.float64)


MERGES = {
    "3xTF32": float32_product,
    "1xTF32": lambda a, b: float32_product(tf32(a), tf32(b)),
    "bf16": lambda a, b: float32_product(bf16(a), bf16(b)),
}


def substitution(a_block):
    """(I + A)^-1 of a strictly lower 16 x 16 block by forward substitution in float32, one column a lane."""
    a = a_block.astype(np.float32)
    n = len(a)
    t = np.zeros((n, n), dtype=np.float32)
    for i in range(n):
        row = -(a[i, :i] @ t[:i, :]) if i else np.zeros(n, dtype=np.float32)
        row[i] += np.float32(1.0)
        t[i] = row
    return t.astype(np.float64)


def prepare_inverse(a, merge):
    """T = (I + A)^-1 by prepare's doubling: diagonal blocks of 16, then merges 16 -> 32 and 32 -> 64 (a chunk's rows
    padded to 64 with zero rows, as the kernel's are), each product rounded by `merge`."""
    n = len(a)
    padded = np.zeros((C, C))
    padded[:n, :n] = a
    t = np.zeros((C, C))
    for b0 in range(0, C, BLOCK):
        t[b0:b0 + BLOCK, b0:b0 + BLOCK] = substitution(padded[b0:b0 + BLOCK, b0:b0 + BLOCK])
    for size in (BLOCK, 2 * BLOCK):
        for lo in range(0, C, 2 * size):
            hi = lo + size
            x = merge(padded[hi:hi + size, lo:hi], t[lo:hi, lo:hi])
            t[hi:hi + size, lo:hi] = -merge(t[hi:hi + size, hi:hi + size], x)
    return t[:n, :n]


def forward(q, k, v, g, beta, h0, scale, merge):
    """The wgmma forward with T from `merge` (None: float64 inverse): o, the final state, T's worst relative error."""
    q, k, v = bf16(q), bf16(k), bf16(v)
    o, state, t_error = np.zeros_like(v), h0.copy(), 0.0
    for c0 in range(0, len(k), C):
        Q, K, V, b = q[c0:c0 + C], k[c0:c0 + C], v[c0:c0 + C], beta[c0:c0 + C]
        gam = np.cumsum(g[c0:c0 + C])
        decay = np.tril(np.exp(gam[:, None] - gam[None, :]))
        a = np.tril(b[:, None] * float32_product(K, K.T) * decay, -1)
        exact_t = np.linalg.inv(np.eye(len(K)) + a)
        t = exact_t if merge is None else prepare_inverse(a, merge)
        t_error = max(t_error, relative(t, exact_t))
        t_stored = bf16(t)
        U = bf16(bf16(t_stored * b[None, :]) @ V)
        W = bf16(bf16(t_stored * (b * np.exp(gam))[None, :]) @ K)
        P = bf16(scale * np.tril(Q @ K.T * decay))
        K_tilde = bf16(np.exp(gam[-1] - gam)[:, None] * K)
        s_b = bf16(state)
        delta = bf16(U - W @ s_b)
        o[c0:c0 + len(gam)] = scale * np.exp(gam)[:, None] * (Q @ s_b) + P @ delta
        state = np.exp(gam[-1]) * state + K_tilde.T @ delta
    return o, state, t_error


def errors(rng, tokens, dim, case):
    """Per inverse: (T's worst relative error, o's and the final state's relative errors against the recurrence)."""
    q, k, v, g, beta, h0, scale = draw(rng, tokens, dim, case)
    o_ref, ht_ref = recurrence(q, k, v, g, beta, h0, scale)
    result = {}
    for name, merge in (("float64", None), *MERGES.items()):
        o, ht, t_error = forward(q, k, v, g, beta, h0, scale, merge)
        result[name] = (t_error, relative(o, o_ref), relative(ht, ht_ref))
    return result


def main():
    rng = np.random.default_rng(0)
    for dim, chunks in ((64, 16), (128, 16)):
        for case in ("anchors", "long memory", "strong decay", "beta at 0 and 1"):
            for name, (et, eo, eh) in errors(rng, 64 * chunks + 17, dim, case).items():
                print(f"K = V = {dim:3d}, {case:16s} inverse {name:8s} T {et:.2e}  o {eo:.3e}  final state {eh:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
