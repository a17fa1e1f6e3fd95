"""A checker of a CTA's (or a cluster's) shared-memory synchronisation, for kernels split by role: every read sees the
value it means to, nothing writes a region unordered with a read or another write of it, no named barrier is
over-arrived, and nothing hangs. The kernels' own programs are written with it in role_split_sync.py.

A program is, per role (a warpgroup, or any set of warps that acts together), the list of its operations over one
chunk of the walk, plus what it runs before and after the walk. The operations:
  Read / Write    an access of a shared region (a tile, half of one, a vector), of the value of the walk step
                  `ahead` chunks on; `private` where each thread touches only rows of its own, so that the role's
                  own private accesses of the region are ordered by program order
  Copy            a cp.async of a region, issued by every thread of the role: it lands at any moment until the role's
                  next WaitCopies
  WaitCopies      cp.async.wait_group 0: the role's own copies have landed (for its own threads only)
  BulkCopy        a bulk (TMA) copy of a region that completes bytes of an mbarrier's phase: the phase of the issuing
                  role's next arrival there (arrive.expect_tx, or the copy's own with arrive=True). It lands at any
                  moment until that phase completes, and is ordered before whatever acquires the phase (an Await of it)
                  or is ordered after such an acquire
  Arrive / Wait   a named barrier's arrive (bar.arrive) and the wait for the phase of the role's last arrival;
                  Sync = Arrive + Wait (bar.sync). A cluster barrier is a barrier whose participants are the roles of
                  every CTA of the cluster; Arrive(relaxed=True) is barrier.cluster.arrive.relaxed
  Await           an mbarrier's wait for its next phase by a role that only waits there (its participants, the
                  roles that arrive, are the barrier's list), as a consumer waits on a producer's mbarrier
The order, as the PTX memory model gives it at the granularity of whole roles:
  - Threads of one role are ordered only through a barrier phase the role completes (a Sync, or a Wait after its
    Arrive): its arrival covers every thread's earlier accesses. Private accesses of one role are ordered by program
    order as well.
  - A barrier's phase k is completed by the k-th arrival of each participant; a Wait acquires what every arrival of
    that phase released: the arriving role's accesses before it, and what the role had acquired.
  - A relaxed arrive releases only the role's own earlier reads (a read's value is in a register, consumed, before a
    later instruction issues), not its writes, nor what it acquired.
  - A role's k+1-th arrival at a barrier must run after every other participant's k-th (in execution order, which
    relaxed arrivals give too): named barriers count arrivals, they have no phases, so an early arrival would complete
    the wrong phase. At an awaited barrier (an mbarrier) it must run after every awaiting role's wait for phase k-1
    instead: its phases alternate in parity, so a producer two phases ahead of a consumer would hide one from it.
The walk is expanded over a few chunks, run as a simulation in which each role advances while it is not waiting for
a phase, and each access is given the vector of role positions it is ordered after.

timing() runs the same programs with a duration for each Busy op, a copy's latency and a barrier's, and gives the
walk's step once it is steady: the critical path through the roles' work and their waits.

Run the kernels' checks with: python3 bench/prototypes/role_split_sync.py
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Read:
    region: str
    value: str = ""      # the value meant; the region's name where empty
    private: bool = False
    ahead: int = 0       # the value of the walk's step + ahead (-1: the last chunk's)


@dataclass(frozen=True)
class Write:
    region: str
    value: str = ""
    private: bool = False
    ahead: int = 0


@dataclass(frozen=True)
class Copy:
    region: str
    ahead: int = 1       # a copy fills a later chunk's tile; 0: its own chunk's


@dataclass(frozen=True)
class WaitCopies:
    pass


@dataclass(frozen=True)
class BulkCopy:
    region: str
    barrier: str         # the mbarrier whose phase the copy's bytes complete
    ahead: int = 1
    arrive: bool = True  # the issuer's arrival comes with it (False: a later one of the role's, for several copies)


def landed(barrier):
    """The name under which an event knows the bulk copies of a barrier's phases have landed (the phase number, like a
    role's position): what acquires phase k of the barrier knows its copies, and passes that on as it releases."""
    return f"{barrier} landed"


@dataclass(frozen=True)
class Busy:
    """Work that takes `time` (any unit, e.g. a share of a measured step), for timing(); the checks ignore it."""
    name: str
    time: float


@dataclass(frozen=True)
class Arrive:
    barrier: str
    relaxed: bool = False


@dataclass(frozen=True)
class Wait:
    barrier: str


