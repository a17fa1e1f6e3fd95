"""The float64 prototypes of the cuda backend's planned kernels (bench/prototypes/) on fresh random problems, so
that the designs they check stay checked: the segmented forward (in two passes, in one walk and with bounded
warm-ups), the gate-free fused forward and the one-product state chain against the token recurrence, prepare's
inverse by doubling and its merges in one TF32 product against numpy's inverse and the forward's error, the fused
backward and the role split's stage schedule against the recurrence's reverse, and that reverse against central
differences; the role split kernel's shared memory and barriers against a model of their order (its two forms, every
mode, seeded slips, the second form's every wait, its timing), and the kernel's barriers against the model's."""

import collections
import dataclasses
import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "prototypes"))
import bounded_warmup  # noqa: E402
import fused_backward  # noqa: E402
import gate_free_forward  # noqa: E402
import role_split_backward  # noqa: E402
import role_split_sync  # noqa: E402
import sync_model  # noqa: E402
import segmented_state  # noqa: E402
import tf32_inverse  # noqa: E402
import transition_chain  # noqa: E402

CASES = ("anchors", "strong decay", "beta at 0 and 1")


def relative(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("case", CASES)
def test_fused_backward_equals_the_recurrences_reverse(rng, case):
    tokens = 64 * int(rng.integers(1, 5)) + int(rng.integers(0, 64))
    q, k, v, g, beta, h0, scale = segmented_state.problem(rng, tokens, 16, case, strong_decay=-30.0)
    do, dht = rng.standard_normal(v.shape), rng.standard_normal(h0.shape)
    expected = fused_backward.recurrence_backward(q, k, v, g, beta, h0, scale, do, dht)
    got = fused_backward.fused_backward(q, k, v, g, beta, h0, scale, do, dht)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, expected):
        assert relative(a, b) < 1e-10, name


@pytest.mark.parametrize("case", CASES)
def test_the_fused_backward_splits_over_value_columns_without_exchange(rng, case):
    """bench/NOTES.md's V split: each slice of the value columns, run alone, gives its own columns of dv and dh0 and
    a part of dq, dk, dg and dbeta whose sum over the slices is the whole gradient."""
    tokens = 64 * int(rng.integers(1, 5)) + int(rng.integers(0, 64))
    q, k, v, g, beta, h0, scale = segmented_state.problem(rng, tokens, 16, case, strong_decay=-30.0)
    do, dht = rng.standard_normal(v.shape), rng.standard_normal(h0.shape)
    whole = fused_backward.fused_backward(q, k, v, g, beta, h0, scale, do, dht)
    cut = int(rng.integers(1, v.shape[1]))
    parts = [fused_backward.fused_backward(q, k, v[:, s], g, beta, h0[:, s], scale, do[:, s], dht[:, s])
             for s in (slice(0, cut), slice(cut, None))]
    for i, name in ((0, "dq"), (1, "dk"), (3, "dg"), (4, "dbeta")):
        assert relative(parts[0][i] + parts[1][i], whole[i]) < 1e-10, name
    for i, name in ((2, "dv"), (5, "dh0")):
        assert relative(np.concatenate([part[i] for part in parts], axis=1), whole[i]) < 1e-10, name


@pytest.mark.parametrize("case", CASES)
def test_the_role_split_schedule_computes_the_backward(rng, case):
    """bench/NOTES.md's role split, run stage by stage (each role seeing the others' values only after a stage), gives
    the recurrence's gradients; every step reads only what its role may; its shared tiles fit the SM."""
    steps = role_split_backward.schedule(segmented_state.C, 128, 128)
    assert role_split_backward.check_reads(steps) == []
    tokens = 64 * int(rng.integers(1, 5)) + int(rng.integers(0, 64))
    q, k, v, g, beta, h0, scale = segmented_state.problem(rng, tokens, 16, case, strong_decay=-30.0)
    do, dht = rng.standard_normal(v.shape), rng.standard_normal(h0.shape)
    expected = fused_backward.recurrence_backward(q, k, v, g, beta, h0, scale, do, dht)
    got = role_split_backward.run(q, k, v, g, beta, h0, scale, do, dht, steps)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, expected):
        assert relative(a, b) < 1e-10, name
    life = role_split_backward.lifetimes(steps, segmented_state.C, 128, 128)
    assert role_split_backward.peak_bytes(life, max(s.stage for s in steps)) + role_split_backward.VECTOR_BYTES <= \
        role_split_backward.SMEM_BYTES


