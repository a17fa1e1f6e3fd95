"""The shared memory and synchronisation of gdn/cuda/role_split_backward.cu, written as the roles' programs and checked
by sync_model.py: every read sees its own chunk's value, no access is unordered with a write of its region, no barrier
is over-arrived, nothing hangs; and timed with the busy times the first form's profile measured.

The kernel's three roles (S: the state, K: the chain, A: the square work) walk the same chunks. Where dq and dk are
finished by a cluster pair, both CTAs' roles are modelled (roles and regions named by rank).
- The first form (the kernel measured in sessions 31 and 32, up to 55eb1aa) meets at a barrier of all three before
  each of a chunk's five stages (`stage`); the square role has a barrier of its own (`square`). S issues every copy and
  waits for all of them before the barriers of stages 0 and 1. A pair's partial sums pass through the partner's -E
  dcorr and dV tiles between cluster barriers. It stays here as the calibration of BUSY, the times it was profiled at.
- The second form (the kernel now) hands each value over by a named barrier that only its readers wait on, and a
  pair's partials by mbarriers (second_form's docstring).

Run: python3 bench/prototypes/role_split_sync.py   (prints the hazards; exits 1 if there are any)
"""
import sys

from sync_model import (Arrive, Await, BulkCopy, Busy, Copy, Program, Read, Sync, Wait, WaitCopies, Write, flatten,
                        hazards, timing)

# Who finishes dq and dk (the kernel's InputGrads).
MODES = ("per_value_head", "this_cta", "cluster_pair")
# A region that holds two values side by side: an access of the whole tile touches both halves (the kernel's dDelta
# tile holds dT^T and X side by side, then F in dT^T's place).
HALVES = {"ddelta": ("ddelta.lo", "ddelta.hi")}


# The third form's producer pieces, not measured: one thread's bulk copies, each a descriptor and an instruction
# (FlashQLA's loader warps run ~70-90 instructions a full chunk), about the same a chunk as a named barrier's wait.
PRODUCER_BUSY = {"the producer's P and V copies": 0.5, "the producer's other copies": 1.0}
# Each piece of work's busy time in the first form, in % of its measured chunk step (bench/NOTES.md, "The role split
# profiled": ncu's samples of role_split_backward_pair_kernel at 9e2b4f4, bwd 16/32 8x4096 on an H100, summed by
# `stall_lines.py --regions` over each piece's lines, less the samples waiting at a barrier).
BUSY = {
    "issue K's copy": 2.4, "stage dS', the state dot": 11.3, "scale Q^T diag(E) dO": 7.5, "issue P's copy": 2.5,
    "issue V's copy; dS -= K^T E dcorr": 6.2, "issue the rest's copies": 10.6,
    "dDelta": 14.7, "T^T dDelta, dcorr, dV": 10.3, "dK's state terms, M^T Q; dV out": 10.1, "F K + F^T K": 1.7,
    "finish dk": 9.7,
    "dP, M, G": 14.5, "K S, corr": 8.8, "K K^T, dT": 2.9, "X, -dA, the inverse's backward": 18.4, "dQ": 5.0,
    # the second form splits the last but one, which the profile counts as one region: X's product and store taken as
    # a sixth of it (a quarter of its products, little of its element-wise work)
    "X": 3.0, "-dA, the inverse's backward": 15.4,
    "the per-token sums": 7.4, "finish dq": 15.2,
    **PRODUCER_BUSY,
}
# The second form's pieces as its own profile measured them (bench/NOTES.md, "The role split's second form,
# measured": role_split_backward_pair_kernel at e36d886, the same cell and card, in % of the first form's measured step;
# dq's and dk's finishing fall in the lines of dQ and F K, and the walks' prologues in dP). Timed with these, the second
# form models at 91.9 against its measured ~99: the structure holds, the first form's busy times did not carry over.
SECOND_FORM_BUSY = {
    "stage dS', the state dot": 11.2, "the per-token sums": 6.5, "scale Q^T diag(E) dO": 5.5,
    "issue V's copy; dS -= K^T E dcorr": 4.7, "issue P's copy": 5.3, "issue the rest's copies": 11.7,
    "dDelta": 14.2, "T^T dDelta, dcorr, dV": 9.0, "dK's state terms, M^T Q; dV out": 12.0, "F K + F^T K": 13.3,
    "finish dk": 0.0,
    "dP, M, G": 21.6, "K S, corr": 8.4, "K K^T, dT": 2.8, "X": 0.8, "-dA, the inverse's backward": 20.0, "dQ": 21.2,
    "finish dq": 0.0,
    **PRODUCER_BUSY,
}
# A copy's time from issue to landing, in the same unit: ~1 us of DRAM latency and 16-32 KB a tile at the SM's share
# of bandwidth, of the first form's ~18 us step.
COPY_LATENCY = 6.0
# What the profile charges to no piece (the walks' prologues, the kernel's entry: 7% of the step) and a stage
# barrier's latency are not modelled; the first form's modelled step is therefore below its measured 100.


