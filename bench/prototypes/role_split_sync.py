"""The shared memory and synchronisation of gdn/cuda/role_split_backward.cu, written as the roles' programs and checked
by sync_model.py: every read sees its own chunk's value, no access is unordered with a write of its region, no barrier
is over-arrived, nothing hangs.

The kernel's three roles (S: the state, K: the chain, A: the square work) walk the same chunks. The first form meets
at a barrier of all three before each of a chunk's five stages (`stage`); the square role has a barrier of its own
(`square`). S issues every copy and waits for all of them before the barriers of stages 0 and 1. Where dq and dk are
finished by a cluster pair, both CTAs' roles are modelled, and their partial sums pass through the partner's -E dcorr
and dV tiles (regions named by rank) between cluster barriers (PairExchange).

Run: python3 bench/prototypes/role_split_sync.py   (prints the hazards; exits 1 if there are any)
"""
import sys

from sync_model import Arrive, Copy, Program, Read, Sync, Wait, WaitCopies, Write, hazards

# Who finishes dq and dk (the kernel's InputGrads).
MODES = ("per_value_head", "this_cta", "cluster_pair")
# A region that holds two values side by side: an access of the whole tile touches both halves (the kernel's dDelta
# tile holds dT^T and X side by side, then F in dT^T's place).
HALVES = {"ddelta": ("ddelta.lo", "ddelta.hi")}


def whole(access):
    """An access of a tile, split into its halves where it has two."""
    halves = HALVES.get(access.region)
    if halves is None:
        return (access,)
    return tuple(type(access)(half, access.value or access.region, access.private, access.ahead) for half in halves)


def first_form(mode, rank=0):
    """One CTA's programs, as the kernel's walks run them (rank: of a cluster pair). Regions and roles are named
    with the rank where there is a pair."""
    pair = mode == "cluster_pair"
    r = lambda name: f"{rank}:{name}" if pair else name
    partner = lambda name: f"{1 - rank}:{name}"
    R = lambda region, value="", private=False, ahead=0: whole(Read(r(region), value, private, ahead))
    W = lambda region, value="", private=False, ahead=0: whole(Write(r(region), value, private, ahead))
    C = lambda region, ahead=1: Copy(r(region), ahead)
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
              C("k", ahead=0), (C("q", ahead=0),) if late_queries else (),
              W("ds", "dsn", private=True), R("s"), R("gate_in"), W("state_dots", private=True),
              WaitCopies(), stage,  # 1: dS += scale Q^T diag(E) dO
              R("do"), R("gate_in"), R("q"),
              before_overwrite, stage,  # 2
              C("p"),
              stage,  # 3: dS -= K^T diag(E) dcorr
              C("v"), R("edcorr"), R("k"),
              stage,  # 4
              rest, publish(False), read_done),
        after=end)
    chain = Program(
        before=begin,
        body=(stage,  # 0
              stage,  # 1: dDelta = P^T dO + diag(D) K dS', its D terms
              R("do"), R("p"), R("ds", "dsn"), R("k"), R("gate_out"), R("delta"),
              W("delta_parts", private=True), W("ddelta", private=True),
              before_overwrite, stage,  # 2: T^T dDelta, dcorr; dbeta's sums; -E dcorr and dV to tiles
              R("t"), R("v", "corr"), R("beta"), R("gate_in"),
              W("beta_parts", private=True), W("edcorr", private=True), W("dv", private=True),
              stage,  # 3: dK's state terms and M^T Q; dV out
              R("delta"), R("ds", "dsn"), R("gate_out"), R("edcorr"), R("s"), R("m"), R("q"), R("dv"),
              stage,  # 4: dK += F K + F^T K
              R("ddelta.lo", "f"), R("k"),
              finish("K", "k", summing=1)),
        after=end)
    square_work = Program(
        before=begin,
        body=(stage,  # 0: dP, M, G's sums
              R("do"), R("delta"), R("gamma"), R("p"), W("m", private=True), W("g_parts", private=True),
              stage,  # 1: K S; corr over V's tile
              R("k"), R("s"), R("gate_in"), R("v", private=True), W("v", "corr", private=True),
              before_overwrite, stage,  # 2: K K^T; dT
              R("k"), R("ddelta"), R("v", "corr"), R("beta"),
              square,
              W("ddelta.lo", "dt", private=True),
              stage,  # 3: X; -dA; the inverse's backward; dQ
              R("t"), R("ddelta.lo", "dt"), W("ddelta.hi", "x", private=True),
              R("edcorr"), W("corr_dots", private=True),
              square,
              R("ddelta.hi", "x"), R("t"), R("gamma"), R("beta"),
              W("ddelta.lo", "f", private=True), W("e_sums", private=True), W("e_parts", private=True),
              R("do"), R("s"), R("gate_in"), R("q"), W("q_dots", private=True), R("m"), R("k"),
              () if pair else finish("A", "q", summing=0),
              stage,  # 4: dgamma and dbeta
              R("delta_parts"), W("scratch", private=True),
              square,
              *(R(region) for region in ("scratch", "state_dots", "q_dots", "corr_dots", "g_parts", "e_parts",
                                         "e_sums", "beta_parts")),
              W("dgamma", private=True),
              square,
              R("dgamma"),
              finish("A", "q", summing=0) if pair else ()),
        after=end)
    name = lambda role: f"{role}{rank}" if pair else role
    programs = {name("S"): state, name("K"): chain, name("A"): square_work}
    barriers = {r("stage"): [name(role) for role in "SKA"], r("square"): [name("A")]}
    return programs, barriers


def kernel(form, mode):
    """The programs and barriers of a kernel's CTA, or of both CTAs of a cluster pair."""
    if mode != "cluster_pair":
        return form(mode)
    programs, barriers = {}, {}
    for rank in (0, 1):
        p, b = form(mode, rank)
        programs.update(p)
        barriers.update(b)
    barriers["cluster"] = list(programs)
    return programs, barriers


FORMS = {"first": first_form}


def main():
    failed = False
    for form_name, form in FORMS.items():
        for mode in MODES:
            found = hazards(*kernel(form, mode))
            for h in found:
                print(f"hazard ({form_name} form, {mode}):", h)
            print(f"{len(found)} hazards in the {form_name} form where dq and dk are finished {mode}")
            failed = failed or bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