def test_the_schedule_check_finds_a_read_of_another_roles_registers():
    steps = role_split_backward.schedule(segmented_state.C, 128, 128)
    k_s = next(s for s in steps if s.name.startswith("K S"))
    steps.append(role_split_backward.Step(k_s.stage + 1, "K", "reads A's K S", ("ks",), (("x", "reg"),)))
    errors = role_split_backward.check_reads(steps)
    assert len(errors) == 1 and "A's registers" in errors[0]


FORM_MODES = [(form, mode) for form, (_, modes) in role_split_sync.FORMS.items() for mode in modes]


@pytest.mark.parametrize("form,mode", FORM_MODES)
def test_the_role_split_kernels_reads_each_see_their_own_chunks_values(form, mode):
    assert sync_model.hazards(*role_split_sync.kernel(role_split_sync.FORMS[form][0], mode)) == []


def _edited(mode, roles, take, put=None, after=None, form="first"):
    """The kernel's programs with the ops of each role's body at the positions `take(body)` gives removed, and `put`
    (default: those ops) inserted after the n-th wait at barrier b, `after` = (b, n)."""
    programs, barriers = role_split_sync.kernel(role_split_sync.FORMS[form][0], mode)
    for role in roles.split():
        body = list(sync_model.flatten(programs[role].body))
        positions = take(body)
        assert positions, "the slip names no op of the kernel"
        taken = [body[i] for i in sorted(positions)]
        body = [op for i, op in enumerate(body) if i not in positions]
        if after is not None:
            barrier, n = after
            waits = [i for i, op in enumerate(body) if isinstance(op, sync_model.Wait) and op.barrier == barrier]
            body[waits[n] + 1:waits[n] + 1] = taken if put is None else put
        programs[role] = dataclasses.replace(programs[role], body=tuple(body))
    return programs, barriers


def _where(picks):
    """The positions of the ops that `picks` matches."""
    return lambda body: {i for i, op in enumerate(body) if picks(op)}


def _op(cls, region, **fields):
    """The positions of the ops of a class, region and fields."""
    return _where(lambda op: isinstance(op, cls) and op.region == region and all(
        getattr(op, k) == v for k, v in fields.items()))


def _nth(n, picks):
    """The position of the n-th op (from 0) that `picks` matches."""
    return lambda body: {[i for i, op in enumerate(body) if picks(op)][n]}


S, W, C = sync_model.Read, sync_model.Write, sync_model.Copy
# Each a slip the kernel could make, and a hazard the model must report for it.
SLIPS = {
    "V's copy issued while corr is read": lambda: _edited("per_value_head", "S", _op(C, "v"), after=("stage", 2)),
    "dT^T stored before the square role's barrier": lambda: _edited(
        "per_value_head", "A", _op(W, "ddelta.lo", value="dt"), after=("stage", 2)),
    "K's copy issued a stage early": lambda: _edited("per_value_head", "S", _op(C, "k"), put=[C("k", 1)],
                                                     after=("stage", 4)),
    "dS' staged in the stage that reads it": lambda: _edited("per_value_head", "S", _op(W, "ds"), after=("stage", 1)),
    "F written over X": lambda: _edited("per_value_head", "A", _op(W, "ddelta.lo", value="f"),
                                        put=[W("ddelta.hi", "f", True)], after=("square", 1)),
    "dO's copy issued before dQ reads it": lambda: _edited("this_cta", "S", _op(C, "do"), after=("stage", 2)),
    "Q's copy at stage 4 where rank 0 finishes dq then": lambda: _edited(
        "cluster_pair", "S0", _op(C, "0:q"), put=[C("0:q", 1)], after=("0:stage", 4)),
    "a partial written after the pair meets": lambda: _edited(
        "cluster_pair", "A1", _where(lambda op: isinstance(op, W) and op.value == "partial"), after=("cluster", 1)),
    "no wait for the copies before stage 1": lambda: _edited(
        "per_value_head", "S", _nth(1, lambda op: isinstance(op, sync_model.WaitCopies))),
    "the pair's wait after the exchange tiles are written": lambda: _edited(
        "cluster_pair", "S0 K0 A0", _nth(0, lambda op: op == sync_model.Wait("cluster")),
        after=("0:stage", 3)),
}


