"""Segment starts by a bounded warm-up, in float64 NumPy, checked against the token-by-token recurrence: a design
for the segmented passes (bench/NOTES.md, "Segment starts by a bounded warm-up") validated before any CUDA is written.

Today a segmented pass finds the state entering segment s exactly: the segment ends pass walks every chunk of each
segment but the last twice over (its end state R from a zero start and its transition M, K x K), and
segment_starts_kernel composes S_(s+1) = M_s S_s + R_s in order. FlashQLA instead warms each segment up over the
previous one's last chunks from a zero start and stops once their summed gates fall below -10, an approximation it
does not bound.

The bound. A token's transition of the state is A_t = e^(g_t) (I - beta_t k_t k_t^T): symmetric, with eigenvalues
e^(g_t) (K - 1 times) and e^(g_t) (1 - beta_t |k_t|^2), so its spectral norm is exactly
    e^(g_t) max(1, |1 - beta_t |k_t|^2|)        (= e^(g_t) for unit keys and beta in [0, 1]).
A run of tokens j..b-1 maps the state entering it affinely, S_b = A_(j,b) S_j + R_(j,b), with A_(j,b) the product of
its tokens' transitions, so |A_(j,b)| <= e^(B(j,b)), B the sum of the log norms above. Walking the run from a zero
start gives R_(j,b), and its distance from the true S_b is |A_(j,b) S_j| <= e^(B(j,b)) |S_j|. Where B over whole chunks
before a segment falls below THRESHOLD = ln(2^-24), the warm-up's start is the true start to within float32's unit
roundoff of the state it forgot: below the rounding the kernels' own products already make (they read states and M
in bf16, 2^-9). Where it does not within `max_chunks` (gates near 0: long memory), that segment keeps today's exact
composition from the previous segment's start. Gates of -inf give a bound of -inf: a warm-up of one chunk, exact.

The backward mirrors it: the gradient entering a segment is the reverse walk of its first chunks from zero wherever
those chunks' bounds sum to the threshold (A_t is symmetric, so the reverse map has the same norm);
`reverse_start_errors` checks that bound too.

What a warm-up saves: it walks only the state (no M, no output) over as few chunks as the gates need, where the ends
pass walks the state and M over whole segments, and a segment whose start comes from a warm-up needs no previous
segment's start. `warmup_lengths` counts the chunks per segment for gates like the anchors' (logsigmoid(randn) / 16:
about -3.2 a chunk, so ~6 chunks) and like a Qwen3.5 layer at initialisation (-exp(A_log) softplus(a + dt_bias)).

Run: python3 bench/prototypes/bounded_warmup.py   (prints errors, bounds and warm-up lengths; exits 1 where an error
is above its bound)
"""
import sys

import numpy as np

from segmented_state import C, bf16, chunk_terms, forward_from, problem, recurrence, segment_map

THRESHOLD = np.log(2.0 ** -24)  # float32's unit roundoff, as a log of the forgotten state's weight
FLASHQLA_THRESHOLD = -10.0  # its warm-up's stop: summed gates below -10 (no key term)


def transition_log_norms(k, g, beta):
    """log |A_t|_2 per token: g_t + log max(1, |1 - beta_t |k_t|^2|)."""
    stretch = np.abs(1.0 - beta * np.einsum("td,td->t", k, k))
    return g + np.log(np.maximum(1.0, stretch))


def chunk_log_norms(log_norms):
    """The bound's log summed per chunk (a partial last chunk included)."""
    return np.array([log_norms[c0:c0 + C].sum() for c0 in range(0, len(log_norms), C)])


def warmup_first_chunk(per_chunk, boundary, threshold, max_chunks):
    """The latest chunk j >= boundary - max_chunks whose chunks j..boundary-1 sum to threshold or less, or None."""
    total = 0.0
    for j in range(boundary - 1, max(boundary - max_chunks, 0) - 1, -1):
        total += per_chunk[j]
        if total <= threshold:
            return j
    return None