def work(name):
    return Busy(name, BUSY[name])


def with_busy(programs, busy):
    """The programs with each Busy's time taken from `busy` (a table like BUSY): a form timed with other
    measurements."""
    def retime(ops):
        if isinstance(ops, (tuple, list)):
            return tuple(retime(op) for op in ops)
        return Busy(ops.name, busy[ops.name]) if isinstance(ops, Busy) else ops
    return {role: Program(body=retime(p.body), before=retime(p.before), after=retime(p.after))
            for role, p in programs.items()}


def whole(access):
    """An access of a tile, split into its halves where it has two (a rank's prefix kept: "0:ddelta" is "0:ddelta.lo"
    and "0:ddelta.hi")."""
    prefix, _, name = access.region.rpartition(":")
    halves = HALVES.get(name)
    if halves is None:
        return (access,)
    at = f"{prefix}:" if prefix else ""
    return tuple(type(access)(at + half, access.value or name, access.private, access.ahead) for half in halves)


def naming(mode, rank):
    """What both forms' programs are written with, for one CTA (rank: of a cluster pair): whether it is a pair; the
    CTA's own name of a region or barrier, and the partner's; a role's name; and its accesses and copies (R, W, C), of a
    whole tile or both its halves."""
    pair = mode == "cluster_pair"
    r = lambda name: f"{rank}:{name}" if pair else name
    partner = lambda name: f"{1 - rank}:{name}"
    role_name = lambda role: f"{role}{rank}" if pair else role
    R = lambda region, value="", private=False, ahead=0: whole(Read(r(region), value, private, ahead))
    W = lambda region, value="", private=False, ahead=0: whole(Write(r(region), value, private, ahead))
    C = lambda region, ahead=1: Copy(r(region), ahead)
    return pair, r, partner, role_name, R, W, C