@pytest.mark.parametrize("slip", SLIPS)
def test_the_synchronisation_model_finds_a_slip(slip):
    assert sync_model.hazards(*SLIPS[slip]()) != []


def _form_waits(*forms):
    """(form, mode, role, barrier, n) for every wait of the forms: the role's n-th wait at that barrier."""
    found = []
    for form in forms:
        for mode in role_split_sync.FORMS[form][1]:
            programs, _ = role_split_sync.kernel(role_split_sync.FORMS[form][0], mode)
            for role, program in programs.items():
                seen = collections.Counter()
                for op in sync_model.flatten(program.body):
                    if isinstance(op, (sync_model.Wait, sync_model.Await)):
                        found.append((form, mode, role, op, seen[op]))
                        seen[op] += 1
    return found


@pytest.mark.parametrize("form,mode,role,wait,n", _form_waits("second", "third"))
def test_every_wait_of_the_hand_over_forms_is_needed(form, mode, role, wait, n):
    """Each wait removed, the model finds what it guarded: the form has no barrier it does not need."""
    programs, barriers = _edited(mode, role, _nth(n, lambda op: op == wait), form=form)
    assert sync_model.hazards(programs, barriers) != []


KERNEL = os.path.join(os.path.dirname(__file__), "..", "..", "gdn", "cuda", "role_split_backward.cu")


def _kernel_barrier_uses():
    """{role: ({barriers it hands over at}, {barriers it waits at})} from role_split_backward.cu's source: each role's
    struct, and Cta::finish_input_rows for the two roles that call it (the chain and the square role)."""
    source = open(KERNEL).read()
    starts = {role: source.index(f"struct {name} : Cta<E>") for role, name in
              (("S", "StateRole"), ("K", "ChainRole"), ("A", "SquareRole"))}
    entry = source.index("__device__ __forceinline__ void role_split_backward(")
    ends = {"S": starts["K"], "K": starts["A"], "A": entry}
    shared = source[source.index("__device__ void finish_input_rows"):starts["S"]]
    uses = {}
    for role in starts:
        text = source[starts[role]:ends[role]] + (shared if role in "KA" else "")
        uses[role] = (set(re.findall(r"hand_over<(k\w+)>", text)), set(re.findall(r"wait_for<(k\w+)>", text)))
    return uses


def test_the_kernel_uses_the_second_forms_barriers():
    """Every named barrier each role of the kernel hands over at or waits at is one the model's second form has that
    role arrive at or wait at (over all its modes), and none is missing: a transcription slip in either is caught."""
    model = {}
    for mode in role_split_sync.FORMS["second"][1]:
        for role, (arrived, waited) in role_split_sync.named_barrier_uses(
                role_split_sync.kernel(role_split_sync.second_form, mode)[0]).items():
            model.setdefault(role, (set(), set()))
            model[role][0].update(arrived)
            model[role][1].update(waited)
    assert _kernel_barrier_uses() == model


def test_the_model_reports_an_mbarrier_producer_two_phases_ahead_and_a_hang():
    """A producer that sends through an mbarrier with no word back from its consumer may complete two phases before
    the consumer's first wait (their parity would hide one); with the word back it may not. A wait that no arrival
    completes hangs."""
    Arrive, Await, Program = sync_model.Arrive, sync_model.Await, sync_model.Program
    W, R = sync_model.Write, sync_model.Read
    unpaced = {"P": Program(body=(W("x"), Arrive("full"))), "C": Program(body=(Await("full"), R("x")))}
    found = sync_model.hazards(unpaced, {"full": ["P"]})
    assert any("parity" in h for h in found)
    paced = {"P": Program(body=(Await("empty"), W("x"), Arrive("full"))),
             "C": Program(before=Arrive("empty"), body=(Await("full"), R("x"), Arrive("empty")))}
    assert sync_model.hazards(paced, {"full": ["P"], "empty": ["C"]}) == []
    hung = {"P": Program(body=(Await("never"),))}
    assert any("hang" in h for h in sync_model.hazards(hung, {"never": ["C"]}))


