"""The planned fused forward of the cuda backend (bench/NOTES.md, "Next steps" 10 and 11), in float64 NumPy,
checked against the token-by-token recurrence before any CUDA is written:

1. Gate-free inverse. prepare stores only Tu = (I + strict_lower(diag(beta) K K^T))^-1 per chunk. The gated
   inverse T = (I + strict_lower(diag(beta) (K K^T .* Gamma)))^-1 is Gamma .* Tu, Gamma_ij = e^(gamma_i - gamma_j)
   (i >= j): (I + D A D^-1)^-1 = D (I + A)^-1 D^-1 with D = diag(e^gamma). With a gate of -inf (or one whose decay
   underflows) D is singular, but the identity still holds entrywise: Gamma is then zero across the cut, and the
   trailing diagonal block of a lower-triangular inverse is the inverse of the trailing block. So Gamma is formed
   from the gates between the two tokens (never as a difference of cumulative sums, which is -inf - -inf there),
   as the cpu backend does.
2. A two-product chain. With Y = K^T diag(D) T diag(beta) (D_i = e^(gamma_last - gamma_i)), which does not depend
   on the state, a chunk's state update is S' = E_last S + Y (V - diag(E) K S) (E_i = e^(gamma_i)): two dependent
   products per chunk (K S, then Y times the correction) where the pseudo-value form has three (K S, T times the
   correction, K^T diag(D) Delta). The output O = scale (diag(E) Q S + (lower(Q K^T) .* Gamma) Delta), Delta =
   T diag(beta) (V - diag(E) K S), leaves the chain: it needs the chain's K S but nothing after.

Cases: the anchors' gates (logsigmoid / 16), strong decay (-1e4), gates of -inf, beta at 0 and 1, a partial last
chunk. Also prints the largest |Tu| entry seen: what a bf16 Tu must hold.

Run: python3 bench/prototypes/gate_free_forward.py   (prints the relative errors; exits 1 above 1e-12)
"""
import sys

import numpy as np

from segmented_state import C, problem, recurrence


def between(g):
    """log Gamma_ij = sum of g over (j, i] for i >= j (0 on the diagonal), -inf above it; summed, never
    differenced, so a -inf gate gives -inf across it and not NaN."""
    n = len(g)
    out = np.full((n, n), -np.inf)
    for i in range(n):
        out[i, i] = 0.0
        for j in range(i - 1, -1, -1):
            out[i, j] = out[i, j + 1] + g[j + 1]
    return out


def gate_free_forward(q, k, v, g, beta, h0, scale):
    S, o, largest_tu = h0.copy(), np.zeros_like(v), 0.0
    for c0 in range(0, len(q), C):
        Q, K, V = q[c0:c0 + C], k[c0:c0 + C], v[c0:c0 + C]
        b, gates = beta[c0:c0 + C], g[c0:c0 + C]
        n = len(Q)
        log_gamma = between(gates)                        # Gamma within the chunk
        gamma_from_start = np.cumsum(gates)               # E_i = e^(g_0 + ... + g_i): a prefix, no difference
        E = np.exp(gamma_from_start)
        D = np.exp(log_gamma[n - 1])                      # D_i = Gamma_(last, i)
        Gamma = np.exp(log_gamma)
        # prepare: the gate-free inverse only
        Tu = np.linalg.inv(np.eye(n) + np.tril(b[:, None] * (K @ K.T), -1))
        largest_tu = max(largest_tu, np.abs(Tu).max())
        # the state pass: the gated inverse and the chain's constant, formed off the chain
        T = Gamma * Tu
        Y = K.T @ (D[:, None] * T * b[None, :])
        # the chain: K S, then the correction through Y
        KS = K @ S
        correction = V - E[:, None] * KS
        S_next = E[-1] * S + Y @ correction
        # beside it: the output
        delta = T @ (b[:, None] * correction)
        o[c0:c0 + n] = scale * (E[:, None] * (Q @ S) + (np.tril(Q @ K.T) * Gamma) @ delta)
        S = S_next
    return o, S, largest_tu


def pseudo_value_T(K, gates, b):
    """The gated inverse as the current kernels form it, for the identity check."""
    n = len(K)
    return np.linalg.inv(np.eye(n) + np.tril(b[:, None] * (K @ K.T) * np.exp(between(gates)), -1))


def main():
    rng = np.random.default_rng(0)
    tokens, dim = 64 * 9 + 23, 32  # a partial last chunk
    worst, largest_tu = 0.0, 0.0
    for case in ("anchors", "strong decay", "-inf gates", "beta at 0 and 1"):
        q, k, v, g, beta, h0, scale = problem(rng, tokens, dim, case)
        o_ref, ht_ref = recurrence(q, k, v, g, beta, h0, scale)
        o, ht, tu = gate_free_forward(q, k, v, g, beta, h0, scale)
        largest_tu = max(largest_tu, tu)
        identity = max(np.abs(np.exp(between(g[c0:c0 + C])) *
                              np.linalg.inv(np.eye(len(k[c0:c0 + C])) + np.tril(beta[c0:c0 + C, None] *
                                                                               (k[c0:c0 + C] @ k[c0:c0 + C].T), -1)) -
                              pseudo_value_T(k[c0:c0 + C], g[c0:c0 + C], beta[c0:c0 + C])).max()
                       for c0 in range(0, tokens, C))
        errors = [np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in ((o, o_ref), (ht, ht_ref))]
        print(f"{case:16s}: o {errors[0]:.2e}, final state {errors[1]:.2e}, |Gamma .* Tu - T| max {identity:.2e}")
        worst = max(worst, *errors, identity)
    print(f"largest |Tu| entry: {largest_tu:.3g}")
    return 0 if worst < 1e-12 else 1


if __name__ == "__main__":
    sys.exit(main())