@dataclass(frozen=True)
class Await:
    """An mbarrier's wait for its next phase, by a role that does not arrive there (one-way: producers arrive, the
    awaiting roles wait; across the CTAs of a cluster too)."""
    barrier: str


def Sync(barrier):
    return (Arrive(barrier), Wait(barrier))


@dataclass(frozen=True)
class Program:
    body: tuple           # one chunk's operations (nested tuples are flattened)
    before: tuple = ()    # before the walk: ops with ahead >= 1 fill the first chunk
    after: tuple = ()


def flatten(ops):
    """The operations of a tuple that may nest tuples (or of a single operation), in order."""
    if not isinstance(ops, (tuple, list)):
        yield ops
        return
    for op in ops:
        yield from flatten(op)


@dataclass
class Event:
    role: str
    index: int            # position in the role's expanded program
    step: int             # walk step (-1 before the walk, chunks after it)
    op: object
    known: dict = None    # role -> the last position of that role this event is ordered after (writes and reads)
    known_reads: dict = None  # the same for the role's reads (a relaxed arrive orders its reads only)
    lands_by: int = None  # a copy: the index of the role's WaitCopies it lands by
    phase: int = None     # a bulk copy: the phase of its barrier it lands by


def expand(program, chunks):
    """The role's events over a walk of `chunks` chunks; ops for a chunk before the walk's first or past its last are
    not issued (the kernel's `if (j > 0)`)."""
    ops = [(-1, op) for op in flatten(program.before)]
    for step in range(chunks):
        for op in flatten(program.body):
            if not 0 <= step + getattr(op, "ahead", 0) < chunks:
                continue  # no such chunk: the first's has no last one, the last's no next one
            ops.append((step, op))
    ops += [(chunks, op) for op in flatten(program.after)]
    return ops


def join(a, b):
    out = dict(a)
    for role, position in b.items():
        out[role] = max(out.get(role, -1), position)
    return out


class Phases:
    """The phases of a walk's barriers: each role's arrivals at each (with what they carry), and the phase each wait
    is for: a Wait's, that of the role's last arrival; an Await's, the next after those it has waited for."""

    def __init__(self, barriers, roles):
        self.barriers = barriers
        self.arrivals = {b: {r: [] for r in participants} for b, participants in barriers.items()}
        self.last = {role: {} for role in roles}
        self.awaited = {role: {} for role in roles}

    def arrive(self, role, barrier, carried):
        """Records the arrival; returns its phase."""
        k = len(self.arrivals[barrier][role])
        self.arrivals[barrier][role].append(carried)
        self.last[role][barrier] = k
        return k

    def phase(self, role, op):
        """The phase a Wait or an Await waits for (None: a Wait at a barrier the role has not arrived at)."""
        if isinstance(op, Await):
            return self.awaited[role].get(op.barrier, 0)
        return self.last[role].get(op.barrier)

    def complete(self, barrier, k):
        return all(len(self.arrivals[barrier][r]) > k for r in self.barriers[barrier])

    def carried(self, barrier, k):
        """What every arrival of phase k carries (the phase complete)."""
        return [self.arrivals[barrier][r][k] for r in self.barriers[barrier]]

    def passed(self, role, op, k):
        if isinstance(op, Await):
            self.awaited[role][op.barrier] = k + 1


def walk_roles(streams, advance):
    """Runs every role's stream, each as far as it can: advance(role, index, step, op) does an op and says whether it
    could (False: a wait whose phase has not completed). Returns {role: (step, op)} for the roles left waiting."""
    pc = {role: 0 for role in streams}
    progressed = True
    while progressed:
        progressed = False
        for role, stream in streams.items():
            while pc[role] < len(stream) and advance(role, pc[role], *stream[pc[role]]):
                pc[role] += 1
                progressed = True
    return {role: stream[pc[role]] for role, stream in streams.items() if pc[role] < len(stream)}