def test_the_model_times_a_hand_over_and_an_overlap(rng):
    """Two roles that hand a value back and forth take the sum of their work a step; with a second buffer (the
    producer runs one step ahead), the longer of the two."""
    a, b = (float(x) for x in rng.uniform(1, 10, size=2))
    Arrive, Sync, Busy, Program = sync_model.Arrive, sync_model.Sync, sync_model.Busy, sync_model.Program
    ping_pong = {"P": Program(body=(Busy("a", a), Arrive("full"), Sync("empty"))),
                 "C": Program(body=(Sync("full"), Busy("b", b), Arrive("empty")))}
    barriers = {"full": ["P", "C"], "empty": ["P", "C"]}
    assert sync_model.timing(ping_pong, barriers)[0] == pytest.approx(a + b)
    double_buffered = {"P": Program(before=(Busy("a", a), Arrive("full")),
                                    body=(Busy("a", a), Arrive("full"), Sync("empty"))),
                       "C": Program(before=(Arrive("empty"),), body=(Sync("full"), Busy("b", b), Arrive("empty")))}
    assert sync_model.timing(double_buffered, barriers)[0] == pytest.approx(max(a, b))


def test_the_first_forms_modelled_step_is_its_stages_longest_work():
    """With no copy latency, the first form's step is the sum over its five stages of the busiest role's work there
    (a second way to the same number: each Busy op grouped by the stage barriers before it in its role's body)."""
    programs, barriers = role_split_sync.kernel(role_split_sync.first_form, "this_cta")
    per_stage = {}
    for role, program in programs.items():
        stage = -1
        for op in sync_model.flatten(program.body):
            if op == sync_model.Wait("stage"):
                stage += 1
            elif isinstance(op, sync_model.Busy):
                per_stage.setdefault(stage, {}).setdefault(role, 0.0)
                per_stage[stage][role] += op.time
    expected = sum(max(times.values()) for times in per_stage.values())
    assert sync_model.timing(programs, barriers)[0] == pytest.approx(expected)


def test_the_reference_reverse_matches_central_differences(rng):
    assert fused_backward.check_reference(rng) < 1e-6


@pytest.mark.parametrize("case", CASES)
def test_gate_free_and_segmented_forwards_equal_the_recurrence(rng, case):
    tokens = 64 * int(rng.integers(2, 6)) + int(rng.integers(1, 64))
    q, k, v, g, beta, h0, scale = segmented_state.problem(rng, tokens, 16, case, strong_decay=-30.0)
    o_ref, ht_ref = segmented_state.recurrence(q, k, v, g, beta, h0, scale)
    o, ht, _ = gate_free_forward.gate_free_forward(q, k, v, g, beta, h0, scale)
    assert relative(o, o_ref) < 1e-10 and relative(ht, ht_ref) < 1e-10
    o, ht = segmented_state.segmented(q, k, v, g, beta, h0, scale, int(rng.integers(1, 4)))
    assert relative(o, o_ref) < 1e-10 and relative(ht, ht_ref) < 1e-10


@pytest.mark.parametrize("case", CASES + ("long memory",))
def test_the_single_walk_segmented_forward_is_exact_and_as_accurate_in_bfloat16(rng, case):
    tokens = 64 * int(rng.integers(4, 9)) + int(rng.integers(1, 64))
    q, k, v, g, beta, h0, scale = transition_chain.draw(rng, tokens, 32, case)
    o_ref, ht_ref = segmented_state.recurrence(q, k, v, g, beta, h0, scale)
    segments = int(rng.integers(2, 5))
    o, ht = segmented_state.single_walk(q, k, v, g, beta, h0, scale, segments)
    assert relative(o, o_ref) < 1e-10 and relative(ht, ht_ref) < 1e-10
    # With every product's state operand in bfloat16, and the correcting product's two: within 1.5x of the two-pass
    # form's error (over 300 draws the largest ratio was 1.11).
    bf16 = segmented_state.bf16
    walk, _ = segmented_state.single_walk(q, k, v, g, beta, h0, scale, segments, operand=bf16)
    today, _ = segmented_state.segmented(q, k, v, g, beta, h0, scale, segments, operand=bf16)
    assert relative(bf16(today), o_ref) < 2e-2
    assert relative(bf16(walk), o_ref) < 1.5 * relative(bf16(today), o_ref)


