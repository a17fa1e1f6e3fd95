"""The shared memory of gdn/cuda/role_split_backward.cu and its synchronisation, checked on the CPU: every read of a
region sees the value it means to (this chunk's, from its writer or its copy), and nothing writes the region unordered
with that read; no two writes of a region are unordered.

The kernel's order, as modelled here. Its three roles (S: the state, K: the chain, A: the square work) walk the same
chunks and meet at a barrier before each of the chunk's five stages; an access of one stage is ordered before an
access of another role in a later stage (the barrier fences shared memory for wgmma too), and unordered with the other
roles' accesses of the same stage. Within a role, accesses are in program order across the role's own barriers (A's
`square_barrier`), and within one phase only where each warp touches rows of its own (`private`). Copies (cp.async)
are issued by S: a copy may land at any moment from its issue until S's next `cp_async_wait<0>` (before the barriers
that open stages 0 and 1), so it is ordered after what precedes its issue's stage and before the stages after that
wait.

Run: python3 bench/prototypes/role_split_sync.py   (prints the hazards; exits 1 if there are any)
"""
import sys
from dataclasses import dataclass

STAGES = 5
# Stages whose opening barrier S waits for all its copies before (cp_async_wait<0>).
WAITS_BEFORE = (0, 1)
# A region is a tile, or half of one where two values share it (the kernel's dDelta tile holds dT^T and X side by
# side, then F in dT^T's place); a whole-tile access touches both halves.
HALVES = {"ddelta": ("ddelta.lo", "ddelta.hi")}


@dataclass(frozen=True)
class Access:
    stage: int
    role: str
    phase: int      # the role's barriers within the stage passed before it
    kind: str       # "read", "write" or "copy" (issued by S; lands by S's next wait)
    region: str
    value: str      # what the region holds: read, the value meant; write/copy, the value written
    chunk: int = 0  # relative to the walk's chunk: copies fill the next one's (-1)
    private: bool = False  # each warp reads or writes only its own rows


# Who finishes dq and dk (the kernel's InputGrads), and for a cluster pair each rank's plan.
PLANS = (("per_value_head", 0), ("this_cta", 0), ("cluster_pair", 0), ("cluster_pair", 1))
# Phases of stage 4 around the cluster pair's exchange: the partials are written before every thread of both CTAs
# meets (PUBLISH), and the partner reads them after it.
PUBLISH, PARTNER_READS = 8, 9
# The stage of the next chunk whose barrier every thread of a cluster pair passes only after the partner's arrival
# that follows its reads (PairExchange::before_overwrite): the first that writes the exchange tiles again.
OVERWRITE_WAIT_STAGE = 2


