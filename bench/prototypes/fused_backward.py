"""The planned fused backward of the cuda backend (bench/NOTES.md, GDN "Next steps" 9 and 11), in float64 NumPy,
checked against the gradients of the token-by-token recurrence before any CUDA is written.

The design FlashQLA's Hopper backward follows, with our gate-free inverse (gate_free_forward.py):
    pass 1 (parallel over heads, sequential over chunks): the state S_c entering each chunk, into memory
    pass 2 (one fused kernel, reverse over chunks): per chunk, from Q, K, V, g, beta, Tu, S_c, dO and the state
            gradient dS' leaving the chunk (held in registers across the loop), every input gradient and dS
            entering it.
Per chunk (n tokens, gamma the gates' prefix sums, E = e^gamma, Gamma_ij = e^(gamma_i - gamma_j) for i >= j,
D_i = e^(gamma_n - gamma_i)), the forward it differentiates is
    T = Gamma .* Tu,  corr = V - diag(E) K S,  Delta = T diag(beta) corr,  P = lower(Q K^T) .* Gamma
    O = scale (diag(E) Q S + P Delta),  S' = E_n S + K^T diag(D) Delta
and its reverse is, with dcorr = diag(beta) T^T dDelta,
    dDelta = scale P^T dO + diag(D) K dS'
    dS = E_n dS' + scale Q^T diag(E) dO - K^T diag(E) dcorr
so the chain from dS' to dS is three dependent products (K dS', T^T . , K^T .), as the forward's is; everything else
(dQ, dK, dV, dbeta, the gates' gradients) hangs off it. The gates' gradient is formed per chunk as the gradient of
gamma and then reverse-summed within the chunk, which needs no other chunk.

The reference: the recurrence's reverse by hand, itself checked against central differences on a small case.
Cases: the anchors' gates, strong decay (-30), beta at 0 and 1, a partial last chunk, a nonzero initial state.

Run: python3 bench/prototypes/fused_backward.py   (prints the relative errors; exits 1 above 1e-10)
"""
import sys

import numpy as np

from gate_free_forward import between
from segmented_state import C, problem, recurrence


def recurrence_backward(q, k, v, g, beta, h0, scale, do, dht):
    """The token recurrence's gradients by reverse mode: S_a = e^g S; u = S_a^T k; r = beta (v - u);
    S = S_a + k r^T; o = scale S^T q."""
    states = [h0]
    for t in range(len(q)):
        S_a = np.exp(g[t]) * states[-1]
        states.append(S_a + np.outer(k[t], beta[t] * (v[t] - S_a.T @ k[t])))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dg, dbeta = np.zeros_like(g), np.zeros_like(beta)
    dS = dht.copy()
    for t in reversed(range(len(q))):
        S_a = np.exp(g[t]) * states[t]
        u = S_a.T @ k[t]
        r = beta[t] * (v[t] - u)
        dq[t] = scale * states[t + 1] @ do[t]
        dS = dS + scale * np.outer(q[t], do[t])
        dk[t] += dS @ r
        dr = dS.T @ k[t]
        dbeta[t] = dr @ (v[t] - u)
        dv[t] = beta[t] * dr
        du = -beta[t] * dr
        dS_a = dS + np.outer(k[t], du)
        dk[t] += S_a @ du
        dg[t] = np.sum(dS_a * S_a)
        dS = np.exp(g[t]) * dS_a
    return dq, dk, dv, dg, dbeta, dS


def chunk_forward_terms(Q, K, V, gates, b, S):
    """One chunk's forward quantities from the state entering it (the form the fused kernels use)."""
    n = len(Q)
    log_gamma = between(gates)
    Gamma = np.exp(log_gamma)
    E = np.exp(np.cumsum(gates))
    D = np.exp(log_gamma[n - 1])
    Tu = np.linalg.inv(np.eye(n) + np.tril(b[:, None] * (K @ K.T), -1))
    T = Gamma * Tu
    KS = K @ S
    corr = V - E[:, None] * KS
    delta = T @ (b[:, None] * corr)
    QK = np.tril(Q @ K.T)
    return dict(Gamma=Gamma, E=E, D=D, Tu=Tu, T=T, KS=KS, corr=corr, delta=delta, QK=QK, P=QK * Gamma)


def recompute_pass(q, k, v, g, beta, h0):
    """Pass 1, forward over chunks: per chunk, its first token, the state S entering it and its forward terms."""
    chunks, S = [], h0.copy()
    for c0 in range(0, len(q), C):
        f = chunk_forward_terms(q[c0:c0 + C], k[c0:c0 + C], v[c0:c0 + C], g[c0:c0 + C], beta[c0:c0 + C], S)
        chunks.append((c0, S, f))
        S = f["E"][-1] * S + k[c0:c0 + C].T @ (f["D"][:, None] * f["delta"])
    return chunks


def reverse_over_chunks(q, k, v, g, beta, h0, dht, chunk_backward):
    """Pass 2's walk, last chunk to first with dS carried: chunk_backward(c0, S, f, dS') gives the chunk's dq, dk, dv,
    dbeta, d gamma (the gradient of the gates' prefix sums, reverse-summed here within the chunk) and dS entering it.
    Returns dq, dk, dv, dg, dbeta, dh0."""
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dg, dbeta = np.zeros_like(g), np.zeros_like(beta)
    dS_next = dht.copy()
    for c0, S, f in reversed(recompute_pass(q, k, v, g, beta, h0)):
        dQ, dK, dV, db, d_gamma, dS_next = chunk_backward(c0, S, f, dS_next)
        n = len(dQ)
        dq[c0:c0 + n], dk[c0:c0 + n], dv[c0:c0 + n], dbeta[c0:c0 + n] = dQ, dK, dV, db
        dg[c0:c0 + n] = np.cumsum(d_gamma[::-1])[::-1]
    return dq, dk, dv, dg, dbeta, dS_next


