"""The segmented (intra-sequence parallel) state recurrence of the GDN forward, in float64 NumPy, checked
against the token-by-token recurrence: the design the cuda backend needs for few heads on long sequences
(bench/NOTES.md, "Next steps" 3), validated before any CUDA is written.

One chunk maps the state entering it to the state leaving it affinely (docs/gdn-algorithm.md section 3):
    S' = A_c S + B_c,   A_c = e^(g_L) I - K~^T W,   B_c = K~^T U,   K~ = diag(e^(g_L - g)) K
so a segment of chunks maps S_start to S_end = M S_start + R with (M, R) composed chunk by chunk.
    pass 1 (parallel over segments): (M_s, R_s) of every segment, from the chunks' W, U, K, g
    pass 2 (sequential over segments, short): S_(s+1) = M_s S_s + R_s
    pass 3 (parallel over segments): the ordinary fused forward of each segment from its true S_s
With n segments the dependent chain is (chunks / n) steps of pass 1 and 3 plus n steps of pass 2, instead of
`chunks` steps; pass 1 does about twice the work of an ordinary step (A_c M is K x K x K).

Run: python3 bench/prototypes/segmented_state.py   (prints the relative errors; exits 1 above 1e-12)
"""
import sys

import numpy as np

C = 64  # tokens per chunk


def recurrence(q, k, v, g, beta, h0, scale):
    """Token by token: S = e^g S + k beta (v - S^T k)^T ... in the [K, V] layout of fla."""
    S = h0.copy()
    o = np.zeros_like(v)
    for t in range(len(q)):
        S = np.exp(g[t]) * S
        S = S + np.outer(k[t], beta[t] * (v[t] - S.T @ k[t]))
        o[t] = scale * S.T @ q[t]
    return o, S


def chunk_terms(k, v, g, beta):
    """Per chunk: gamma, W, U, K~ and the chunk's decay (the WY/UT transform)."""
    terms = []
    for c0 in range(0, len(k), C):
        K, Vc, gam = k[c0:c0 + C], v[c0:c0 + C], np.cumsum(g[c0:c0 + C])
        L = len(K)
        decay = np.tril(np.exp(gam[:, None] - gam[None, :]))
        A = np.tril(beta[c0:c0 + C, None] * (K @ K.T) * decay, -1)
        T = np.linalg.inv(np.eye(L) + A)
        W = T @ ((beta[c0:c0 + C] * np.exp(gam))[:, None] * K)
        U = T @ (beta[c0:c0 + C, None] * Vc)
        K_tilde = np.exp(gam[-1] - gam)[:, None] * K
        terms.append((c0, gam, W, U, K_tilde, np.exp(gam[-1])))
    return terms


def forward_from(state, terms, q, k, scale):
    """The ordinary chunked forward over `terms` from `state`: outputs by chunk start, final state."""
    out = {}
    for c0, gam, W, U, K_tilde, last in terms:
        Q, K = q[c0:c0 + len(gam)], k[c0:c0 + len(gam)]
        delta = U - W @ state
        P = scale * np.tril(Q @ K.T * np.exp(gam[:, None] - gam[None, :]))
        out[c0] = scale * np.exp(gam)[:, None] * (Q @ state) + P @ delta
        state = last * state + K_tilde.T @ delta
    return out, state


def segmented(q, k, v, g, beta, h0, scale, segments):
    terms = chunk_terms(k, v, g, beta)
    bounds = np.linspace(0, len(terms), segments + 1).astype(int)
    dim = k.shape[1]
    # pass 1: each segment's affine map, composed chunk by chunk
    maps = []
    for s in range(segments):
        M, R = np.eye(dim), np.zeros((dim, v.shape[1]))
        for _, _, W, U, K_tilde, last in terms[bounds[s]:bounds[s + 1]]:
            M = last * M - K_tilde.T @ (W @ M)
            R = last * R + K_tilde.T @ (U - W @ R)
        maps.append((M, R))
    # pass 2: the true state entering each segment
    starts = [h0]
    for M, R in maps:
        starts.append(M @ starts[-1] + R)
    # pass 3: each segment from its true start
    o = np.zeros_like(v)
    for s in range(segments):
        out, _ = forward_from(starts[s], terms[bounds[s]:bounds[s + 1]], q, k, scale)
        for c0, block in out.items():
            o[c0:c0 + len(block)] = block
    return o, starts[-1]


def problem(rng, tokens, dim, case="anchors", strong_decay=-1e4):
    """A random GDN problem: unit q and k rows, the anchors' gates (logsigmoid / 16), sigmoid betas, a random h0;
    `case` changes a twentieth of the tokens: "strong decay" (gates of strong_decay), "-inf gates", or "beta at 0
    and 1". Returns q, k, v, g, beta, h0, scale."""
    q = rng.standard_normal((tokens, dim))
    k = rng.standard_normal((tokens, dim))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    v = rng.standard_normal((tokens, dim))
    g = -np.log1p(np.exp(-rng.standard_normal(tokens))) / 16
    beta = 1 / (1 + np.exp(-rng.standard_normal(tokens)))
    cut = rng.choice(tokens, size=max(2, tokens // 20), replace=False)
    if case == "strong decay":
        g[cut] = strong_decay
    elif case == "-inf gates":
        g[cut] = -np.inf
    elif case == "beta at 0 and 1":
        beta[cut[: len(cut) // 2]] = 0.0
        beta[cut[len(cut) // 2:]] = 1.0
    h0 = rng.standard_normal((dim, dim))
    return q, k, v, g, beta, h0, dim ** -0.5


def main():
    rng = np.random.default_rng(0)
    q, k, v, g, beta, h0, scale = problem(rng, 64 * 23 + 17, 32)  # a partial last chunk
    o_ref, ht_ref = recurrence(q, k, v, g, beta, h0, scale)
    worst = 0.0
    for segments in (1, 2, 5, 24):
        o, ht = segmented(q, k, v, g, beta, h0, scale, segments)
        errors = [np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in ((o, o_ref), (ht, ht_ref))]
        print(f"{segments:2d} segments: o {errors[0]:.2e}, final state {errors[1]:.2e}")
        worst = max(worst, *errors)
    return 0 if worst < 1e-12 else 1


if __name__ == "__main__":
    sys.exit(main())
