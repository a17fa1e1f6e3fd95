"""The Python binding of the GDN operator: results against an independent NumPy fp64 recurrence and the
reference backend, dtypes and allocation, packed sequences, and the errors raised for bad calls."""

import re

import numpy as np
import pytest

import deltatrain as dt
from deltatrain import _deltatrain


def naive_recurrence(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, l2norm=False):
    """The gated delta rule token by token in float64, straight from its definition."""
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    scale = K ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        spans = [(0, int(cu_seqlens[n]), int(cu_seqlens[n + 1])) for n in range(len(cu_seqlens) - 1)]
    o = np.zeros((B, T, HV, V))
    final = np.zeros((len(spans), HV, K, V))
    for n, (b, start, end) in enumerate(spans):
        for j in range(HV):
            i = j // (HV // H)
            h = np.zeros((K, V)) if initial_state is None else np.array(initial_state[n, j], dtype=np.float64)
            for t in range(start, end):
                h = h * np.exp(g[b, t, j])
                correction = beta[b, t, j] * (v[b, t, j] - k[b, t, i] @ h)
                h = h + np.outer(k[b, t, i], correction)
                o[b, t, j] = (scale * q[b, t, i]) @ h
            final[n, j] = h
    return o, final


def make_inputs(rng, B=1, T=70, H=2, HV=4, K=64, V=32, dtype=np.float32, lengths=None, initial_state=True,
                l2norm=True):
    if lengths is not None:
        B, T = 1, int(sum(lengths))
    keys = rng.standard_normal((B, T, H, K)) * (3.0 if l2norm else K ** -0.5)
    inputs = dict(
        q=rng.standard_normal((B, T, H, K)).astype(dtype),
        k=keys.astype(dtype),
        v=rng.standard_normal((B, T, HV, V)).astype(dtype),
        g=rng.uniform(-0.12, 0.0, (B, T, HV)).astype(np.float64 if dtype == np.float64 else np.float32),
        beta=rng.uniform(0.02, 0.98, (B, T, HV)).astype(np.float64 if dtype == np.float64 else np.float32),
    )
    if initial_state:
        n = B if lengths is None else len(lengths)
        inputs["initial_state"] = rng.standard_normal((n, HV, K, V)).astype(
            np.float64 if dtype == np.float64 else np.float32)
    if lengths is not None:
        inputs["cu_seqlens"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return inputs


def relative_error(actual, expected):
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape
    assert np.isfinite(actual).all()
    return np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-300)


TOLERANCE = {np.float32: 1e-4, np.float64: 1e-10}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("backend", ["auto", "cpu", "reference"])
@pytest.mark.parametrize("layout", ["batched", "packed"])
def test_forward_matches_the_numpy_recurrence(rng, dtype, backend, layout):
    lengths = [0, 65, 3, 40] if layout == "packed" else None
    inputs = make_inputs(rng, B=2, dtype=dtype, lengths=lengths)
    o, final_state = dt.chunk_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                               backend=backend)
    want_o, want_final = naive_recurrence(**inputs, l2norm=True)
    assert o.dtype == dtype and final_state.dtype == dtype  # float32 inputs keep float32 states
    assert relative_error(o, want_o) < TOLERANCE[dtype]
    assert relative_error(final_state, want_final) < TOLERANCE[dtype]


@pytest.mark.parametrize("K,V", [(16, 200), (60, 100), (100, 60), (200, 16), (256, 128)])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_any_head_dim_up_to_256_matches_the_numpy_recurrence(rng, backend, K, V):
    inputs = make_inputs(rng, H=1, HV=2, K=K, V=V, dtype=np.float64, lengths=[65, 0, 4])
    want_o, want_final = naive_recurrence(**inputs, l2norm=True)
    for function in (dt.chunk_gated_delta_rule, dt.fused_recurrent_gated_delta_rule):
        o, final_state = function(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True, backend=backend)
        assert relative_error(o, want_o) < 1e-10
        assert relative_error(final_state, want_final) < 1e-10


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_recurrent_matches_the_numpy_recurrence(rng, dtype):
    inputs = make_inputs(rng, dtype=dtype, lengths=[5, 1, 0, 9], l2norm=False)
    scale = float(rng.uniform(0.05, 0.5))
    o, final_state = dt.fused_recurrent_gated_delta_rule(**inputs, scale=scale)
    want_o, want_final = naive_recurrence(**inputs, scale=scale)
    assert relative_error(o, want_o) < TOLERANCE[dtype]
    assert relative_error(final_state, want_final) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_matches_the_reference_backend(rng, dtype):
    inputs = make_inputs(rng, dtype=dtype, lengths=[70, 0, 33])
    do = rng.standard_normal((1, 103, 4, 32)).astype(dtype)
    dht = rng.standard_normal(inputs["initial_state"].shape).astype(inputs["initial_state"].dtype)
    got = dt.chunk_gated_delta_rule_bwd(**inputs, do=do, dht=dht, use_qk_l2norm_in_kernel=True, backend="cpu")
    want = dt.chunk_gated_delta_rule_bwd(**inputs, do=do, dht=dht, use_qk_l2norm_in_kernel=True,
                                         backend="reference")
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], got, want):
        assert a.dtype == b.dtype, name
        assert relative_error(a, b) < TOLERANCE[dtype], name