def kernel_plan(mode="cluster_pair", rank=0):
    """The kernel's accesses of one chunk, role by role, where `mode` finishes dq and dk (`rank`: of a cluster pair)."""
    R = lambda stage, role, region, value, phase=0, private=False: Access(stage, role, phase, "read", region, value,
                                                                          0, private)
    W = lambda stage, role, region, value, phase=0, private=False: Access(stage, role, phase, "write", region, value,
                                                                          0, private)
    copy = lambda stage, region, chunk=-1: Access(stage, "S", 0, "copy", region, region, chunk)
    pair = mode == "cluster_pair"
    plan = [
        # S: dS' to its tile, the state dot; the copies (Q's at stage 0 of its own chunk where rank 0 of a cluster pair
        # finishes dq at stage 4)
        copy(0, "k", chunk=0), *([copy(0, "q", chunk=0)] if pair else [copy(4, "q")]),
        W(0, "S", "ds", "dsn", private=True), R(0, "S", "s", "s"), R(0, "S", "gate_in", "gate_in"),
        R(1, "S", "do", "do"), R(1, "S", "q", "q"), R(1, "S", "gate_in", "gate_in"),
        copy(2, "p"),
        copy(3, "v"), R(3, "S", "edcorr", "edcorr"), R(3, "S", "k", "k"),
        *[copy(4, region) for region in ("do", "t", "delta", "s", "gamma", "gate_in", "gate_out")],
        Access(4, "S", 0, "write", "beta", "beta", -1),  # a plain load and store: beta's dtype varies
        # K: the chain and dK
        R(1, "K", "do", "do"), R(1, "K", "p", "p"), R(1, "K", "ds", "dsn"), R(1, "K", "k", "k"),
        R(1, "K", "delta", "delta"), R(1, "K", "gate_out", "gate_out"), W(1, "K", "ddelta", "ddelta", private=True),
        R(2, "K", "t", "t"), R(2, "K", "v", "corr"), R(2, "K", "beta", "beta"), R(2, "K", "gate_in", "gate_in"),
        W(2, "K", "edcorr", "edcorr", private=True), W(2, "K", "dv", "dv", private=True),
        R(3, "K", "delta", "delta"), R(3, "K", "ds", "dsn"), R(3, "K", "edcorr", "edcorr"), R(3, "K", "s", "s"),
        R(3, "K", "m", "m"), R(3, "K", "q", "q"), R(3, "K", "gate_out", "gate_out"), R(3, "K", "dv", "dv"),
        R(4, "K", "ddelta.lo", "f"), R(4, "K", "k", "k"),  # F K + F^T K; the norm's backward of dk
        # A: the square work, K S and corr (over V, each warp its rows), dQ
        R(0, "A", "do", "do"), R(0, "A", "delta", "delta"), R(0, "A", "gamma", "gamma"), R(0, "A", "p", "p"),
        W(0, "A", "m", "m", private=True),
        R(1, "A", "k", "k"), R(1, "A", "s", "s"), R(1, "A", "gate_in", "gate_in"),
        R(1, "A", "v", "v", private=True), W(1, "A", "v", "corr", private=True),
        R(2, "A", "k", "k"), R(2, "A", "ddelta", "ddelta"), R(2, "A", "v", "corr"), R(2, "A", "beta", "beta"),
        W(2, "A", "ddelta.lo", "dt", phase=1, private=True),  # after the square role's barrier
        R(3, "A", "t", "t"), R(3, "A", "ddelta.lo", "dt"), W(3, "A", "ddelta.hi", "x", private=True),
        R(3, "A", "edcorr", "edcorr"),
        R(3, "A", "ddelta.hi", "x", phase=1), R(3, "A", "t", "t", phase=1), R(3, "A", "gamma", "gamma", phase=1),
        R(3, "A", "beta", "beta", phase=1), W(3, "A", "ddelta.lo", "f", phase=1, private=True),
        *[R(3, "A", region, region, phase=1) for region in ("do", "s", "q", "m", "k", "gate_in")],  # dQ
        # the per-token partial sums, each a vector written by one role and summed by A at stage 4
        W(0, "S", "state_dots", "state_dots", private=True), W(1, "K", "delta_parts", "delta_parts", private=True),
        W(2, "K", "beta_parts", "beta_parts", private=True), W(0, "A", "g_parts", "g_parts", private=True),
        W(3, "A", "q_dots", "q_dots", phase=1, private=True), W(3, "A", "corr_dots", "corr_dots", private=True),
        W(3, "A", "e_sums", "e_sums", phase=1, private=True), W(3, "A", "e_parts", "e_parts", phase=1, private=True),
        R(4, "A", "delta_parts", "delta_parts"), W(4, "A", "scratch", "scratch", private=True),
        *[R(4, "A", region, region, phase=1) for region in ("scratch", "state_dots", "q_dots", "corr_dots",
                                                             "g_parts", "e_parts", "e_sums", "beta_parts")],
        W(4, "A", "dgamma", "dgamma", phase=1, private=True), R(4, "A", "dgamma", "dgamma", phase=2),
    ]
    if pair:
        # The CTA's partial over its -E dcorr and dV tiles (rank 0's dK by K, rank 1's dQ by A), the partner's read of
        # them, and this rank's norm backward of what it finishes (rank 0 dq, rank 1 dk) from its own Q or K tile.
        writer, finisher, tile = ("K", "A", "q") if rank == 0 else ("A", "K", "k")
        plan += [W(4, writer, half, "partial", phase=PUBLISH, private=True) for half in ("edcorr", "dv")]
        plan += [Access(4, "partner", PARTNER_READS, "read", half, "partial") for half in ("edcorr", "dv")]
        plan += [R(4, finisher, tile, tile, phase=PARTNER_READS)]
    elif mode == "this_cta":
        plan += [R(3, "A", "q", "q", phase=1)]
    return plan


def expand(plan, chunks):
    """Every access of a walk over `chunks` chunks, as (walk step, access), whole tiles split into their halves; the
    copies that fill the first chunk are issued before the walk (step -1, stage STAGES - 1)."""
    events = []
    for step in range(chunks):
        for a in plan:
            for region in HALVES.get(a.region, (a.region,)):
                events.append((step, Access(a.stage, a.role, a.phase, a.kind, region, a.value, a.chunk, a.private)))
    for a in plan:
        if a.kind in ("copy", "write") and a.chunk == -1:
            events.append((-1, a))
    return events


