"""A stage schedule for a fused backward split by role, FlashQLA's way (bench/NOTES.md, "FlashQLA's Hopper backward,
read again"), over our kernel's math and inputs, checked on the CPU before any CUDA is written.

Our fused kernel runs two warpgroups, each over its 64 rows of V, and both run the whole chain. This schedule gives the
work to three compute warpgroups by role instead, plus a producer:
    S  holds dS' (float32, in registers) and updates it; it is the only role that touches it
    K  runs the rest of the chain (K dS', dDelta, T^T dDelta, dcorr) and dK
    A  runs the chunk's square work (K S and corr, dP, M, dQ, dT, the inverse's backward, K K^T)
The inputs are those the fused kernel reads today: Q, K, V, dO, the gates and beta; prepare's P (scale and Gamma
folded in) and T (gated); the recompute pass's S (the state entering the chunk) and Delta.

Within a stage the roles run side by side. A step may read its own role's registers, or a shared tile written in an
earlier stage (after a barrier). The checks, per chunk:
  1. The schedule computes the right gradients: run in float64 step by step, against the recurrence's reverse
     (fused_backward.py's).
  2. Every step reads only what it may. What its role holds, what an earlier stage put in a shared tile, or the
     chunk's inputs.
  3. The shared bytes live at once, at the busiest stage, fit the SM: 227 KB less the vectors and the 1 KB of
     alignment. Tiles are single-buffered, as FlashQLA's are. An input's tile is refilled for the next chunk after its
     last reader; the printed refill windows say how many stages each load has to land before its first reader.
  4. Per stage and role: the products' multiply-adds, the element-wise elements, and which steps carry the chain.

Run: python3 bench/prototypes/role_split_backward.py   (prints the errors and the tables; exits 1 on a failed check)
"""
import sys
from dataclasses import dataclass, field

import numpy as np

from fused_backward import reverse_over_chunks, worst_against_reverse
from segmented_state import C

SMEM_BYTES = 227 * 1024
VECTOR_BYTES = 4 * 1024 + 1024  # the per-token vectors (gates, beta, partial sums) and the 1 KB alignment
ROLES = ("S", "K", "A")
# Dense bf16 multiply-adds an SM retires a cycle at the H100/H200 peak (989 TFLOP/s over 132 SMs at ~1.8-2 GHz).
PEAK_MACS_PER_CYCLE = 2000


@dataclass
class Step:
    stage: int
    role: str
    name: str
    reads: tuple
    writes: tuple   # (name, "reg"), (name, "tile") or (name, "vec"): what another role reads must be in shared memory
    macs: int = 0   # multiply-adds of its products
    elems: int = 0  # elements of its element-wise work
    chain: bool = False
    fn: object = field(default=None, repr=False)