def bounded_segmented(q, k, v, g, beta, h0, scale, segments, threshold=THRESHOLD, max_chunks=None,
                      operand=lambda x: x):
    """The segmented forward with each start from a bounded warm-up where the gates allow, else composed exactly from
    the previous start (segmented_state.segmented's passes 1 and 2 for that segment alone). `operand` is applied where
    a product reads a state or M (bf16 rounding, as the kernels' products take them). Returns o, the final state, the
    segments' starts, their first chunks and, per segment after the first, its warm-up's first chunk (None: composed)."""
    terms = chunk_terms(k, v, g, beta)
    per_chunk = chunk_log_norms(transition_log_norms(k, g, beta))
    bounds = np.linspace(0, len(terms), segments + 1).astype(int)
    starts, firsts = [h0], []
    for s in range(1, segments):
        limit = bounds[s] - bounds[s - 1] if max_chunks is None else max_chunks
        j = warmup_first_chunk(per_chunk, bounds[s], threshold, limit)
        if j is not None:
            start = forward_from(np.zeros_like(h0), terms[j:bounds[s]], q, k, scale, operand)[1]
        else:
            M, R = segment_map(terms[bounds[s - 1]:bounds[s]], k.shape[1], v.shape[1], operand)
            start = operand(M) @ operand(starts[-1]) + R
        starts.append(start)
        firsts.append(j)
    o = np.zeros_like(v)
    final = None
    for s in range(segments):
        out, final = forward_from(starts[s], terms[bounds[s]:bounds[s + 1]], q, k, scale, operand)
        for c0, block in out.items():
            o[c0:c0 + len(block)] = block
    return o, final, starts, bounds, firsts


def start_errors(q, k, v, g, beta, h0, scale, segments):
    """Per segment after the first: (warm-up chunks or None, the start's distance from the true state entering it,
    the bound e^B |S_j| or None), in float64."""
    _, _, starts, bounds, firsts = bounded_segmented(q, k, v, g, beta, h0, scale, segments)
    terms = chunk_terms(k, v, g, beta)
    per_chunk = chunk_log_norms(transition_log_norms(k, g, beta))
    true_start = lambda chunk: forward_from(h0, terms[:chunk], q, k, scale)[1]  # noqa: E731
    rows = []
    for s, j in enumerate(firsts, start=1):
        error = np.linalg.norm(starts[s] - true_start(bounds[s]))
        if j is None:
            rows.append((None, error, None))
        else:
            rows.append((bounds[s] - j, error, np.exp(per_chunk[j:bounds[s]].sum()) * np.linalg.norm(true_start(j))))
    return rows


def state_gradients(q, k, g, beta, scale, do, dht, start, stop, dS=None):
    """The gradient of the loss by the state entering token `start`, walking tokens stop-1..start in reverse from
    `dS` at `stop` (dht at the sequence's end; zero for a warm-up): dS <- A_t (dS + scale q_t do_t^T), A_t symmetric
    (fused_backward.recurrence_backward's chain of dS alone)."""
    dS = np.zeros_like(dht) if dS is None else dS.copy()
    for t in reversed(range(start, stop)):
        dS = dS + scale * np.outer(q[t], do[t])
        dS = np.exp(g[t]) * (dS - beta[t] * np.outer(k[t], k[t] @ dS))
    return dS


def reverse_start_errors(q, k, g, beta, scale, do, dht, segments):
    """The backward's segments, mirrored: per segment but the last, the gradient entering its first token from a
    warm-up over its first chunks (their bounds summed from the first chunk on, the same rule as the forward's) against
    the exact one. Per segment: (warm-up chunks or None, the error, the bound e^B |dS_j| or None)."""
    per_chunk = chunk_log_norms(transition_log_norms(k, g, beta))
    bounds = np.linspace(0, len(per_chunk), segments + 1).astype(int)
    tokens = len(q)
    rows = []
    for s in range(segments - 1):
        first, end = bounds[s], bounds[s + 1]
        exact = state_gradients(q, k, g, beta, scale, do, dht, first * C, tokens, dht)
        reversed_first = warmup_first_chunk(per_chunk[first:end][::-1], end - first, THRESHOLD, end - first)
        if reversed_first is None:
            rows.append((None, 0.0, None))
            continue
        stop = end - reversed_first  # the warm-up walks chunks first..stop-1 in reverse from zero at stop
        warm = state_gradients(q, k, g, beta, scale, do, dht, first * C, min(stop * C, tokens))
        true_at_stop = state_gradients(q, k, g, beta, scale, do, dht, min(stop * C, tokens), tokens, dht)
        bound = np.exp(per_chunk[first:stop].sum()) * np.linalg.norm(true_at_stop)
        rows.append((stop - first, np.linalg.norm(warm - exact), bound))
    return rows


def qwen_gates(rng, tokens, heads):
    """Gates of a Qwen3.5 GDN layer at initialisation (reference/model.md): g = -exp(A_log) softplus(a + dt_bias),
    A_log = log U(0, 16) per head, dt_bias = 1, a ~ N(0, 1) per token and head."""
    decay = rng.uniform(0.0, 16.0, heads)
    a = rng.standard_normal((tokens, heads))
    return -decay * np.log1p(np.exp(a + 1.0))