def position(step, a):
    return (step, a.stage)


def copy_lands_by(step, a):
    """The first (step, stage) whose accesses a copy issued at (step, a.stage) is ordered before."""
    for stage in range(a.stage + 1, STAGES):
        if stage in WAITS_BEFORE:
            return (step, stage)
    return (step + 1, min(WAITS_BEFORE))


def ordered_before(x, y):
    """Whether access x (with its walk step) is ordered before access y."""
    (sx, ax), (sy, ay) = x, y
    # The partner CTA is ordered with this one only by the cluster barriers: every thread meets at stage 4 after the
    # partials are written (PUBLISH), and waits, before the barrier of the next chunk's stage 2, for the partner's
    # arrival after its reads.
    if ax.role == "partner":
        return sy > sx + 1 or (sy == sx + 1 and ay.stage >= OVERWRITE_WAIT_STAGE)
    if ay.role == "partner":
        return sx < sy or (sx == sy and (ax.stage < 4 or ax.phase <= PUBLISH))
    if ax.kind == "copy":
        return copy_lands_by(sx, ax) <= position(sy, ay)
    if ay.kind == "copy":  # ordered before the issue: an earlier stage, or earlier in S's own program
        if ax.role == "S":
            return (sx, ax.stage, ax.phase) < (sy, ay.stage, ay.phase) or (
                (sx, ax.stage) == (sy, ay.stage) and ax.kind != "copy")
        return position(sx, ax) < position(sy, ay)
    if ax.role == ay.role:
        if (sx, ax.stage, ax.phase) != (sy, ay.stage, ay.phase):
            return (sx, ax.stage, ax.phase) < (sy, ay.stage, ay.phase)
        return False  # one phase of one role: ordered only row by row (see private)
    return position(sx, ax) < position(sy, ay)


def hazards(plan, chunks=3):
    """The reads that may see another value than theirs, and the writes unordered with each other."""
    events = expand(plan, chunks)
    found = []
    writes = [e for e in events if e[1].kind in ("write", "copy")]
    for i, x in enumerate(writes):
        for y in writes[i + 1:]:
            if x[1].region != y[1].region or x is y:
                continue
            same_rows = x[1].private and y[1].private and x[1].role == y[1].role and x[0] == y[0] and \
                (x[1].stage, x[1].phase) == (y[1].stage, y[1].phase)
            if not (ordered_before(x, y) or ordered_before(y, x) or same_rows):
                found.append(f"unordered writes of {x[1].region}: {describe(x)} and {describe(y)}")
    for r in (e for e in events if e[1].kind == "read"):
        step, a = r
        meant = (a.value, step)  # the value of the read's own chunk
        before, unordered = [], []
        for w in (e for e in writes if e[1].region == a.region):
            if ordered_before(w, r):
                before.append(w)
            elif not ordered_before(r, w):
                row_private = w[1].role == a.role and w[1].private and a.private and w[0] == step
                if not row_private:
                    unordered.append(w)
        for w in unordered:
            found.append(f"{describe(r)} is unordered with {describe(w)}")
        if not before:
            # the walk's first chunk reads what the copies issued before it wrote
            found.append(f"{describe(r)}: nothing wrote {a.region} before it")
            continue
        last = max(before, key=lambda w: order_key(w))
        if (last[1].value, value_chunk(last)) != meant:
            found.append(f"{describe(r)} sees {last[1].value} of step {value_chunk(last)}, not its own")
    return sorted(set(found))


def value_chunk(w):
    """The walk step whose chunk a write's value belongs to (a copy issued at step s fills step s + 1's)."""
    step, a = w
    return step - a.chunk


def order_key(w):
    """A total order of the writes of one region that ordered_before agrees with (hazards checks they are ordered)."""
    step, a = w
    if a.kind == "copy":
        return copy_lands_by(step, a) + (-1,)
    return (step, a.stage, a.phase)


def describe(e):
    step, a = e
    return f"step {step} stage {a.stage} {a.role} {a.kind} {a.region} ({a.value})"


def main():
    failed = False
    for mode, rank in PLANS:
        found = hazards(kernel_plan(mode, rank))
        for h in found:
            print(f"hazard ({mode}, rank {rank}):", h)
        print(f"{len(found)} hazards in the kernel's plan where dq and dk are finished {mode}"
              + (f", rank {rank}" if mode == "cluster_pair" else ""))
        failed = failed or bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
