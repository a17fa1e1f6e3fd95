"""The forward state chain as one product a chunk, S' = M_c S + R_c, against today's three dependent products, both
with the cuda pass's bfloat16 roundings emulated, both against the float64 token recurrence: whether the one-product
chain (bench/NOTES.md, "A build plan for the warp-specialised forward") costs accuracy. And the backward's chain,
the same map transposed: dS = M_c^T dS' + C_c against the fused backward's K dS', T^T, K^T (fused_backward.py), for
dh0 against the recurrence's reverse.

Per chunk (segmented_state.py has the algebra): M_c = e^(g_L) I - K~^T W and R_c = K~^T U are independent of the
state, so they can be formed off the chain; on it, one K x K x V product. Today's pass instead forms
Delta = U - W S (its product reads S rounded to bfloat16 and Delta is rounded for the next), then S' = e^(g_L) S +
K~^T Delta. Here every product's operands are rounded to bfloat16 where a wgmma would read them (W, U, K~, Q, P,
S, Delta, M_c) and accumulates in float64 (the tensor cores' float32 accumulation adds less than the operands'
rounding); the state itself stays unrounded between steps, as the pass keeps it in float32 registers. R_c is
tried both in float32 (added to the accumulator) and rounded to bfloat16 (a wgmma operand).

Run: python3 bench/prototypes/transition_chain.py   (prints the relative errors of o, the final state and dh0)
"""
import sys

import numpy as np

from fused_backward import chunk_forward_terms, recurrence_backward
from segmented_state import C, bf16, chunk_terms, problem, recurrence


