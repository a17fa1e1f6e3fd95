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

The single walk (`single_walk`, bench/NOTES.md "Where to start (session 36)", item 4) reaches the same outputs with
one pass over each segment instead of two: the state is affine in the segment's start, S_t = S0_t + Phi_t S_start,
so every later segment walks from a zero start (S0, O0) beside its transition Phi_t (the same walk on zero values
from the identity, whose outputs are scale Phi_t^T q_t), pass 2 composes the starts from (Phi_end, S0_end), and
o_t = O0_t + (scale Phi_t^T q_t)^T S_start is one product off the chain.

Run: python3 bench/prototypes/segmented_state.py   (prints the relative errors, then the single walk's rounding in
bf16 against the output's own; exits 1 where a float64 error is above 1e-12)
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


def forward_from(state, terms, q, k, scale, operand=lambda x: x):
    """The ordinary chunked forward over `terms` from `state`: outputs by chunk start, final state. `operand` is
    applied to the state where a product reads it (bf16 rounding, as the kernels' products take it)."""
    out = {}
    for c0, gam, W, U, K_tilde, last in terms:
        Q, K = q[c0:c0 + len(gam)], k[c0:c0 + len(gam)]
        delta = U - W @ operand(state)
        P = scale * np.tril(Q @ K.T * np.exp(gam[:, None] - gam[None, :]))
        out[c0] = scale * np.exp(gam)[:, None] * (Q @ operand(state)) + P @ delta
        state = last * state + K_tilde.T @ delta
    return out, state


def segment_map(terms, key_dim, value_dim, operand=lambda x: x):
    """A run of chunks' affine map (M, R): its end state is M S_start + R, composed chunk by chunk (`operand` applied
    where a product reads M or R)."""
    M, R = np.eye(key_dim), np.zeros((key_dim, value_dim))
    for _, _, W, U, K_tilde, last in terms:
        M = last * M - K_tilde.T @ (W @ operand(M))
        R = last * R + K_tilde.T @ (U - W @ operand(R))
    return M, R


def segmented(q, k, v, g, beta, h0, scale, segments, operand=lambda x: x):
    """The three passes above. `operand` is applied where a product reads a state, M or a start (bf16 rounding, as
    the kernels' products take them)."""
    terms = chunk_terms(k, v, g, beta)
    bounds = np.linspace(0, len(terms), segments + 1).astype(int)
    dim = k.shape[1]
    # pass 1: each segment's affine map, composed chunk by chunk
    maps = [segment_map(terms[bounds[s]:bounds[s + 1]], dim, v.shape[1], operand) for s in range(segments)]
    # pass 2: the true state entering each segment
    starts = [h0]
    for M, R in maps:
        starts.append(operand(M) @ operand(starts[-1]) + R)
    # pass 3: each segment from its true start
    o = np.zeros_like(v)
    for s in range(segments):
        out, _ = forward_from(starts[s], terms[bounds[s]:bounds[s + 1]], q, k, scale, operand)
        for c0, block in out.items():
            o[c0:c0 + len(block)] = block
    return o, starts[-1]


def single_walk(q, k, v, g, beta, h0, scale, segments, operand=lambda x: x):
    """The segmented forward in one walk of each segment: the first from h0, every later one from a zero start beside
    its transition, the starts composed in order, each later segment's outputs corrected by one product. `operand`
    is applied where a product reads a state, a transition or a start, and to both factors of the correcting product
    (bf16 rounding, as the kernels' products take them)."""
    terms = chunk_terms(k, v, g, beta)
    # The walk of Phi: the same chunks with zero values (U = 0), K columns wide.
    transition_terms = [(c0, gam, W, np.zeros((len(gam), k.shape[1])), K_tilde, last)
                        for c0, gam, W, _, K_tilde, last in terms]
    bounds = np.linspace(0, len(terms), segments + 1).astype(int)
    o = np.zeros_like(v)
    start = h0
    for s in range(segments):
        part = slice(bounds[s], bounds[s + 1])
        if s == 0:
            out, start = forward_from(h0, terms[part], q, k, scale, operand)
            for c0, block in out.items():
                o[c0:c0 + len(block)] = block
            continue
        out0, end0 = forward_from(np.zeros_like(h0), terms[part], q, k, scale, operand)
        transported, transition = forward_from(np.eye(k.shape[1]), transition_terms[part], q, k, scale, operand)
        for c0, block in out0.items():
            o[c0:c0 + len(block)] = block + operand(transported[c0]) @ operand(start)
        start = operand(transition) @ operand(start) + end0
    return o, start


def bf16(x):
    """x rounded to the nearest bfloat16 (ties to even), returned as float64."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32).astype(np.float64)


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
        o, ht = single_walk(q, k, v, g, beta, h0, scale, segments)
        errors = [np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in ((o, o_ref), (ht, ht_ref))]
        print(f"{segments:2d} segments in one walk: o {errors[0]:.2e}, final state {errors[1]:.2e}")
        worst = max(worst, *errors)
    # Rounding, emulated: every product reads the state in bf16, as the kernels' do (the two walks alike), and the
    # single walk's correcting product reads Phi^T q and the start in bf16 (O0 in float32, the sum rounded once); the
    # output is rounded to bf16 in both. Against today's two-pass form and the exact output's own rounding.
    # With the anchors' gates a segment forgets its start within a few chunks, so the correction is small; with gates
    # near 1 and small betas ("slow forgetting") it carries most of each segment's output.
    q, k, v, g, beta, h0, scale = problem(rng, 64 * 16, 64)
    for case, gates, betas in (("anchors' gates", g, beta), ("slow forgetting", np.full_like(g, -1e-4), beta / 20)):
        o_ref, _ = recurrence(q, k, v, gates, betas, h0, scale)
        error = lambda o: np.linalg.norm(bf16(o) - o_ref) / np.linalg.norm(o_ref)  # noqa: E731
        for segments in (2, 4):
            walk = error(single_walk(q, k, v, gates, betas, h0, scale, segments, operand=bf16)[0])
            today = error(segmented(q, k, v, gates, betas, h0, scale, segments, operand=bf16)[0])
            print(f"bf16, {case}, {segments} segments: o {walk:.2e} in one walk, {today:.2e} in two passes, "
                  f"{error(o_ref):.2e} the output's own rounding")
    return 0 if worst < 1e-12 else 1


if __name__ == "__main__":
    sys.exit(main())