def schedule(n, Kd, V):
    """The steps of one chunk, as the role split's first form ran them in five stages (the math of every form; the
    second form's order, in gdn/cuda/role_split_backward.cu now, is role_split_sync.py's). Names in lower case are
    per-chunk values; `dsn` is dS' (carried), `ds` what becomes the next chunk's dS'; `edcorr` holds -E dcorr, as the
    kernel's tile."""
    sq, sk, sv = n * n, n * Kd, n * V
    steps = [
        # stage 0: the state's tile for the others; dP and M
        Step(0, "S", "stage dS' as a bf16 tile; E_n sum(S * dS')", ("dsn", "s"), (("dsn_tile", "tile"), ("sdot", "vec")),
             elems=2 * Kd * V, chain=True,
             fn=lambda v: dict(dsn_tile=v["dsn"], sdot=v["E"][-1] * np.sum(v["s"] * v["dsn"]))),
        Step(0, "S", "dS = E_n dS'", ("dsn",), (("ds", "reg"),), elems=Kd * V,
             fn=lambda v: dict(ds=v["E"][-1] * v["dsn"])),
        Step(0, "A", "dP = dO Delta^T; M = scale lower(dP * Gamma) to its tile; the P gate term", ("do", "delta", "p"),
             (("m", "tile"), ("gp", "reg")), macs=n * n * V, elems=2 * sq,
             fn=lambda v: (lambda dod: dict(m=v["scale"] * np.tril(dod * v["Gamma"]), gp=np.tril(dod * v["p"])))(
                 v["do"] @ v["delta"].T)),
        # stage 1: the chain's first product
        Step(1, "S", "dS += scale Q^T diag(E) dO", ("q", "do", "ds"), (("ds", "reg"),), macs=Kd * V * n, elems=sv,
             fn=lambda v: dict(ds=v["ds"] + v["scale"] * v["q"].T @ (v["E"][:, None] * v["do"]))),
        Step(1, "K", "dDelta = P^T dO + diag(D) K dS', half by half; dD", ("p", "do", "k", "dsn_tile", "delta"),
             (("ddelta", "tile"), ("kds_dot", "vec")), macs=n * n * V + n * Kd * V, elems=2 * sv, chain=True,
             fn=lambda v: dict(ddelta=v["p"].T @ v["do"] + v["D"][:, None] * (v["k"] @ v["dsn_tile"]),
                               kds_dot=v["D"] * np.sum((v["k"] @ v["dsn_tile"]) * v["delta"], axis=1))),
        Step(1, "A", "K S; corr = V - diag(E) K S (in V's tile)", ("k", "s", "v"),
             (("ks", "reg"), ("corr", "tile")), macs=n * Kd * V, elems=sv,
             fn=lambda v: dict(ks=v["k"] @ v["s"], corr=v["v"] - v["E"][:, None] * (v["k"] @ v["s"]))),
        # stage 2: the chain's second product; dT
        Step(2, "K", "T^T dDelta; dcorr = diag(beta) .; -E dcorr and dV to tiles; rowsum(corr * T^T dDelta)",
             ("t", "ddelta", "corr"), (("edcorr", "tile"), ("dv", "tile"), ("db1", "vec")),
             macs=n * V * n, elems=3 * sv, chain=True,
             fn=lambda v: dict(edcorr=-v["E"][:, None] * v["b"][:, None] * (v["t"].T @ v["ddelta"]),
                               dv=v["b"][:, None] * (v["t"].T @ v["ddelta"]),
                               db1=np.sum(v["corr"] * (v["t"].T @ v["ddelta"]), axis=1))),
        Step(2, "A", "K K^T", ("k",), (("kk", "reg"),), macs=n * n * Kd, fn=lambda v: dict(kk=v["k"] @ v["k"].T)),
        Step(2, "A", "dT = dDelta corr^T diag(beta), to a tile in dDelta's", ("ddelta", "corr"), (("dt", "tile"),),
             macs=n * n * V, elems=sq,
             fn=lambda v: dict(dt=(v["ddelta"] @ v["corr"].T) * v["b"][None, :])),
        # stage 3: the chain's last product; the inverse's backward; dK's state terms
        Step(3, "S", "dS += K^T (-E dcorr) (the next chunk's dS')", ("k", "edcorr", "ds"), (("ds", "reg"),),
             macs=Kd * V * n, chain=True,
             fn=lambda v: dict(ds=v["ds"] + v["k"].T @ v["edcorr"])),
        Step(3, "A", "X = T^T dT, -dA = X T^T (strictly lower); F = beta dA Gamma (in dT's tile); the A gate term; "
                     "dbeta's part; rowsum(-E dcorr * K S)",
             ("t", "dt", "kk", "edcorr", "ks"), (("f", "tile"), ("ga", "reg"), ("db2", "reg"), ("corr_dot", "reg")),
             macs=2 * n * n * n, elems=4 * sq + sv,
             fn=lambda v: (lambda da: dict(
                 f=v["b"][:, None] * da * v["Gamma"], ga=v["b"][:, None] * da * v["kk"] * v["Gamma"],
                 db2=np.sum(da * v["kk"] * v["Gamma"], axis=1),
                 corr_dot=np.sum(v["edcorr"] * v["ks"], axis=1)))(np.tril(-v["t"].T @ v["dt"] @ v["t"].T, -1))),
        Step(3, "A", "dQ = scale diag(E) dO S^T, its Q dots; + M K", ("do", "s", "q", "m", "k"),
             (("dq", "reg"), ("qdot", "reg")), macs=n * Kd * V + n * Kd * n, elems=2 * sk,
             fn=lambda v: (lambda dq: dict(dq=dq + v["m"] @ v["k"], qdot=np.sum(dq * v["q"], axis=1)))(
                 v["scale"] * v["E"][:, None] * (v["do"] @ v["s"].T))),
        Step(3, "K", "dK = diag(D) Delta dS'^T + (-E dcorr) S^T + M^T Q; dV out",
             ("delta", "dsn_tile", "edcorr", "s", "m", "q", "dv"), (("dk", "reg"),), macs=n * Kd * n + 2 * n * Kd * V,
             fn=lambda v: dict(dk=v["D"][:, None] * (v["delta"] @ v["dsn_tile"].T) + v["edcorr"] @ v["s"].T
                               + v["m"].T @ v["q"])),
        # stage 4: dK's inverse terms; the gates
        Step(4, "K", "dK += F K + F^T K, out", ("dk", "f", "k"), (("dk", "reg"),), macs=2 * n * Kd * n,
             fn=lambda v: dict(dk=v["dk"] + v["f"] @ v["k"] + v["f"].T @ v["k"])),
        Step(4, "A", "dgamma from its parts; dbeta", ("gp", "ga", "qdot", "corr_dot", "kds_dot", "sdot",
                                                                     "db1", "db2"),
             (("dg", "reg"), ("db", "reg")), elems=2 * sq,
             fn=lambda v: dict(dg=_gates(v), db=v["db1"] + v["db2"])),
    ]
    return steps