@pytest.mark.parametrize("case", CASES + ("long memory",))
def test_the_one_product_chain_is_exact_and_as_accurate_in_bfloat16(rng, case):
    tokens = 64 * int(rng.integers(4, 9)) + int(rng.integers(1, 64))
    q, k, v, g, beta, h0, scale = transition_chain.draw(rng, tokens, 32, case)
    o_ref, ht_ref = segmented_state.recurrence(q, k, v, g, beta, h0, scale)
    o, ht = transition_chain.one_product_chain(q, k, v, g, beta, h0, scale, rnd=transition_chain.exact)
    assert relative(o, o_ref) < 1e-10 and relative(ht, ht_ref) < 1e-10
    # With the pass's bfloat16 roundings: within 1.75x of today's three-product chain's error (over 1,200 draws the
    # largest ratio was 1.38), which is itself at bfloat16's scale (a chain that dropped a term is off by O(1)).
    three_o, three_ht = transition_chain.three_product_chain(q, k, v, g, beta, h0, scale)
    one_o, one_ht = transition_chain.one_product_chain(q, k, v, g, beta, h0, scale, r_rounded=True)
    for mine, today, ref in ((one_o, three_o, o_ref), (one_ht, three_ht, ht_ref)):
        assert relative(today, ref) < 2e-2
        assert relative(mine, ref) < 1.75 * relative(today, ref)


@pytest.mark.parametrize("case", CASES + ("long memory",))
def test_the_backward_one_product_chain_is_exact_and_as_accurate_in_bfloat16(rng, case):
    tokens = 64 * int(rng.integers(4, 9)) + int(rng.integers(1, 64))
    q, k, v, g, beta, h0, scale = transition_chain.draw(rng, tokens, 32, case)
    do, dht = rng.standard_normal(v.shape), rng.standard_normal(h0.shape)
    dh0_ref = fused_backward.recurrence_backward(q, k, v, g, beta, h0, scale, do, dht)[-1]
    for dh0 in transition_chain.state_gradient_chains(q, k, v, g, beta, h0, scale, do, dht, rnd=transition_chain.exact):
        assert relative(dh0, dh0_ref) < 1e-10
    # bfloat16: over 600 draws the one-product chain's error was at most 1.02x the fused backward's chain's.
    three, one = transition_chain.state_gradient_chains(q, k, v, g, beta, h0, scale, do, dht)
    assert relative(three, dh0_ref) < 2e-2
    assert relative(one, dh0_ref) < 1.75 * relative(three, dh0_ref)


def test_prepares_doubling_inverse_is_the_inverse(rng):
    """The kernel's order (float32 substitution on the 16 x 16 diagonal blocks, then the 16 -> 32 and 32 -> 64 merges)
    with exact merges against numpy's inverse, on A as prepare forms it from a fresh draw (its last chunk partial)."""
    tokens = 64 * int(rng.integers(1, 4)) + int(rng.integers(1, 64))
    q, k, v, g, beta, h0, scale = transition_chain.draw(rng, tokens, 32, "anchors")
    for c0 in range(0, tokens, 64):
        K, b, gam = k[c0:c0 + 64], beta[c0:c0 + 64], np.cumsum(g[c0:c0 + 64])
        a = np.tril(b[:, None] * (K @ K.T) * np.exp(gam[:, None] - gam[None, :]), -1)
        t = tf32_inverse.prepare_inverse(a, lambda x, y: x @ y)
        assert relative(t, np.linalg.inv(np.eye(len(K)) + a)) < 1e-5  # the substitution's float32


@pytest.mark.parametrize("case", CASES + ("long memory",))
def test_one_tf32_product_a_merge_keeps_the_forwards_error(rng, case):
    """The merges in one TF32 product (prepare for 16-bit inputs) against 3xTF32: T within 5e-4 of the exact inverse
    (over 1,200 chunks the largest was 1.5e-4, against bfloat16's 2^-9 when T is stored), and the emulated forward's
    errors against float64 within 1.1x (over 240 draws the largest ratio was 1.049, the median 1.000)."""
    tokens = 64 * int(rng.integers(3, 7)) + int(rng.integers(1, 64))
    errors = tf32_inverse.errors(rng, tokens, 32, case)
    assert errors["3xTF32"][0] < 1e-6 and errors["1xTF32"][0] < 5e-4
    for index in (1, 2):  # o, the final state
        assert errors["3xTF32"][index] < 2e-2
        assert errors["1xTF32"][index] < 1.1 * errors["3xTF32"][index]