def relative(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def exact(x):
    """No rounding: the chains' algebra alone."""
    return x


def output(c0, gam, state, delta, q, k, scale, rnd):
    """A chunk's o from the rounded state and Delta it was given (the same formula for both chains)."""
    Q, K = rnd(q[c0:c0 + len(gam)]), rnd(k[c0:c0 + len(gam)])
    P = rnd(scale * np.tril(Q @ K.T * np.exp(gam[:, None] - gam[None, :])))
    return scale * np.exp(gam)[:, None] * (Q @ state) + P @ delta


def three_product_chain(q, k, v, g, beta, h0, scale, rnd=bf16):
    """Today's pass: Delta = U - W S, S' = e^(g_L) S + K~^T Delta, operands rounded by `rnd`."""
    o, state = np.zeros_like(v), h0.copy()
    for c0, gam, W, U, K_tilde, last in chunk_terms(k, v, g, beta):
        s_b = rnd(state)
        delta = rnd(rnd(U) - rnd(W) @ s_b)
        o[c0:c0 + len(gam)] = output(c0, gam, s_b, delta, q, k, scale, rnd)
        state = last * state + rnd(K_tilde).T @ delta
    return o, state


def one_product_chain(q, k, v, g, beta, h0, scale, r_rounded=False, rnd=bf16):
    """The transition chain: S' = M_c S + R_c with M_c rounded by `rnd` (a wgmma operand), R_c unrounded (float32,
    added to the accumulator) or, with r_rounded, rounded too."""
    o, state = np.zeros_like(v), h0.copy()
    for c0, gam, W, U, K_tilde, last in chunk_terms(k, v, g, beta):
        W_b, U_b, Kt_b = rnd(W), rnd(U), rnd(K_tilde)
        M = rnd(last * np.eye(W.shape[1]) - Kt_b.T @ W_b)
        R = Kt_b.T @ U_b
        if r_rounded:
            R = rnd(R)
        s_b = rnd(state)
        delta = rnd(U_b - W_b @ s_b)  # off the chain: O's Delta from the same rounded state
        o[c0:c0 + len(gam)] = output(c0, gam, s_b, delta, q, k, scale, rnd)
        state = M @ s_b + R
    return o, state


def state_gradient_chains(q, k, v, g, beta, h0, scale, do, dht, rnd=bf16):
    """dh0 by the fused backward's three-product chain and by the one-product one, operands rounded by `rnd`:
    three: dDelta = scale P^T dO + diag(D) K dS', dcorr = diag(beta) T^T dDelta,
           dS = E_n dS' + scale Q^T diag(E) dO - K^T diag(E) dcorr;
    one:   dS = M_c^T dS' + C_c, M_c^T = E_n I - K^T diag(E beta) T^T diag(D) K (rounded: a wgmma operand) and
           C_c = scale Q^T diag(E) dO - K^T diag(E beta) T^T scale P^T dO (float32), both off the chain."""
    three, one = dht.copy(), dht.copy()
    for c0 in reversed(range(0, len(q), C)):
        Q, K, dO, b = rnd(q[c0:c0 + C]), rnd(k[c0:c0 + C]), rnd(do[c0:c0 + C]), beta[c0:c0 + C]
        f = chunk_forward_terms(Q, K, v[c0:c0 + C], g[c0:c0 + C], b, np.zeros_like(h0))
        E, D, T, P = f["E"], f["D"], rnd(f["T"]), rnd(scale * f["P"])
        from_dO = scale * Q.T @ (E[:, None] * dO)
        d_delta = rnd(P.T @ dO + D[:, None] * (K @ rnd(three)))
        d_corr = rnd(b[:, None] * (T.T @ d_delta))
        three = E[-1] * three + from_dO - K.T @ (E[:, None] * d_corr)
        M_t = rnd(E[-1] * np.eye(K.shape[1]) - K.T @ ((E * b)[:, None] * (T.T @ (D[:, None] * K))))
        C_c = from_dO - K.T @ ((E * b)[:, None] * (T.T @ rnd(P.T @ dO)))
        one = M_t @ rnd(one) + C_c
    return three, one


def draw(rng, tokens, dim, case):
    """segmented_state.problem's cases, and "long memory": the anchors' gates / 64, decays near 1, so that errors
    are carried across many chunks."""
    q, k, v, g, beta, h0, scale = problem(rng, tokens, dim, "anchors" if case == "long memory" else case,
                                          strong_decay=-30.0)
    return q, k, v, g / 64 if case == "long memory" else g, beta, h0, scale


def errors(rng, tokens, dim, case):
    """Relative errors (o, final state) of each chain in bfloat16 against the float64 recurrence."""
    q, k, v, g, beta, h0, scale = draw(rng, tokens, dim, case)
    o_ref, ht_ref = recurrence(q, k, v, g, beta, h0, scale)
    runs = {"three products": three_product_chain(q, k, v, g, beta, h0, scale),
            "one product, R float32": one_product_chain(q, k, v, g, beta, h0, scale),
            "one product, R bf16": one_product_chain(q, k, v, g, beta, h0, scale, r_rounded=True)}
    return {name: (relative(o, o_ref), relative(ht, ht_ref)) for name, (o, ht) in runs.items()}


def gradient_errors(rng, tokens, dim, case):
    """Relative errors of dh0 by each backward chain in bfloat16 against the float64 recurrence's reverse."""
    q, k, v, g, beta, h0, scale = draw(rng, tokens, dim, case)
    do, dht = rng.standard_normal(v.shape), rng.standard_normal(h0.shape)
    dh0_ref = recurrence_backward(q, k, v, g, beta, h0, scale, do, dht)[-1]
    three, one = state_gradient_chains(q, k, v, g, beta, h0, scale, do, dht)
    return relative(three, dh0_ref), relative(one, dh0_ref)


def main():
    rng = np.random.default_rng(0)
    for dim, chunks in ((64, 32), (128, 64)):
        for case in ("anchors", "long memory", "strong decay", "beta at 0 and 1"):
            for name, (eo, eh) in errors(rng, 64 * chunks, dim, case).items():
                print(f"K = V = {dim:3d}, {chunks} chunks, {case:16s} {name:24s} o {eo:.2e}  final state {eh:.2e}")
            three, one = gradient_errors(rng, 64 * chunks, dim, case)
            print(f"K = V = {dim:3d}, {chunks} chunks, {case:16s} dh0: three products {three:.2e}, one product {one:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