def fused_backward(q, k, v, g, beta, h0, scale, do, dht):
    def chunk_backward(c0, S, f, dS_next):
        Q, K, b, dO = (x[c0:c0 + C] for x in (q, k, beta, do))
        n = len(Q)
        E, D, Gamma, T, Tu, delta, corr, KS = (f[x] for x in ("E", "D", "Gamma", "T", "Tu", "delta", "corr", "KS"))
        # the chain: K dS', then T^T, then K^T
        KdS = K @ dS_next
        d_delta = scale * f["P"].T @ dO + D[:, None] * KdS
        d_corr = b[:, None] * (T.T @ d_delta)
        dS = E[-1] * dS_next + scale * Q.T @ (E[:, None] * dO) - K.T @ (E[:, None] * d_corr)
        # off the chain
        dV = d_corr
        dT = d_delta @ (b[:, None] * corr).T                  # Delta = T (diag(beta) corr)
        db = np.sum(corr * (T.T @ d_delta), axis=1)
        dP = scale * dO @ delta.T
        dQK = np.tril(dP * Gamma)                             # P = lower(Q K^T) .* Gamma
        dQ = scale * E[:, None] * (dO @ S.T) + dQK @ K
        dK = dQK.T @ Q
        dK += -(E[:, None] * d_corr) @ S.T                    # corr = V - diag(E) K S
        dK += D[:, None] * (delta @ dS_next.T)                # S' = ... + K^T diag(D) Delta
        dTu = dT * Gamma                                      # T = Gamma .* Tu
        dA = np.tril(-Tu.T @ dTu @ Tu.T, -1)                  # Tu = (I + A)^-1, A strictly lower
        KK = K @ K.T
        db += np.sum(dA * KK, axis=1)                         # A = lower(diag(beta) K K^T, -1)
        dKK = b[:, None] * dA
        dK += dKK @ K + dKK.T @ K
        # the gates: d gamma from E, Gamma, D and E_n (reverse_over_chunks sums it within the chunk)
        d_gamma = E * (scale * np.sum((Q @ S) * dO, axis=1) - np.sum(d_corr * KS, axis=1))
        dGamma = np.tril(dT * Tu + dP * f["QK"]) * Gamma
        d_gamma += dGamma.sum(axis=1) - dGamma.sum(axis=0)
        dD = D * np.sum(KdS * delta, axis=1)
        d_gamma -= dD
        d_gamma[n - 1] += dD.sum() + E[-1] * np.sum(S * dS_next)
        return dQ, dK, dV, db, d_gamma, dS

    return reverse_over_chunks(q, k, v, g, beta, h0, dht, chunk_backward)


def check_reference(rng):
    """recurrence_backward against central differences of L = sum(do .* o) + sum(dht .* ht) on a small case."""
    q, k, v, g, beta, h0, scale = problem(rng, 7, 3)
    do, dht = rng.standard_normal(v.shape), rng.standard_normal(h0.shape)

    def loss(q, k, v, g, beta, h0):
        o, ht = recurrence(q, k, v, g, beta, h0, scale)
        return np.sum(do * o) + np.sum(dht * ht)

    inputs = [q, k, v, g, beta, h0]
    analytic = recurrence_backward(q, k, v, g, beta, h0, scale, do, dht)
    worst, eps = 0.0, 1e-6
    for which, grad in enumerate(analytic):
        numeric = np.zeros_like(inputs[which])
        for i in np.ndindex(inputs[which].shape):
            plus = [x.copy() for x in inputs]
            minus = [x.copy() for x in inputs]
            plus[which][i] += eps
            minus[which][i] -= eps
            numeric[i] = (loss(*plus) - loss(*minus)) / (2 * eps)
        worst = max(worst, np.linalg.norm(grad - numeric) / np.linalg.norm(numeric))
    print(f"reference against central differences: {worst:.2e}")
    return worst


def worst_against_reverse(backward, rng, tokens, width):
    """`backward(q, k, v, g, beta, h0, scale, do, dht)` against the recurrence's reverse on the three cases (tokens
    chosen to end in a partial chunk); prints each case's errors and returns the largest."""
    worst = 0.0
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    for case in ("anchors", "strong decay", "beta at 0 and 1"):
        q, k, v, g, beta, h0, scale = problem(rng, tokens, width, case, strong_decay=-30.0)
        do, dht = rng.standard_normal(v.shape), rng.standard_normal(h0.shape)
        expected = recurrence_backward(q, k, v, g, beta, h0, scale, do, dht)
        got = backward(q, k, v, g, beta, h0, scale, do, dht)
        errors = [np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(got, expected)]
        print(f"{case:16s}: " + ", ".join(f"{n} {e:.2e}" for n, e in zip(names, errors)))
        worst = max(worst, *errors)
    return worst


def main():
    rng = np.random.default_rng(0)
    worst_reference = check_reference(rng)
    worst = worst_against_reverse(fused_backward, rng, 64 * 5 + 23, 32)
    return 0 if worst < 1e-10 and worst_reference < 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