def first_form(mode, rank=0):
    """One CTA's programs, as the kernel's walks run them (rank: of a cluster pair). Regions and roles are named
    with the rank where there is a pair."""
    pair, r, partner, name, R, W, C = naming(mode, rank)
    stage = Sync(r("stage"))
    square = Sync(r("square"))
    # PairExchange: begin, before_overwrite, publish, read, end (nothing where dq and dk are not finished in a pair)
    cluster = lambda *ops: ops if pair else ()
    begin = cluster(Arrive("cluster", relaxed=True))
    before_overwrite = cluster(Wait("cluster"))
    publish = lambda wrote: cluster(Arrive("cluster", relaxed=not wrote), Wait("cluster"))
    read_done = cluster(Arrive("cluster", relaxed=True))
    end = cluster(Wait("cluster"))

    def finish(role, tile, summing):
        """finish_input_rows: dq (A, Q's tile, rank 0 sums) or dk (K, K's tile, rank 1 sums)."""
        if mode == "per_value_head":
            return ()
        if mode == "this_cta":
            return R(tile)
        if rank != summing:
            return (W("edcorr", "partial", private=True), W("dv", "partial", private=True), publish(True), read_done)
        return (publish(True), Read(partner("edcorr"), "partial"), Read(partner("dv"), "partial"), R(tile),
                read_done)

    late_queries = pair  # rank 0 finishes dq at stage 4 from Q's tile: Q's copy waits for stage 0, beside K's
    rest = (*(() if late_queries else (C("q"),)),
            *(C(region) for region in ("do", "t", "delta", "s", "gamma", "gate_in", "gate_out")),
            W("beta", ahead=1))
    state = Program(
        before=(C("p"), C("v"), rest, begin),
        body=(WaitCopies(), stage,  # 0: dS' to its tile, the state dot
              C("k", ahead=0), (C("q", ahead=0),) if late_queries else (), work("issue K's copy"),
              W("ds", "dsn", private=True), R("s"), R("gate_in"), W("state_dots", private=True),
              work("stage dS', the state dot"),
              WaitCopies(), stage,  # 1: dS += scale Q^T diag(E) dO
              R("do"), R("gate_in"), R("q"), work("scale Q^T diag(E) dO"),
              before_overwrite, stage,  # 2
              C("p"), work("issue P's copy"),
              stage,  # 3: dS -= K^T diag(E) dcorr
              C("v"), R("edcorr"), R("k"), work("issue V's copy; dS -= K^T E dcorr"),
              stage,  # 4
              rest, work("issue the rest's copies"), publish(False), read_done),
        after=end)
    chain = Program(
        before=begin,
        body=(stage,  # 0
              stage,  # 1: dDelta = P^T dO + diag(D) K dS', its D terms
              R("do"), R("p"), R("ds", "dsn"), R("k"), R("gate_out"), R("delta"),
              W("delta_parts", private=True), W("ddelta", private=True), work("dDelta"),
              before_overwrite, stage,  # 2: T^T dDelta, dcorr; dbeta's sums; -E dcorr and dV to tiles
              R("t"), R("v", "corr"), R("beta"), R("gate_in"),
              W("beta_parts", private=True), W("edcorr", private=True), W("dv", private=True),
              work("T^T dDelta, dcorr, dV"),
              stage,  # 3: dK's state terms and M^T Q; dV out
              R("delta"), R("ds", "dsn"), R("gate_out"), R("edcorr"), R("s"), R("m"), R("q"), R("dv"),
              work("dK's state terms, M^T Q; dV out"),
              stage,  # 4: dK += F K + F^T K
              R("ddelta.lo", "f"), R("k"), work("F K + F^T K"),
              finish("K", "k", summing=1), work("finish dk")),
        after=end)
    square_work = Program(
        before=begin,
        body=(stage,  # 0: dP, M, G's sums
              R("do"), R("delta"), R("gamma"), R("p"), W("m", private=True), W("g_parts", private=True),
              work("dP, M, G"),
              stage,  # 1: K S; corr over V's tile
              R("k"), R("s"), R("gate_in"), R("v", private=True), W("v", "corr", private=True), work("K S, corr"),
              before_overwrite, stage,  # 2: K K^T; dT
              R("k"), R("ddelta"), R("v", "corr"), R("beta"), work("K K^T, dT"),
              square,
              W("ddelta.lo", "dt", private=True),
              stage,  # 3: X; -dA; the inverse's backward; dQ
              R("t"), R("ddelta.lo", "dt"), W("ddelta.hi", "x", private=True),
              R("edcorr"), W("corr_dots", private=True),
              square,
              R("ddelta.hi", "x"), R("t"), R("gamma"), R("beta"),
              W("ddelta.lo", "f", private=True), W("e_sums", private=True), W("e_parts", private=True),
              work("X, -dA, the inverse's backward"),
              R("do"), R("s"), R("gate_in"), R("q"), W("q_dots", private=True), R("m"), R("k"), work("dQ"),
              () if pair else (finish("A", "q", summing=0), work("finish dq")),
              stage,  # 4: dgamma and dbeta
              R("delta_parts"), W("scratch", private=True),
              square,
              *(R(region) for region in ("scratch", "state_dots", "q_dots", "corr_dots", "g_parts", "e_parts",
                                         "e_sums", "beta_parts")),
              W("dgamma", private=True),
              square,
              R("dgamma"), work("the per-token sums"),
              (finish("A", "q", summing=0), work("finish dq")) if pair else ()),
        after=end)
    programs = {name("S"): state, name("K"): chain, name("A"): square_work}
    barriers = {r("stage"): [name(role) for role in "SKA"], r("square"): [name("A")]}
    return programs, barriers