def test_backward_matches_finite_differences_of_the_numpy_recurrence(rng):
    """An independent check of the gradients: the NumPy recurrence differentiated numerically."""
    inputs = make_inputs(rng, T=6, H=1, HV=2, K=4, V=3, dtype=np.float64, lengths=[4, 2])
    do = rng.standard_normal((1, 6, 2, 3))
    dht = rng.standard_normal(inputs["initial_state"].shape)
    grads = dict(zip(["q", "k", "v", "g", "beta", "initial_state"],
                     dt.chunk_gated_delta_rule_bwd(**inputs, do=do, dht=dht, use_qk_l2norm_in_kernel=True)))

    def loss(values):
        o, final = naive_recurrence(**values, l2norm=True)
        return (o * do).sum() + (final * dht).sum()

    step = 1e-6
    for name, gradient in grads.items():
        numeric = np.zeros_like(gradient)
        for index in np.ndindex(gradient.shape):
            up, down = ({**inputs, name: inputs[name].copy()} for _ in range(2))
            up[name][index] += step
            down[name][index] -= step
            numeric[index] = (loss(up) - loss(down)) / (2 * step)
        assert relative_error(gradient, numeric) < 1e-7, name


def test_varlen_with_int32_and_int64_offsets_agree(rng):
    inputs = make_inputs(rng, lengths=[17, 0, 64, 1])
    o32, h32 = dt.chunk_gated_delta_rule(**inputs, output_final_state=True)
    inputs["cu_seqlens"] = inputs["cu_seqlens"].astype(np.int64)
    o64, h64 = dt.chunk_gated_delta_rule(**inputs, output_final_state=True)
    np.testing.assert_array_equal(o32, o64)
    np.testing.assert_array_equal(h32, h64)


def test_outputs_and_their_dtypes(rng):
    inputs = make_inputs(rng, dtype=np.float16, initial_state=False)
    o, final_state = dt.chunk_gated_delta_rule(**inputs)
    assert final_state is None  # not asked for
    assert o.dtype == np.float16 and o.shape == inputs["v"].shape and isinstance(o, np.ndarray)
    _, final_state = dt.fused_recurrent_gated_delta_rule(**inputs)  # asked for by default
    assert final_state.dtype == np.float32 and final_state.shape == (1, 4, 64, 32)
    dq, dk, dv, dg, dbeta, dh0 = dt.chunk_gated_delta_rule_bwd(**inputs, do=o)
    assert dh0 is None  # no initial state
    assert (dq.dtype, dk.dtype, dv.dtype, dg.dtype, dbeta.dtype) == (np.float16,) * 3 + (np.float32,) * 2
    assert dq.shape == inputs["q"].shape and dg.shape == inputs["g"].shape


def test_half_inputs_match_the_reference_on_the_same_rounded_values(rng):
    inputs = make_inputs(rng, dtype=np.float16)
    o, final_state = dt.chunk_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_o, want_final = naive_recurrence(**inputs, l2norm=True)
    assert relative_error(o, want_o) < 2e-3
    assert relative_error(final_state, want_final) < 1e-4