def test_bfloat16_rounding_is_to_nearest_even():
    x = np.array([1.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -9, -2.5e-3], dtype=np.float64)
    expected = np.array([1.0, 1.0, 1.0 + 4 * 2.0 ** -8, 1.0, -2.5e-3])
    got = transition_chain.bf16(x)
    assert np.array_equal(got[:4], expected[:4])
    assert abs(got[4] - expected[4]) <= 2.0 ** -9 * 2.5e-3


@pytest.mark.parametrize("form", [role_split_sync.first_form, role_split_sync.second_form])
def test_a_form_retimed_scales_its_step(form, rng):
    """with_busy: the programs retimed with their own table time as they are, and every piece scaled by one random
    factor (no copy or barrier latency) scales the modelled step and each role's busy time by it."""
    programs, barriers = role_split_sync.kernel(form, "this_cta")
    step, busy = sync_model.timing(programs, barriers)
    same = sync_model.timing(role_split_sync.with_busy(programs, role_split_sync.BUSY), barriers)
    assert same[0] == pytest.approx(step) and same[1] == pytest.approx(busy)
    factor = float(rng.uniform(0.3, 3.0))
    scaled = {name: factor * t for name, t in role_split_sync.BUSY.items()}
    step2, busy2 = sync_model.timing(role_split_sync.with_busy(programs, scaled), barriers)
    assert step2 == pytest.approx(factor * step)
    assert busy2 == pytest.approx({role: factor * t for role, t in busy.items()})


def _bulk_pipeline(consumer_awaits=True, producer_awaits=True, second_reader_syncs=True):
    """A producer P that bulk-copies x and y (one arrival, two copies) into single buffers for consumer C, which reads
    x and hands on to D through a named barrier; D reads y. Both say their buffer is free through an mbarrier that P
    awaits before it copies again."""
    M = sync_model
    wait_free = (M.Await("empty"),) if producer_awaits else ()
    producer = M.Program(body=wait_free + (M.BulkCopy("x", "full", ahead=0, arrive=False),
                                           M.BulkCopy("y", "full", ahead=0)))
    wait_full = (M.Await("full"),) if consumer_awaits else ()
    consumer = M.Program(before=M.Arrive("empty"), body=wait_full + (M.Read("x"), M.Arrive("pass"), M.Arrive("empty")))
    handed_on = M.Sync("pass") if second_reader_syncs else ()
    second = M.Program(before=M.Arrive("empty"), body=(*handed_on, M.Read("y"), M.Arrive("empty"),
                                                        *(() if second_reader_syncs else M.Sync("pass"))))
    return {"P": producer, "C": consumer, "D": second}, {"full": ["P"], "empty": ["C", "D"], "pass": ["C", "D"]}


def test_the_model_orders_bulk_copies_by_the_phase_they_complete():
    """Bulk (TMA) copies land by the phase of their barrier that the issuer's arrival and their bytes complete: a
    consumer that awaits it, and a role that syncs with that consumer after, see them; one that does not await, or
    reads before the hand-on, or a producer that refills before the consumer frees the buffer, is reported; a copy
    that completes no phase is reported too."""
    assert sync_model.hazards(*_bulk_pipeline()) == []
    found = sync_model.hazards(*_bulk_pipeline(consumer_awaits=False))
    assert "step 0 C read x (x) is unordered with step 0 P bulkcopy x (x)" in found
    found = sync_model.hazards(*_bulk_pipeline(second_reader_syncs=False))
    assert "step 0 D read y (y) is unordered with step 0 P bulkcopy y (y)" in found
    found = sync_model.hazards(*_bulk_pipeline(producer_awaits=False))
    assert "step 0 C read x (x) is unordered with step 1 P bulkcopy x (x)" in found
    stray = {"P": sync_model.Program(body=(sync_model.BulkCopy("x", "full", ahead=0, arrive=False),)),
             "C": sync_model.Program(body=(sync_model.Read("x"),))}
    assert any("completes no phase" in h for h in sync_model.hazards(stray, {"full": ["P"]}))