def _gates(v):
    """d gamma of the chunk (the prototype's, from the schedule's parts; reverse_over_chunks sums it within the chunk).
    corr_dot holds -E rowsum(dcorr * K S) and sdot E_n sum(S * dS'), as the kernel's partial sums do."""
    d_gamma = v["qdot"] + v["corr_dot"]
    d_gamma_matrix = v["gp"] + v["ga"]  # dGamma .* Gamma, lower
    d_gamma = d_gamma + d_gamma_matrix.sum(axis=1) - d_gamma_matrix.sum(axis=0) - v["kds_dot"]
    d_gamma[-1] += v["kds_dot"].sum() + v["sdot"]
    return d_gamma


# The chunk's inputs and their tiles' bytes (bf16); the state S is K x V.
def input_bytes(n, Kd, V):
    return dict(q=2 * n * Kd, k=2 * n * Kd, v=2 * n * V, do=2 * n * V, delta=2 * n * V, p=2 * n * n, t=2 * n * n,
                s=2 * Kd * V)


def produced_bytes(n, Kd, V):
    # corr is written into V's tile (in place, by the step that reads V last); dT and F into dDelta's (IN_PLACE)
    return dict(dsn_tile=2 * Kd * V, ddelta=2 * n * V, m=2 * n * n, edcorr=2 * n * V, dv=2 * n * V)


INPUTS = tuple(input_bytes(1, 1, 1))
# A produced value that takes the tile of a value its readers are done with: corr V's (the step that reads V last
# writes it), dT and then F dDelta's (the kernel's dT^T and X side by side, F in dT^T's place).
IN_PLACE = {"corr": "v", "dt": "ddelta", "f": "ddelta"}


def check_reads(steps):
    """Every read is the role's own value (registers, or a tile it wrote itself), a tile or vector another role wrote
    in an earlier stage, or an input. Returns the errors."""
    errors, written = [], {"dsn": ("S", "reg", -1)}
    inputs = set(INPUTS) | {"E", "D", "Gamma", "b", "scale"}
    for step in sorted(steps, key=lambda s: s.stage):  # a role's steps of one stage run in the order listed
        for name in step.reads:
            if name in inputs:
                continue
            if name not in written:
                errors.append(f"stage {step.stage} {step.role} '{step.name}' reads {name}, which nothing wrote before")
                continue
            role, where, stage = written[name]
            if role == step.role:
                continue
            if where == "reg":
                errors.append(f"stage {step.stage} {step.role} '{step.name}' reads {name}, in {role}'s registers")
            elif stage >= step.stage:
                errors.append(f"stage {step.stage} {step.role} '{step.name}' reads {name}, which {role} writes in"
                              f" stage {stage}")
        for name, where in step.writes:
            written[name] = (step.role, where, step.stage)
    return errors


def lifetimes(steps, n, Kd, V):
    """Per tile: (bytes, first stage live, last stage read); inputs live from stage 0 (loaded before it)."""
    stages = max(s.stage for s in steps)
    sizes = {**input_bytes(n, Kd, V), **produced_bytes(n, Kd, V)}
    life = {name: [size, 0, 0] for name, size in input_bytes(n, Kd, V).items()}
    for step in steps:
        for name, where in step.writes:
            if where == "tile" and name not in IN_PLACE:
                life.setdefault(name, [sizes[name], step.stage, step.stage])[1] = step.stage
    for step in steps:
        for name in step.reads:
            if name in life:
                life[name][2] = max(life[name][2], step.stage)
    life["dv"][2] = max(life["dv"][2], life["dv"][1] + 1)  # staged for the chain role's row stores a stage later
    for name, host in IN_PLACE.items():  # corr extends V's tile
        life[host][2] = max(life[host][2], max(s.stage for s in steps if name in s.reads))
    return life


