"""The GDN binding at its limits (issue 22): calls too large for memory, empty and misaligned arrays, option
values the compute type cannot hold and options of the wrong type each raise the documented exception
naming the argument, or give the right (empty) result; nothing aborts the process."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import deltatrain as dt
from deltatrain import _deltatrain


def run_isolated(code):
    """Runs `code` in a fresh interpreter: a call that aborts the process fails the test, not the suite."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("function", ["chunk", "recurrent", "backward"])
def test_a_state_too_large_for_memory_is_a_memory_error_naming_it(backend, function):
    # K = V = 2^20: a 4 TiB state, allocated per thread inside the backend's OpenMP region.
    result = run_isolated(f"""
        import numpy as np
        import deltatrain as dt
        q = np.zeros((1, 1, 1, 1 << 20), np.float32)
        g = np.zeros((1, 1, 1), np.float32)
        try:
            if "{function}" == "chunk":
                dt.chunk_gated_delta_rule(q, q, q, g, g, backend="{backend}")
            elif "{function}" == "recurrent":
                dt.fused_recurrent_gated_delta_rule(q, q, q, g, g, output_final_state=False, backend="{backend}")
            else:
                dt.chunk_gated_delta_rule_bwd(q, q, q, g, g, q, backend="{backend}")
        except MemoryError as error:
            print("MemoryError:", error)
        """)
    assert result.returncode == 0, result.stderr
    assert "MemoryError: out of memory allocating the " + backend in result.stdout
    # float32 on the cpu backend, float64 on the reference
    assert ("K x V state of 4.0 TiB" if backend == "cpu" else "K x V state of 8.0 TiB") in result.stdout


def test_a_final_state_too_large_for_memory_is_a_memory_error_naming_it():
    q = np.zeros((1, 1, 1, 1 << 20), np.float32)
    g = np.zeros((1, 1, 1), np.float32)
    with pytest.raises(MemoryError, match="'final_state'"):
        dt.chunk_gated_delta_rule(q, q, q, g, g, output_final_state=True)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_empty_inputs_give_empty_outputs_and_the_initial_state_back(rng, backend):
    q = np.zeros((2, 0, 1, 8), np.float32)
    v = np.zeros((2, 0, 2, 4), np.float32)
    g = np.zeros((2, 0, 2), np.float32)
    h0 = rng.standard_normal((2, 2, 8, 4)).astype(np.float32)
    for run in (dt.chunk_gated_delta_rule, dt.fused_recurrent_gated_delta_rule):
        o, final_state = run(q, q, v, g, g, initial_state=h0, output_final_state=True, backend=backend)
        assert o.shape == v.shape
        np.testing.assert_array_equal(final_state, h0)
    dq, dk, dv, dg, dbeta, dh0 = dt.chunk_gated_delta_rule_bwd(q, q, v, g, g, v, dht=h0, initial_state=h0,
                                                               backend=backend)
    assert dq.shape == q.shape and dv.shape == v.shape and dg.shape == g.shape
    np.testing.assert_array_equal(dh0, h0)


def misaligned(array):
    """The same values in an array that starts one byte into its buffer."""
    buffer = bytearray(array.nbytes + 1)
    view = np.ndarray(array.shape, array.dtype, buffer=buffer, offset=1)
    view[...] = array
    return view


def test_misaligned_arrays_are_refused_naming_them(rng):
    q = rng.standard_normal((1, 8, 1, 4)).astype(np.float32)
    g = np.zeros((1, 8, 1), np.float32)
    with pytest.raises(ValueError, match="'q'.*not a multiple of its 4-byte float32"):
        dt.chunk_gated_delta_rule(misaligned(q), q, q, g, g)
    with pytest.raises(ValueError, match="'beta'"):
        dt.chunk_gated_delta_rule(q, q, q, g, misaligned(g))


def test_scale_beyond_float32_is_refused_in_a_float32_call_and_accepted_in_a_float64_one():
    q = np.ones((1, 2, 1, 4), np.float32)
    g = np.zeros((1, 2, 1), np.float32)
    with pytest.raises(ValueError, match="'scale'.*float32.*1e\\+300"):
        dt.chunk_gated_delta_rule(q, q, q, g, g, scale=1e300)
    o, _ = dt.chunk_gated_delta_rule(q.astype(np.float64), q.astype(np.float64), q.astype(np.float64),
                                     g.astype(np.float64), g.astype(np.float64), scale=1e300)
    assert np.isfinite(o).all()


@pytest.mark.parametrize("value", ["x", [1.0], True])
def test_a_scale_of_the_wrong_type_is_a_value_error_naming_it(value):
    q = np.ones((1, 2, 1, 4), np.float32)
    g = np.zeros((1, 2, 1), np.float32)
    with pytest.raises(ValueError, match="'scale'.*expected a float or None"):
        dt.chunk_gated_delta_rule(q, q, q, g, g, scale=value)


@pytest.mark.parametrize("threads", [1000000, -1, 1 << 40, "4"])
def test_cpu_threads_beyond_the_machine_or_of_the_wrong_type_is_a_value_error(threads):
    q = np.ones((1, 64, 1, 64), np.float32)
    g = np.zeros((1, 64, 1), np.float32)
    o = np.empty_like(q)
    with pytest.raises(ValueError, match="'cpu_threads'"):
        _deltatrain.gdn.chunk_forward(q, q, q, g, g, o, backend="cpu", cpu_threads=threads)


def test_a_full_reset_of_the_state_keeps_every_output_finite_and_exact(rng):
    # g = -inf at token 40 of a 64-token chunk: the tokens before it must not be touched by the reset.
    B, T, H, K, V = 1, 64, 1, 16, 8
    q = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k = (rng.standard_normal((B, T, H, K)) / 4).astype(np.float32)
    v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    g = rng.uniform(-0.1, 0, (B, T, H)).astype(np.float32)
    g[0, 40, 0] = -np.inf
    beta = rng.uniform(0.1, 0.9, (B, T, H)).astype(np.float32)
    do = rng.standard_normal(v.shape).astype(np.float32)
    o, _ = dt.chunk_gated_delta_rule(q, k, v, g, beta, backend="cpu")
    want, _ = dt.chunk_gated_delta_rule(*(x.astype(np.float64) for x in (q, k, v, g, beta)), backend="reference")
    assert np.isfinite(o).all()
    assert np.abs(o - want).max() <= 1e-4 * np.abs(want).max()
    grads = dt.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, backend="cpu")
    exact = dt.chunk_gated_delta_rule_bwd(*(x.astype(np.float64) for x in (q, k, v, g, beta, do)),
                                          backend="reference")
    for got, expected in zip(grads[:5], exact[:5]):
        assert np.isfinite(got).all()
        assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