def second_form(mode, rank=0, producer=False):
    """The next form's programs: each value handed over by a named barrier that its producer arrives at and only its
    readers wait on, instead of five barriers of all roles; the per-token sums move to the state role.
    - Tiles are still single-buffered: the next chunk's inputs are copied once every reader of this chunk's has said
      so (chunk_done), P and V's as soon as theirs have (pv_free). dq and dk are finished after chunk_done, while
      those copies land, so the L2 norm's backward reads the normalised rows from global memory, not the Q and K tiles.
    - The square role forms dQ last: in a cluster pair rank 1 hands its partial over through its -E dcorr and dV tiles,
      which are busy until then, and dQ beside K S (held for E dcorr . K S) makes ptxas serialise the wgmma. (Formed
      right after corr, from the chunk's inputs and M alone, it would overlap the chain's dDelta; with its finishing
      there too the model's step is longer.) E dcorr . K S comes before the inverse's backward, so that K S's
      registers are free for it.
    - A cluster pair hands each partial over with an mbarrier of the receiving role's CTA (rank 0's dK partial to rank
      1's chain, rank 1's dQ partial to rank 0's square role) and says it has read it with another, which the partial's
      tiles wait for before the chain writes -E dcorr into them again; no cluster barrier couples all six roles.
    - A role's own barrier (state, chain, square) stands only where its warps read what its other warps wrote; an
      arrival covers what each arriving thread wrote. In the kernel every arrival after shared stores that a wgmma
      reads is preceded by fence.proxy.async, as the first form's stage barrier is."""
    pair, r, partner, name, R, W, C = naming(mode, rank)
    sync = lambda barrier: Sync(r(barrier))
    arrive = lambda barrier: Arrive(r(barrier))
    # the pair's mbarriers, named by the partial they carry: "dk" rank 0 -> 1, "dq" rank 1 -> 0
    sent = lambda grad: Arrive(f"{grad} partial")
    received = lambda grad: Await(f"{grad} partial")
    read = lambda grad: Arrive(f"{grad} read")
    was_read = lambda grad: Await(f"{grad} read")
    writes_partial = {"K": pair and rank == 0, "A": pair and rank == 1}
    sums_partial = {"K": pair and rank == 1, "A": pair and rank == 0}

    def hand_over(role, grad):
        """After the chunk's products: the role's partial to the partner, or the partner's added to its own."""
        if writes_partial[role]:
            return (sync("exchange_free"), W("edcorr", "partial", private=True), W("dv", "partial", private=True),
                    sent(grad))
        if sums_partial[role]:
            return (received(grad), Read(partner("edcorr"), "partial"), Read(partner("dv"), "partial"),
                    work(f"finish d{grad[1]}"), read(grad))
        return work(f"finish d{grad[1]}")

    free_after = lambda role: () if not pair or writes_partial.get(role) else arrive("exchange_free")
    # the chain writes -E dcorr into the tiles that carried the partial: once the partner has read it
    tiles_read = was_read("dk") if pair and rank == 0 else was_read("dq") if pair else ()
    rest_regions = ("q", "do", "t", "delta", "s", "gamma", "gate_in", "gate_out", "k")
    rest = (*(C(region) for region in rest_regions), W("beta", ahead=1))
    if producer:  # bulk copies that complete the next chunk's phase of `full`, beta stored before the arrival
        bulk = lambda region, arrive=False: BulkCopy(r(region), r("full"), arrive=arrive)
        pv = (bulk("p"), bulk("v"))
        rest = (*(bulk(region) for region in rest_regions[:-1]), W("beta", ahead=1), bulk(rest_regions[-1], True))
    # dgamma and dbeta of the last chunk, from the roles' partial sums (S forms them while the chain works on the
    # next chunk's dDelta; the chain and the square role write the next chunk's sums once it has: sums_read)
    sums = (*(R(region, ahead=-1) for region in ("delta_parts", "state_dots", "q_dots", "corr_dots", "g_parts",
                                                 "e_parts", "e_sums", "beta_parts")),
            W("scratch", private=True, ahead=-1), sync("state"), R("scratch", ahead=-1),
            W("dgamma", private=True, ahead=-1), sync("state"), R("dgamma", ahead=-1), work("the per-token sums"))
    # the chunk's inputs have landed: the state role waits for its own copies, or for the producer's phase of `full`
    inputs_landed = (Await(r("full")),) if producer else (WaitCopies(), sync("state"), arrive("inputs"))
    state = Program(
        before=() if producer else (C("p"), C("v"), rest),  # the walk's first chunk
        body=(*inputs_landed,
              W("ds", "dsn", private=True), R("s"), R("gate_in"), work("stage dS', the state dot"),
              arrive("ds_ready"),
              sums, W("state_dots", private=True), arrive("sums_read"),  # the last chunk's; then this one's state dot
              R("do"), R("gate_in"), R("q"), work("scale Q^T diag(E) dO"),
              sync("edcorr_to_state"), R("edcorr"), R("k"), work("issue V's copy; dS -= K^T E dcorr"),
              free_after("S"),
              *((arrive("chunk_done"),) if producer else
                (sync("pv_free"), C("p"), C("v"), work("issue P's copy"),
                 sync("chunk_done"), rest, work("issue the rest's copies")))),
        # the walk's last chunk's (with a producer, once the other roles are done with it: the next chunk's phase of
        # `full` no longer says so)
        after=((Wait(r("chunk_done")),) if producer else ()) + sums)
    chain = Program(
        before=read("dk") if pair and rank == 1 else (),  # rank 0's tiles carry no partial yet
        body=(sync("ds_ready"),  # after the state role's wait for the chunk's copies
              R("do"), R("p"), R("ds", "dsn"), R("k"), R("gate_out"), R("delta"), work("dDelta"),
              # the state role has summed the last chunk's; the square role has formed corr and M (it arrives here
              # after them)
              sync("sums_read"), W("delta_parts", private=True), W("ddelta", private=True),
              arrive("ddelta_ready"),
              R("t"), R("v", "corr"), R("beta"), R("gate_in"), W("beta_parts", private=True),
              tiles_read, W("edcorr", private=True), W("dv", private=True), work("T^T dDelta, dcorr, dV"),
              sync("chain"), arrive("pv_free"), arrive("edcorr_to_state"), arrive("edcorr_to_square"),
              R("delta"), R("ds", "dsn"), R("gate_out"), R("edcorr"), R("s"), R("m"), R("q"), R("dv"),
              work("dK's state terms, M^T Q; dV out"), free_after("K"),
              sync("f_ready"), R("ddelta.lo", "f"), R("k"), work("F K + F^T K"),
              arrive("chunk_done"), hand_over("K", "dk")),
        after=tiles_read)  # the partner's last read of this CTA's tiles, before it exits
    dq = (R("do"), R("s"), R("gate_in"), R("q"), W("q_dots", private=True), R("m"), R("k"), work("dQ"))
    square_work = Program(
        before=read("dq") if pair and rank == 0 else (),  # rank 1's tiles carry no partial yet
        body=(Await(r("full")) if producer else sync("inputs"),  # after chunk_done: the chain's dK has read the last M
              R("do"), R("delta"), R("gamma"), R("p"), W("m", private=True), work("dP, M, G"),
              R("k"), R("s"), R("gate_in"), R("v", private=True), W("v", "corr", private=True), work("K S, corr"),
              # G's row and column sums, reduced in registers at dP, stored once the state role has summed the last
              # chunk's; corr and M handed to the chain by the same barrier
              sync("sums_read"), W("g_parts", private=True),
              sync("ddelta_ready"), R("k"), R("ddelta"), R("v", "corr"), R("beta"), work("K K^T, dT"),
              sync("square"), arrive("pv_free"),
              W("ddelta.lo", "dt", private=True), sync("square"),
              R("t"), R("ddelta.lo", "dt"), W("ddelta.hi", "x", private=True), work("X"),
              # E dcorr . K S for dg, from the K S it has held since forming corr: its 64 registers are free for the
              # inverse's backward after it (the barrier also orders X's stores before -dA's reads)
              sync("edcorr_to_square"), R("edcorr"), W("corr_dots", private=True), free_after("A"),
              R("ddelta.hi", "x"), R("t"), R("gamma"), R("beta"),
              W("ddelta.lo", "f", private=True), W("e_sums", private=True), W("e_parts", private=True),
              work("-dA, the inverse's backward"), arrive("f_ready"),
              dq, arrive("chunk_done"), hand_over("A", "dq")))
    programs = {name("S"): state, name("K"): chain, name("A"): square_work}
    roles = lambda *names: [name(role) for role in names]
    barriers = {r("state"): roles("S"), r("chain"): roles("K"), r("square"): roles("A"), r("inputs"): roles("S", "A"),
                r("ds_ready"): roles("S", "K"), r("pv_free"): roles("S", "K", "A"),
                r("edcorr_to_state"): roles("S", "K"), r("edcorr_to_square"): roles("K", "A"),
                r("ddelta_ready"): roles("K", "A"), r("f_ready"): roles("K", "A"),
                r("chunk_done"): roles("S", "K", "A"), r("sums_read"): roles("S", "K", "A")}
    if producer:  # a fourth role issues every copy once the tiles' readers are done; S and A await its phase
        programs[name("P")] = Program(
            before=(pv, rest),  # the walk's first chunk
            body=(sync("pv_free"), pv, work("the producer's P and V copies"),
                  sync("chunk_done"), rest, work("the producer's other copies")))
        del barriers[r("inputs")]
        barriers.update({r("pv_free"): roles("K", "A", "P"), r("chunk_done"): roles("S", "K", "A", "P"),
                         r("full"): roles("P")})
    if pair:
        barriers[r("exchange_free")] = roles("S", "K", "A")
        # each mbarrier's arriving role (the partial's sender, or its reader)
        barriers.update({"dk partial": ["K0"], "dk read": ["K1"]} if rank == 0 else
                        {"dq partial": ["A1"], "dq read": ["A0"]})
    return programs, barriers