def warmup_lengths(per_token_gates, segment_chunks, threshold):
    """Warm-up chunks per (head, segment boundary) for unit keys (the bound is the gates alone), None where a
    segment's gates do not reach the threshold (composed exactly)."""
    tokens, heads = per_token_gates.shape
    lengths = []
    for h in range(heads):
        per_chunk = chunk_log_norms(per_token_gates[:, h])
        for boundary in range(segment_chunks, len(per_chunk), segment_chunks):
            j = warmup_first_chunk(per_chunk, boundary, threshold, segment_chunks)
            lengths.append(None if j is None else boundary - j)
    return lengths


def summary(lengths):
    found = [n for n in lengths if n is not None]
    kept = len(lengths) - len(found)
    if not found:
        return f"every one of {len(lengths)} composed exactly"
    return (f"median {np.median(found):.0f}, max {max(found)} chunks; {kept} of {len(lengths)} composed exactly")


def main():
    rng = np.random.default_rng(0)
    worst = 0.0  # the largest start error over its bound
    dim = 32
    # (Gates of -inf are left out: segmented_state's chunk terms form gate differences from prefix sums.)
    for case, key_norm in (("anchors", 1.0), ("strong decay", 1.0), ("beta at 0 and 1", 1.0), ("anchors", 1.2),
                           ("anchors", 2.0)):
        q, k, v, g, beta, h0, scale = problem(rng, 64 * 40 + 17, dim, case, strong_decay=-30.0)
        k = k * key_norm
        o_ref, ht_ref = recurrence(q, k, v, g, beta, h0, scale)
        o, ht, _, _, _ = bounded_segmented(q, k, v, g, beta, h0, scale, 5)
        label = case if key_norm == 1.0 else f"{case}, |k| = {key_norm:g}"
        print(f"{label}: o {relative(o, o_ref):.1e}, final state {relative(ht, ht_ref):.1e}")
        for chunks, error, bound in start_errors(q, k, v, g, beta, h0, scale, 5):
            if chunks is None:
                print(f"  start composed exactly, error {error:.1e}")
            else:
                print(f"  warm-up of {chunks:2d} chunks: start error {error:.1e} <= bound {bound:.1e}")
                worst = max(worst, error / bound)
    # Long memory: gates near 0 reach no threshold within a segment, so every start is composed exactly.
    q, k, v, g, beta, h0, scale = problem(rng, 64 * 20, dim)
    o_ref, _ = recurrence(q, k, v, g / 64, beta, h0, scale)
    o, _, _, _, firsts = bounded_segmented(q, k, v, g / 64, beta, h0, scale, 4)
    print(f"long memory: o {relative(o, o_ref):.1e}, starts composed exactly: {firsts.count(None)} of {len(firsts)}")
    # In bf16 (every product reading its state or M in bf16, as the kernels' do): warm-ups against today's exact
    # composition.
    q, k, v, g, beta, h0, scale = problem(rng, 64 * 24, 64)
    o_ref, _ = recurrence(q, k, v, g, beta, h0, scale)
    warm = relative(bf16(bounded_segmented(q, k, v, g, beta, h0, scale, 4, operand=bf16)[0]), o_ref)
    composed = relative(bf16(bounded_segmented(q, k, v, g, beta, h0, scale, 4, threshold=-np.inf, operand=bf16)[0]),
                        o_ref)
    print(f"bf16 products, 4 segments: o {warm:.2e} with warm-ups, {composed:.2e} composed exactly, "
          f"{relative(bf16(o_ref), o_ref):.2e} the output's own rounding")
    # Warm-up lengths for segments of 128 chunks (fwd 16/32 1x32768's four), 32 heads of 32768 tokens.
    anchors = -np.log1p(np.exp(-rng.standard_normal((32768, 32)))) / 16
    qwen = qwen_gates(rng, 32768, 32)
    for name, gates in (("anchors' gates", anchors), ("Qwen3.5 at initialisation", qwen),
                        ("long memory (anchors / 64)", anchors / 64)):
        for label, threshold in (("2^-24", THRESHOLD), ("FlashQLA's -10", FLASHQLA_THRESHOLD)):
            print(f"{name}, threshold {label}: {summary(warmup_lengths(gates, 128, threshold))}")
    # The backward's mirror: a segment's first chunks give the state gradient entering it.
    q, k, v, g, beta, h0, scale = problem(rng, 64 * 40 + 17, dim)
    do, dht = rng.standard_normal(v.shape), rng.standard_normal(h0.shape)
    print("the backward's segments, mirrored:")
    for chunks, error, bound in reverse_start_errors(q, k, g, beta, scale, do, dht, 5):
        if chunks is None:
            print("  gradient composed exactly")
            continue
        print(f"  reverse warm-up of {chunks:2d} chunks: gradient error {error:.1e} <= bound {bound:.1e}")
        worst = max(worst, error / bound)
    print(f"largest start error over its bound: {worst:.2f}")
    return 0 if worst <= 1.0 else 1


def relative(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


if __name__ == "__main__":
    sys.exit(main())