def simulate(programs, barriers, chunks):
    """Runs every role's expanded program; returns (events by role, problems). `barriers` maps each barrier's name to
    its participating roles (those that arrive there)."""
    streams = {role: expand(program, chunks) for role, program in programs.items()}
    events = {role: [] for role in programs}
    known = {role: {} for role in programs}        # acquired so far, per role
    known_reads = {role: {} for role in programs}
    happened = {role: {} for role in programs}     # what has run before, barriers relaxed or not (execution order)
    phases = Phases(barriers, programs)             # arrivals carry (index, released, released reads, ran)
    pending_copies = {role: [] for role in programs}
    pending_bulk = {}  # (role, barrier) -> its bulk copies that land by the phase of its next arrival there
    awaiters = {b: {role for role, program in programs.items()
                    for op in flatten((program.before, program.body, program.after)) if op == Await(b)}
                for b in barriers}
    awaited = {b: {role: [] for role in awaiters[b]} for b in barriers}  # per awaiting role: its Awaits' indices
    problems = []

    def arrival_problem(role, step, op):
        """Whether this arrival may complete an earlier phase than its own (the rules in the module's docstring)."""
        k = len(phases.arrivals[op.barrier][role])
        if k > 1:
            for r in awaiters[op.barrier]:
                waits = awaited[op.barrier][r]
                if len(waits) < k - 1 or happened[role].get(r, -1) < waits[k - 2]:
                    return (f"{role}'s arrival {k} at {op.barrier} (step {step}) is not ordered after {r}'s wait "
                            f"for phase {k - 2}: the mbarrier's parity would hide a phase")
        if k > 0:
            for r in barriers[op.barrier]:
                mine = phases.arrivals[op.barrier][r]
                if r != role and (len(mine) < k or happened[role].get(r, -1) < mine[k - 1][0]):
                    return (f"{role}'s arrival {k} at {op.barrier} (step {step}) is not ordered after {r}'s arrival "
                            f"{k - 1}: it may complete phase {k - 1}")
        return None

    def advance(role, index, step, op):
        event = None
        if isinstance(op, BulkCopy):  # it lands by the phase of the role's next arrival at its barrier (or its own)
            event = Event(role, index, step, op, dict(known[role]), dict(known_reads[role]))
            pending_bulk.setdefault((role, op.barrier), []).append(event)
        if isinstance(op, (Wait, Await)):
            k = phases.phase(role, op)
            if k is None:
                problems.append(f"{role} waits on {op.barrier} without arriving")
                k = 0
            if not phases.complete(op.barrier, k):
                return False
            phases.passed(role, op, k)
            if isinstance(op, Await):
                awaited[op.barrier][role].append(index)
            for _, released, released_reads, ran in phases.carried(op.barrier, k):
                known[role] = join(known[role], released)
                known_reads[role] = join(known_reads[role], released_reads)
                happened[role] = join(happened[role], ran)
        elif isinstance(op, Arrive) or isinstance(op, BulkCopy) and op.arrive:
            if role not in barriers[op.barrier]:
                problems.append(f"{role} arrives at {op.barrier}, which it is not a participant of")
            else:
                problem = arrival_problem(role, step, op)
                if problem:
                    problems.append(problem)
                if getattr(op, "relaxed", False):
                    released, released_reads = {}, {role: index}
                else:
                    released = join(known[role], {role: index})
                    released_reads = join(known_reads[role], released)
                k = len(phases.arrivals[op.barrier][role])
                bulk = pending_bulk.pop((role, op.barrier), [])
                for copy in bulk:  # their bytes complete this phase: what acquires it knows they have landed
                    copy.phase = k
                if bulk:
                    released = join(released, {landed(op.barrier): k})
                phases.arrive(role, op.barrier, (index, released, released_reads, join(happened[role], {role: index})))
        elif isinstance(op, WaitCopies):
            for copy in pending_copies[role]:
                copy.lands_by = index
            pending_copies[role] = []
        if event is None:
            event = Event(role, index, step, op, dict(known[role]), dict(known_reads[role]))
        if isinstance(op, Copy):
            pending_copies[role].append(event)
        events[role].append(event)
        return True

    for role, (step, op) in walk_roles(streams, advance).items():
        problems.append(f"hang: {role} waits forever at step {step} on {op}")
    for role in programs:
        for copy in pending_copies[role]:
            problems.append(f"{role}'s copy of {copy.op.region} (step {copy.step}) is never waited for")
    for (role, barrier), copies in pending_bulk.items():
        for copy in copies:
            problems.append(f"{role}'s bulk copy of {copy.op.region} (step {copy.step}) completes no phase of "
                            f"{barrier}")
    return events, problems


def ordered_before(x, y):
    """Whether event x is ordered before event y (both accesses or copies; a copy's write spans its issue to its
    wait)."""
    if x.op.__class__ is Copy:
        if x.lands_by is None:
            return False
        return y.known.get(x.role, -1) > x.lands_by
    if x.op.__class__ is BulkCopy:
        return x.phase is not None and y.known.get(landed(x.op.barrier), -1) >= x.phase
    source = y.known_reads if x.op.__class__ is Read else y.known
    if source.get(x.role, -1) > x.index:
        return True
    return (x.role == y.role and x.index < y.index and getattr(x.op, "private", False)
            and getattr(y.op, "private", False))


