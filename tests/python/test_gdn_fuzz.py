"""Fuzzing the GDN binding on the CPU, seeded (a failure prints DELTATRAIN_TEST_SEED to replay it) and bounded:

- valid calls of random shapes (head dims 1..256, GVA, T = 0, packed sequences with empty ones, int32/int64
  offsets), dtypes, scales and flags, each function (chunked forward, recurrent step, backward) on the cpu
  backend against the float64 reference backend on the same values;
- invalid calls (one argument broken at random: shapes, ranks, dtypes, layouts, offsets, option types and
  values, missing tensors, misaligned arrays, gradients), all in one child interpreter: each raises a
  ValueError naming the broken argument (never nanobind's TypeError listing the signature), and none ends the
  process."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import deltatrain as dt

FUNCTIONS = ("chunk", "recurrent", "backward")
DIMS = (1, 2, 3, 16, 33, 60, 64, 100, 128, 200, 256)
# Per dtype of q, k, v: the computing dtype's error against float64, plus rounding of outputs to the dtype.
TOLERANCE = {np.float64: 1e-9, np.float32: 1e-3, np.float16: 5e-3}


def random_call(rng, budget=2_000_000):
    """A valid call's arguments; T * HV * K * V stays within `budget` so that the reference stays quick."""
    while True:
        H = int(rng.integers(1, 3))
        HV = H * int(rng.integers(1, 4))
        K, V = (int(rng.choice(DIMS)) for _ in range(2))
        varlen = bool(rng.integers(2))
        if varlen:
            lengths = [int(x) for x in rng.integers(0, 90, int(rng.integers(1, 5)))]
            B, T = 1, sum(lengths)
        else:
            B, T = int(rng.integers(1, 3)), int(rng.integers(0, 140))
        if B * T * HV * K * V <= budget:
            break
    dtype = [np.float64, np.float32, np.float16][int(rng.integers(3))]
    gate_dtype = np.float64 if dtype == np.float64 else [np.float32, dtype][int(rng.integers(2))]
    # The in-kernel L2 norm of a 1-element key is its sign: its gradient, eps / (k^2 + eps)^1.5 g, is what is left of
    # g (1 - k^2 / (k^2 + eps)) after a float32 cancellation, ~1% off where |k| is ~0.5 (seed 1038431945: float16 dk
    # 1e-2 off the float64 reference). No model has such keys; K = 1 is fuzzed without the norm.
    l2norm = bool(rng.integers(2)) and K > 1
    # Without the in-kernel norm, keys of norm about 1 keep the recurrence contractive.
    key_scale = 1.0 if l2norm else K ** -0.5
    call = dict(
        q=rng.standard_normal((B, T, H, K)).astype(dtype),
        k=(key_scale * rng.standard_normal((B, T, H, K))).astype(dtype),
        v=rng.standard_normal((B, T, HV, V)).astype(dtype),
        g=rng.uniform(-0.3, 0.0, (B, T, HV)).astype(gate_dtype),
        beta=rng.uniform(0.02, 0.98, (B, T, HV)).astype(gate_dtype),
        use_qk_l2norm_in_kernel=l2norm,
    )
    if rng.integers(2):
        call["scale"] = float(rng.uniform(0.05, 1.0))
    N = len(lengths) if varlen else B
    if varlen:
        call["cu_seqlens"] = np.concatenate([[0], np.cumsum(lengths)]).astype([np.int32, np.int64][rng.integers(2)])
    if rng.integers(2):
        state_dtype = np.float64 if dtype == np.float64 else np.float32
        call["initial_state"] = rng.standard_normal((N, HV, K, V)).astype(state_dtype)
    return call


def in_float64(call):
    return {n: x.astype(np.float64) if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x
            for n, x in call.items()}


def run(function, call, cotangents, backend):
    if function == "chunk":
        return dt.chunk_gated_delta_rule(**call, output_final_state=True, backend=backend)
    if function == "recurrent":
        return dt.fused_recurrent_gated_delta_rule(**call, output_final_state=True, backend=backend)
    do, dht = cotangents
    state_dtype = np.float64 if call["q"].dtype == np.float64 else np.float32
    return dt.chunk_gated_delta_rule_bwd(**call, do=do.astype(call["v"].dtype), dht=dht.astype(state_dtype),
                                         backend=backend)