def test_the_model_times_a_bulk_copy_by_its_landing(rng):
    """A single-buffered bulk copy and its consumer take the copy's latency plus the consumer's work a step."""
    latency, work = (float(x) for x in rng.uniform(1, 10, size=2))
    programs, barriers = _bulk_pipeline()
    programs["C"] = sync_model.Program(before=sync_model.Arrive("empty"),
                                       body=(sync_model.Await("full"), sync_model.Busy("work", work),
                                             sync_model.Arrive("empty")))
    del programs["D"], barriers["pass"]
    barriers["empty"] = ["C"]
    assert sync_model.timing(programs, barriers, copy_latency=latency)[0] == pytest.approx(latency + work)


@pytest.mark.parametrize("case", CASES + ("long memory",))
def test_bounded_warmup_starts_are_within_their_bound(rng, case):
    tokens = 64 * int(rng.integers(8, 20)) + int(rng.integers(1, 64))
    q, k, v, g, beta, h0, scale = transition_chain.draw(rng, tokens, 16, case)
    # Keys off the unit sphere, up to where a token's transition stretches the state (beta |k|^2 > 2): the bound's
    # key term.
    k = k * rng.uniform(1.0, 1.6)
    segments = int(rng.integers(2, 6))
    o_ref, ht_ref = segmented_state.recurrence(q, k, v, g, beta, h0, scale)
    o, ht, _, _, _ = bounded_warmup.bounded_segmented(q, k, v, g, beta, h0, scale, segments)
    assert relative(o, o_ref) < 1e-6 and relative(ht, ht_ref) < 1e-6
    for chunks, error, bound in bounded_warmup.start_errors(q, k, v, g, beta, h0, scale, segments):
        if chunks is None:  # composed exactly from the previous start
            assert error < 1e-9 * np.linalg.norm(ht_ref)
        else:
            assert error <= bound


def test_bounded_warmup_length_follows_the_gates_and_the_keys(rng):
    chunks = 40
    gates = np.full(64 * chunks, -0.05)  # -3.2 a chunk: 2^-24 (-16.6) is reached after 6 chunks
    log_norms = bounded_warmup.transition_log_norms(np.ones((len(gates), 1)), gates, np.full(len(gates), 0.5))
    per_chunk = bounded_warmup.chunk_log_norms(log_norms)
    boundary = int(rng.integers(10, chunks))
    assert bounded_warmup.warmup_first_chunk(per_chunk, boundary, bounded_warmup.THRESHOLD, chunks) == boundary - 6
    assert bounded_warmup.warmup_first_chunk(per_chunk, boundary, bounded_warmup.THRESHOLD, 5) is None
    # beta |k|^2 = 3 stretches the state by 2 a token: log 2 per token outweighs the gates, no warm-up ends.
    stretched = bounded_warmup.transition_log_norms(np.full((len(gates), 1), np.sqrt(3.0)), gates, np.ones(len(gates)))
    assert np.allclose(stretched, gates + np.log(2.0))
    assert bounded_warmup.warmup_first_chunk(bounded_warmup.chunk_log_norms(stretched), boundary,
                                             bounded_warmup.THRESHOLD, chunks) is None
    # A gate of -inf forgets everything: a warm-up of one chunk.
    gates[64 * (boundary - 1) + int(rng.integers(0, 64))] = -np.inf
    per_chunk = bounded_warmup.chunk_log_norms(bounded_warmup.transition_log_norms(
        np.ones((len(gates), 1)), gates, np.full(len(gates), 0.5)))
    assert bounded_warmup.warmup_first_chunk(per_chunk, boundary, bounded_warmup.THRESHOLD, chunks) == boundary - 1


@pytest.mark.parametrize("case", CASES + ("long memory",))
def test_bounded_reverse_warmup_gradients_are_within_their_bound(rng, case):
    tokens = 64 * int(rng.integers(8, 20)) + int(rng.integers(1, 64))
    q, k, v, g, beta, h0, scale = transition_chain.draw(rng, tokens, 16, case)
    k = k * rng.uniform(1.0, 1.6)
    do, dht = rng.standard_normal(v.shape), rng.standard_normal(h0.shape)
    for chunks, error, bound in bounded_warmup.reverse_start_errors(q, k, g, beta, scale, do, dht,
                                                                    int(rng.integers(2, 6))):
        if chunks is not None:
            assert error <= bound