def third_form(mode, rank=0):
    """The second form with a fourth role, a producer warpgroup (FlashQLA's): it issues every copy as a bulk (TMA)
    copy once the tiles' readers are done (pv_free, chunk_done), completing one phase of an mbarrier `full` a chunk,
    which the state and square roles await (the chain learns it from dS', as before); the state role issues nothing
    and the `inputs` barrier goes. dq's and dk's finishing stay where they are: the next step, once their staging
    tiles are sized."""
    return second_form(mode, rank, producer=True)


# The kernel's name (role_split_backward.cu's Barrier) of each of the second form's named barriers.
KERNEL_BARRIERS = {"state": "kStateOnly", "chain": "kChainOnly", "square": "kSquareOnly", "inputs": "kInputs",
                   "ds_ready": "kStateStaged", "sums_read": "kSumsRead", "ddelta_ready": "kDdeltaReady",
                   "edcorr_to_state": "kEdcorrToState", "edcorr_to_square": "kEdcorrToSquare", "f_ready": "kFReady",
                   "pv_free": "kPvFree", "chunk_done": "kChunkDone", "exchange_free": "kExchangeFree"}


def named_barrier_uses(programs):
    """{role: ({kernel names it only arrives at}, {those it waits at})}, over every program given (a pair's roles are
    named with their rank: both ranks' uses count for the role)."""
    uses = {}
    for role, program in programs.items():
        ops = list(flatten((program.before, program.body, program.after)))
        waited = {op.barrier.rpartition(":")[2] for op in ops if isinstance(op, Wait)}
        arrived = {op.barrier.rpartition(":")[2] for op in ops if isinstance(op, Arrive)} - waited
        mine = uses.setdefault(role[0], (set(), set()))
        mine[0].update(KERNEL_BARRIERS[b] for b in arrived if b in KERNEL_BARRIERS)
        mine[1].update(KERNEL_BARRIERS[b] for b in waited if b in KERNEL_BARRIERS)
    return uses