def frobenius_error(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape and np.isfinite(actual).all()
    norm = np.linalg.norm(expected)
    return np.linalg.norm(actual - expected) / norm if norm > 0 else np.linalg.norm(actual)


def test_random_valid_calls_match_the_reference_backend(rng):
    for _ in range(60):
        call = random_call(rng)
        function = FUNCTIONS[int(rng.integers(3))]
        B, T, HV, V = call["v"].shape
        N = len(call["cu_seqlens"]) - 1 if "cu_seqlens" in call else B
        cotangents = (rng.standard_normal((B, T, HV, V)), rng.standard_normal((N, HV, call["q"].shape[3], V)))
        got = run(function, call, cotangents, "cpu")
        want = run(function, in_float64(call), cotangents, "reference")
        shapes = {n: x.shape for n, x in call.items() if isinstance(x, np.ndarray)}
        context = dict(function=function, shapes=shapes, dtype=str(call["q"].dtype), gates=str(call["g"].dtype),
                       l2norm=call["use_qk_l2norm_in_kernel"], scale=call.get("scale"))
        for index, (a, b) in enumerate(zip(got, want)):
            if b is None:
                assert a is None, context
                continue
            assert a.shape == b.shape, context
            assert frobenius_error(a, b) < TOLERANCE[call["q"].dtype.type], (index, context)


# Each breaks one argument of a valid float32 call (B = 1, T = 70, H = 2, HV = 4, K = 16, V = 8, two packed
# sequences, an initial state) and names the argument the error must name.
BREAKERS = {
    "q_rank": ("q", "x['q'] = x['q'][0]"),
    "q_empty_head_dim": ("q", "x['q'] = x['q'][..., :0]; x['k'] = x['k'][..., :0]"),
    "k_shape": ("k", "x['k'] = np.ascontiguousarray(x['k'][:, :, :, :5])"),
    "k_dtype": ("k", "x['k'] = x['k'].astype(np.float64)"),
    "v_heads": ("v", "x['v'] = np.ascontiguousarray(x['v'][:, :, :3])"),
    "v_missing": ("v", "x['v'] = None"),
    "q_complex": ("q", "x['q'] = x['q'].astype(np.complex64)"),
    "q_bool": ("q", "x['q'] = x['q'] > 0"),
    "q_list": ("q", "x['q'] = x['q'].tolist()"),
    "q_string": ("q", "x['q'] = 'q'"),
    "q_objects": ("q", "x['q'] = x['q'].astype(object)"),
    "q_fortran": ("q", "x['q'] = np.asfortranarray(x['q'])"),
    "q_strided": ("q", "x['q'] = np.repeat(x['q'], 2, axis=3)[..., ::2]"),
    "q_misaligned": ("q", "buf = np.zeros(x['q'].nbytes + 1, np.uint8); "
                          "x['q'] = np.ndarray(x['q'].shape, np.float32, buffer=buf, offset=1)"),
    "g_shape": ("g", "x['g'] = np.ascontiguousarray(x['g'][:, :-1])"),
    "g_integer": ("g", "x['g'] = np.zeros(x['g'].shape, np.int32)"),
    "beta_float16": ("beta", "x['beta'] = x['beta'].astype(np.float16)"),
    "cu_seqlens_not_from_zero": ("cu_seqlens", "x['cu_seqlens'] = np.array([1, 30, 70], np.int32)"),
    "cu_seqlens_decreasing": ("cu_seqlens", "x['cu_seqlens'] = np.array([0, 40, 30, 70], np.int32); "
                                            "x['initial_state'] = None"),
    "cu_seqlens_short": ("cu_seqlens", "x['cu_seqlens'] = np.array([0, 30, 69], np.int64)"),
    "cu_seqlens_float": ("cu_seqlens", "x['cu_seqlens'] = x['cu_seqlens'].astype(np.float32)"),
    "cu_seqlens_2d": ("cu_seqlens", "x['cu_seqlens'] = x['cu_seqlens'][None]"),
    "cu_seqlens_batch_2": ("cu_seqlens", "x.update({n: np.concatenate([x[n], x[n]]) "
                                         "for n in ('q', 'k', 'v', 'g', 'beta')})"),
    "initial_state_N": ("initial_state", "x['initial_state'] = x['initial_state'][:1].copy()"),
    "initial_state_dtype": ("initial_state", "x['initial_state'] = x['initial_state'].astype(np.float16)"),
    "scale_string": ("scale", "x['scale'] = 'x'"),
    "scale_nan": ("scale", "x['scale'] = float('nan')"),
    "scale_inf": ("scale", "x['scale'] = -float('inf')"),
    "scale_beyond_float32": ("scale", "x['scale'] = 1e300"),
    "scale_complex": ("scale", "x['scale'] = 1j"),
    "backend_unknown": ("backend", "x['backend'] = 'fastest'"),
    "backend_not_a_string": ("backend", "x['backend'] = 3"),
    "l2norm_not_a_bool": ("use_qk_l2norm_in_kernel", "x['use_qk_l2norm_in_kernel'] = 'yes'"),
    "do_shape": ("do", "x['do'] = np.zeros((1, 70, 4, 7), np.float32)"),
    "do_dtype": ("do", "x['do'] = x['do'].astype(np.float64)"),
    "dht_dtype": ("dht", "x['dht'] = np.zeros(x['initial_state'].shape, np.float64)"),
}

# The child: runs every drawn (breaker, function) and prints one JSON line per call; a crash leaves the
# last "trying" line for the test to report.
CHILD = """
    import json, sys
    import numpy as np
    import deltatrain as dt
    from deltatrain import _deltatrain
    rng = np.random.default_rng({seed})
    breakers = {breakers!r}
    for name, function in {draws!r}:
        argument, code = breakers[name]
        x = dict(q=rng.standard_normal((1, 70, 2, 16)).astype(np.float32),
                 k=rng.standard_normal((1, 70, 2, 16)).astype(np.float32),
                 v=rng.standard_normal((1, 70, 4, 8)).astype(np.float32),
                 g=rng.uniform(-0.1, 0, (1, 70, 4)).astype(np.float32),
                 beta=rng.uniform(0, 1, (1, 70, 4)).astype(np.float32),
                 cu_seqlens=np.array([0, 30, 70], np.int32),
                 initial_state=rng.standard_normal((2, 4, 16, 8)).astype(np.float32),
                 do=np.zeros((1, 70, 4, 8), np.float32), dht=np.zeros((2, 4, 16, 8), np.float32))
        exec(code)
        print(json.dumps(dict(trying=name, function=function)), flush=True)
        gradients = dict(do=x.pop("do"), dht=x.pop("dht"))
        try:
            if function == "chunk":
                dt.chunk_gated_delta_rule(**x)
            elif function == "recurrent":
                dt.fused_recurrent_gated_delta_rule(**x)
            elif function == "backward":
                dt.chunk_gated_delta_rule_bwd(**x, **gradients)
            else:  # the low-level binding, with outputs the caller allocates
                o = np.zeros(np.shape(x["v"]) if hasattr(x["v"], "shape") else (1,), np.float32)
                options = {{n: x.pop(n) for n in ("scale", "use_qk_l2norm_in_kernel", "cu_seqlens", "backend")
                           if n in x}}
                _deltatrain.gdn.chunk_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], o, None,
                                              x.get("initial_state"), **options)
            outcome, message = "no error", ""
        except Exception as error:
            outcome, message = type(error).__name__, str(error)
        print(json.dumps(dict(done=name, function=function, argument=argument, outcome=outcome,
                              message=message[:300])), flush=True)
"""


def test_random_invalid_calls_raise_clear_errors_and_never_crash(rng):
    names = sorted(BREAKERS)
    functions = FUNCTIONS + ("low_level",)
    # Every breaker with every function once, in a random order.
    draws = [(name, function) for name in names for function in functions]
    draws = [draws[i] for i in rng.permutation(len(draws))]
    child = textwrap.dedent(CHILD.format(seed=int(rng.integers(2**31)), breakers=BREAKERS, draws=draws))
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    finished = [line for line in lines if "done" in line]
    last = lines[-1] if lines else None
    assert result.returncode == 0, f"the child ended with {result.returncode} at {last}: {result.stderr[-2000:]}"
    assert len(finished) == len(draws)
    for line in finished:
        case = f"{line['done']} ({line['function']}): {line['outcome']}: {line['message']}"
        if line["function"] != "backward" and line["argument"] in ("do", "dht"):
            assert line["outcome"] == "no error", case  # the forward functions take no gradients
            continue
        assert line["outcome"] == "ValueError" and f"'{line['argument']}'" in line["message"], case