def test_bfloat16_numpy_arrays_through_ml_dtypes(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    inputs = make_inputs(rng)
    for name in ("q", "k", "v"):
        inputs[name] = inputs[name].astype(ml_dtypes.bfloat16)
    o, final_state = dt.chunk_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == ml_dtypes.bfloat16
    want_o, want_final = naive_recurrence(**{n: np.asarray(x, np.float64) for n, x in inputs.items()}, l2norm=True)
    assert relative_error(o, want_o) < 1.5e-2
    assert relative_error(final_state, want_final) < 1e-4


def test_torch_tensors_in_torch_tensors_out(rng):
    torch = pytest.importorskip("torch")
    inputs = make_inputs(rng, lengths=[30, 41], l2norm=False)  # keys of norm ~1: no in-kernel norm here
    tensors = {name: torch.from_numpy(x) for name, x in inputs.items()}
    o, final_state = dt.chunk_gated_delta_rule(**tensors, output_final_state=True)
    assert isinstance(o, torch.Tensor) and isinstance(final_state, torch.Tensor)
    want_o, want_final = naive_recurrence(**inputs)
    assert relative_error(o.numpy(), want_o) < 1e-4
    assert relative_error(final_state.numpy(), want_final) < 1e-4


def test_backends_lists_each_with_its_availability_and_reason():
    listed = dt.backends()
    names = [b["name"] for b in listed]
    assert {"reference", "cpu", "cuda"} <= set(names)
    assert len(names) == len(set(names))
    for backend in listed:
        assert set(backend) >= {"name", "available", "reason", "details"}
        assert isinstance(backend["available"], bool)
        assert backend["available"] or backend["reason"], backend["name"]
    by_name = {b["name"]: b for b in listed}
    assert by_name["reference"]["available"] and by_name["cpu"]["available"]
    priorities = [b["priority"] for b in listed]
    assert priorities == sorted(priorities, reverse=True)  # fastest first, the order "auto" tries


def _break(inputs, **changes):
    return {**inputs, **changes}


BAD_CALLS = [
    ("q_rank", lambda x: _break(x, q=x["q"][0]), "'q'"),
    ("k_shape", lambda x: _break(x, k=x["k"][:, :, :, :8].copy()), "'k'"),
    ("hv_not_multiple_of_h", lambda x: _break(x, v=x["v"][:, :, :3].copy(), g=x["g"][:, :, :3].copy(),
                                               beta=x["beta"][:, :, :3].copy(),
                                               initial_state=x["initial_state"][:, :3].copy()), "'v'"),
    ("mixed_dtypes", lambda x: _break(x, k=x["k"].astype(np.float64)), "'k'"),
    ("g_shape", lambda x: _break(x, g=x["g"][:, :-1].copy()), "'g'"),
    ("beta_integer", lambda x: _break(x, beta=np.ones(x["beta"].shape, np.int32)), "'beta'"),
    ("cu_seqlens_not_from_zero", lambda x: _break(x, cu_seqlens=np.array([1, 30, 70], np.int64)), "'cu_seqlens'"),
    ("cu_seqlens_decreasing", lambda x: _break(x, cu_seqlens=np.array([0, 40, 30, 70], np.int32),
                                               initial_state=None), "'cu_seqlens'"),
    ("cu_seqlens_short_of_T", lambda x: _break(x, cu_seqlens=np.array([0, 30, 69], np.int32)), "'cu_seqlens'"),
    ("cu_seqlens_float", lambda x: _break(x, cu_seqlens=np.array([0.0, 30.0, 70.0])), "'cu_seqlens'"),
    ("initial_state_wrong_N", lambda x: _break(x, initial_state=np.zeros((3, 4, 64, 32), np.float32)),
     "'initial_state'"),
    ("q_not_contiguous", lambda x: _break(x, q=np.asfortranarray(x["q"])), "'q'"),
    ("q_not_an_array", lambda x: _break(x, q=x["q"].tolist()), "'q'"),
    ("scale_nan", lambda x: _break(x, scale=float("nan")), "'scale'"),
    ("unknown_backend", lambda x: _break(x, backend="fastest"), "'backend'"),
]


@pytest.mark.parametrize("case,breaks,argument", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
@pytest.mark.parametrize("function", ["chunk", "recurrent", "backward"])
def test_bad_arguments_raise_value_error_naming_the_argument(rng, case, breaks, argument, function):
    inputs = make_inputs(rng, lengths=[30, 40])
    call = breaks(inputs)
    with pytest.raises(ValueError, match=argument):
        if function == "chunk":
            dt.chunk_gated_delta_rule(**call)
        elif function == "recurrent":
            dt.fused_recurrent_gated_delta_rule(**call)
        else:
            dt.chunk_gated_delta_rule_bwd(**call, do=np.zeros(inputs["v"].shape, np.float32))


def test_batch_of_two_with_cu_seqlens_is_a_value_error(rng):
    inputs = make_inputs(rng, B=2, initial_state=False)
    with pytest.raises(ValueError, match="'cu_seqlens'.*B = 2"):
        dt.chunk_gated_delta_rule(**inputs, cu_seqlens=np.array([0, 70], np.int64))


def test_bad_gradient_arguments(rng):
    inputs = make_inputs(rng)
    with pytest.raises(ValueError, match="'do'"):
        dt.chunk_gated_delta_rule_bwd(**inputs, do=np.zeros((1, 70, 4, 31), np.float32))
    with pytest.raises(ValueError, match="'dht'"):
        dt.chunk_gated_delta_rule_bwd(**inputs, do=np.zeros(inputs["v"].shape, np.float32),
                                      dht=np.zeros((1, 4, 64, 32), np.float64))


def test_unavailable_backend_raises_runtime_error_naming_it_and_why(rng):
    cuda = {b["name"]: b for b in dt.backends()}["cuda"]
    if cuda["available"]:
        pytest.skip("a GPU is usable here; this checks the no-GPU path")
    with pytest.raises(RuntimeError, match="'cuda'.*" + re.escape(cuda["reason"])):
        dt.chunk_gated_delta_rule(**make_inputs(rng), backend="cuda")


def test_low_level_outputs_are_checked_and_untouched_on_error(rng):
    inputs = make_inputs(rng, initial_state=False, l2norm=False)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    o = np.full(inputs["v"].shape, 7.0, np.float32)
    with pytest.raises(ValueError, match="'o'.*float64"):
        _deltatrain.gdn.chunk_forward(*args, o.astype(np.float64))
    read_only = o.copy()
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="'o'.*read-only"):
        _deltatrain.gdn.chunk_forward(*args, read_only)
    with pytest.raises(ValueError, match="'final_state'"):
        _deltatrain.gdn.chunk_forward(*args, o, np.zeros((2, 4, 64, 32), np.float32))
    assert (o == 7.0).all()  # a failed call writes nothing
    _deltatrain.gdn.chunk_forward(*args, o, backend="reference", cpu_threads=1)
    want_o, _ = naive_recurrence(*args)
    assert relative_error(o, want_o) < 1e-4


def test_saved_buffer_is_sized_by_the_backend_and_checked(rng):
    inputs = make_inputs(rng, initial_state=False, l2norm=False)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    assert _deltatrain.gdn.saved_bytes(*args, backend="cpu") == 0  # the CPU backends keep nothing
    o = np.full(inputs["v"].shape, 7.0, np.float32)
    with pytest.raises(ValueError, match="'saved'.*got \\[8\\]"):
        _deltatrain.gdn.chunk_forward(*args, o, backend="cpu", saved=np.zeros(8, np.uint8))
    with pytest.raises(ValueError, match="'saved'.*only chunk_forward"):
        _deltatrain.gdn.recurrent_forward(*args, o, backend="cpu", saved=np.zeros(0, np.uint8))
    assert (o == 7.0).all()
    _deltatrain.gdn.chunk_forward(*args, o, backend="cpu", saved=np.zeros(0, np.uint8))
    assert relative_error(o, naive_recurrence(*args)[0]) < 1e-4


def test_problem_reports_the_sizes_outputs_need(rng):
    inputs = make_inputs(rng, lengths=[3, 0, 8], dtype=np.float64)
    sizes = _deltatrain.gdn.problem(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                                    inputs["initial_state"], cu_seqlens=inputs["cu_seqlens"])
    assert (sizes["B"], sizes["T"], sizes["H"], sizes["HV"], sizes["K"], sizes["V"], sizes["N"]) == \
        (1, 11, 2, 4, 64, 32, 3)
    assert sizes["state_dtype"] == "float64" and sizes["io_dtype"] == "float64"
    assert sizes["scale"] == pytest.approx(64 ** -0.5)
    assert _deltatrain.gdn.resolve_backend(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                                           backend="reference") == "reference"