def written_value(e):
    op = e.op
    if isinstance(op, (Copy, BulkCopy)):
        return (op.region, e.step + op.ahead)
    return (op.value or op.region, e.step + op.ahead)


def hazards(programs, barriers, chunks=3):
    """Every problem of the programs' synchronisation, as sentences (none where it is right)."""
    events, found = simulate(programs, barriers, chunks)
    everything = [e for role in events for e in events[role]]
    writes = [e for e in everything if isinstance(e.op, (Write, Copy, BulkCopy))]
    reads = [e for e in everything if isinstance(e.op, Read)]
    by_region = {}
    for w in writes:
        by_region.setdefault(w.op.region, []).append(w)
    for ws in by_region.values():
        for i, x in enumerate(ws):
            for y in ws[i + 1:]:
                if not (ordered_before(x, y) or ordered_before(y, x)):
                    found.append(f"unordered writes of {x.op.region}: {describe(x)} and {describe(y)}")
    for r in reads:
        before = []
        for w in by_region.get(r.op.region, ()):
            if ordered_before(w, r):
                before.append(w)
            elif not ordered_before(r, w):
                found.append(f"{describe(r)} is unordered with {describe(w)}")
        meant = (r.op.value or r.op.region, r.step + r.op.ahead)
        if not before:
            found.append(f"{describe(r)}: nothing wrote {r.op.region} before it")
            continue
        last = [w for w in before if not any(ordered_before(w, v) for v in before if v is not w)]
        if len(last) == 1 and written_value(last[0]) != meant:
            found.append(f"{describe(r)} sees {written_value(last[0])}, not {meant}")
    return sorted(set(found))


def describe(e):
    op = e.op
    kind = type(op).__name__.lower()
    value = getattr(op, "value", "") or op.region
    return f"step {e.step} {e.role} {kind} {op.region} ({value})"


def timing(programs, barriers, chunks=8, copy_latency=0.0, barrier_latency=0.0):
    """The steady step of the walk: each role runs its Busy ops in turn; a Wait (or Await) ends when the last arrival of
    its phase has come, plus barrier_latency; WaitCopies when the role's copies issued since its last wait have landed,
    each copy_latency after its issue, as a bulk copy completes its barrier's phase. Returns (the mean step over the
    walk's second half, {role: busy time a chunk})."""
    streams = {role: expand(program, chunks) for role, program in programs.items()}
    clock = {role: 0.0 for role in programs}
    phases = Phases(barriers, programs)  # arrivals carry their time
    landing = {role: 0.0 for role in programs}
    bulk_landing = {}  # (role, barrier) -> when the bulk copies its next arrival there completes have landed
    step_ends = {role: {} for role in programs}
    busy = {role: 0.0 for role in programs}

    def advance(role, index, step, op):
        if isinstance(op, (Wait, Await)):
            k = phases.phase(role, op)
            if not phases.complete(op.barrier, k):
                return False
            phases.passed(role, op, k)
            clock[role] = max(clock[role], max(phases.carried(op.barrier, k)) + barrier_latency)
        elif isinstance(op, Arrive):
            phases.arrive(role, op.barrier, max(clock[role], bulk_landing.pop((role, op.barrier), 0.0)))
        elif isinstance(op, Busy):
            clock[role] += op.time
            if 0 <= step < chunks:
                busy[role] += op.time
        elif isinstance(op, Copy):
            landing[role] = max(landing[role], clock[role] + copy_latency)
        elif isinstance(op, BulkCopy):  # the phase it completes waits for its bytes
            key = (role, op.barrier)
            bulk_landing[key] = max(bulk_landing.get(key, 0.0), clock[role] + copy_latency)
            if op.arrive:
                phases.arrive(role, op.barrier, bulk_landing.pop(key))
        elif isinstance(op, WaitCopies):
            clock[role] = max(clock[role], landing[role])
        step_ends[role][step] = clock[role]
        return True

    stuck = walk_roles(streams, advance)
    if stuck:
        raise ValueError(f"the walk hangs: {sorted(stuck)} wait forever (run hazards() for where)")
    half = chunks // 2
    ends = [max(step_ends[role][step] for role in programs) for step in (half - 1, chunks - 1)]
    return (ends[1] - ends[0]) / (chunks - half), {role: t / chunks for role, t in busy.items()}