def peak_bytes(life, stages):
    return max(sum(size for size, first, last in life.values() if first <= st <= last) for st in range(stages + 1))


def run(q, k, v, g, beta, h0, scale, do, dht, steps):
    """The schedule in float64 over every chunk (reverse), from the recompute pass's S and Delta and prepare's P (with
    scale) and gated T."""
    def chunk_backward(c0, S, f, dsn):
        Q, K, Vc, b, dO = (x[c0:c0 + C] for x in (q, k, v, beta, do))
        values = dict(q=Q, k=K, v=Vc, do=dO, delta=f["delta"], s=S, dsn=dsn, b=b, scale=scale, Gamma=f["Gamma"],
                      E=f["E"], D=f["D"], p=scale * f["P"], t=f["T"])
        for stage in range(max(s.stage for s in steps) + 1):
            # side by side: a role sees its own outputs of this stage, the others' only after it
            outputs = {role: {} for role in ROLES}
            for step in (s for s in steps if s.stage == stage):
                outputs[step.role].update(step.fn({**values, **outputs[step.role]}))
            for role in ROLES:
                values.update(outputs[role])
        return values["dq"], values["dk"], values["dv"], values["db"], values["dg"], values["ds"]

    return reverse_over_chunks(q, k, v, g, beta, h0, dht, chunk_backward)


def report(steps, n=C, Kd=128, V=128):
    stages = max(s.stage for s in steps)
    print(f"per chunk (n = {n}, K = {Kd}, V = {V}): multiply-adds (M) / element-wise elements (K) by stage and role;"
          " * marks the chain")
    print("stage | " + " | ".join(ROLES))
    for st in range(stages + 1):
        cells = []
        for role in ROLES:
            mine = [s for s in steps if s.stage == st and s.role == role]
            macs, elems = sum(s.macs for s in mine), sum(s.elems for s in mine)
            mark = "*" if any(s.chain for s in mine) else ""
            cells.append(f"{macs / 1e6:.2f} / {elems / 1e3:.0f}{mark}" if mine else "-")
        print(f"{st} | " + " | ".join(cells))
    for role in ROLES:
        mine = [s for s in steps if s.role == role]
        print(f"{role}: {sum(s.macs for s in mine) / 1e6:.2f} M multiply-adds, {sum(s.elems for s in mine) / 1e3:.0f} K "
              "elements")
    # The SM's tensor cores are shared by the roles: the total bounds a chunk step from below, and so does the sum over
    # stages of each stage's busiest role (the roles overlap within a stage, the stages follow one another).
    total = sum(s.macs for s in steps)
    staged = sum(max(sum(s.macs for s in steps if s.stage == st and s.role == role) for role in ROLES)
                 for st in range(stages + 1))
    print(f"products: {total / 1e6:.2f} M multiply-adds a chunk ({total / PEAK_MACS_PER_CYCLE / 1e3:.1f} K cycles at the"
          f" dense peak); the stages' busiest roles {staged / 1e6:.2f} M ({staged / PEAK_MACS_PER_CYCLE / 1e3:.1f} K"
          " cycles)")
    life = lifetimes(steps, n, Kd, V)
    peak = peak_bytes(life, stages)
    print("tiles (bytes, live stages): " + ", ".join(f"{name} {size // 1024} KB {first}-{last}"
                                                   for name, (size, first, last) in life.items()))
    print(f"shared memory at the busiest stage: {peak // 1024} KB + {VECTOR_BYTES // 1024} KB of vectors and"
          f" alignment, of {SMEM_BYTES // 1024} KB")
    # An input's tile can take the next chunk's copy after its last reader; the copy must land before its first reader
    # in the next chunk. The window counts the stages in between (0: the copy is exposed).
    first_read = {name: min(s.stage for s in steps if name in s.reads) for name in INPUTS}
    windows = {name: stages - life[name][2] + first_read[name] for name in INPUTS}
    print("refill windows (stages from an input's last reader to its first in the next chunk): "
          + ", ".join(f"{name} {w}" for name, w in windows.items()))
    return peak + VECTOR_BYTES <= SMEM_BYTES


def main():
    steps = schedule(C, 128, 128)
    errors = check_reads(steps)
    for e in errors:
        print("read check:", e)
    worst = worst_against_reverse(lambda *args: run(*args, steps), np.random.default_rng(0), 64 * 3 + 23, 16)
    fits = report(steps)
    return 0 if worst < 1e-10 and not errors and fits else 1


if __name__ == "__main__":
    sys.exit(main())