def kernel(form, mode):
    """The programs and barriers of a kernel's CTA, or of both CTAs of a cluster pair."""
    if mode != "cluster_pair":
        return form(mode)
    programs, barriers = {}, {}
    for rank in (0, 1):
        p, b = form(mode, rank)
        programs.update(p)
        barriers.update(b)
    if form is first_form:
        barriers["cluster"] = list(programs)
    return programs, barriers


# Each form and the ways of finishing dq and dk it is written for.
FORMS = {"first": (first_form, MODES), "second": (second_form, MODES), "third": (third_form, MODES)}


def main():
    failed = False
    for form_name, (form, _) in FORMS.items():
        mode = "this_cta"  # both forms write it; BUSY's finishing times are the pair's, the profiled kernel's
        step, busy = timing(*kernel(form, mode), copy_latency=COPY_LATENCY)
        print(f"{form_name} form ({mode}): modelled step {step:.1f} (% of the first form's measured step); busy a "
              "chunk: " + ", ".join(f"{role} {t:.1f}" for role, t in sorted(busy.items())))
    for form_name in ("second", "third"):
        programs, barriers = kernel(FORMS[form_name][0], "this_cta")
        step, busy = timing(with_busy(programs, SECOND_FORM_BUSY), barriers, copy_latency=COPY_LATENCY)
        print(f"{form_name} form with the second form's profiled busy times: modelled step {step:.1f}; busy a chunk: " +
              ", ".join(f"{role} {t:.1f}" for role, t in sorted(busy.items())))
    for form_name, (form, modes) in FORMS.items():
        for mode in modes:
            found = hazards(*kernel(form, mode))
            for h in found:
                print(f"hazard ({form_name} form, {mode}):", h)
            print(f"{len(found)} hazards in the {form_name} form where dq and dk are finished {mode}")
            failed = failed or bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
