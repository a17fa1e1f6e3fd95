"""deltatrain.torch: outputs and gradients of fla's signatures (the chunked and the recurrent form) against
autograd through an independent float64 torch recurrence, on CPU tensors and (where there is a GPU) CUDA
tensors, over head dims up to 256 and fla's mixed dtypes; tensors reach the kernels by address, views
included. Skipped where torch is not installed."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltatrain.torch as dtt  # noqa: E402
from deltatrain import _deltatrain  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def recurrence(q, k, v, g, beta, h0, cu_seqlens, scale, l2norm=True):
    """The gated delta rule token by token in float64 torch, differentiable; l2norm of q and k included."""
    q, k, v, g, beta, h0 = (x.double() for x in (q, k, v, g, beta, h0))
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    group = v.shape[2] // q.shape[2]
    q, k = q[0].repeat_interleave(group, 1), k[0].repeat_interleave(group, 1)  # [T, HV, K]
    v, g, beta = v[0], g[0], beta[0]
    outputs, finals = [], []
    for n in range(len(cu_seqlens) - 1):
        h = h0[n]  # [HV, K, V]
        for t in range(int(cu_seqlens[n]), int(cu_seqlens[n + 1])):
            h = h * torch.exp(g[t])[:, None, None]
            correction = beta[t][:, None] * (v[t] - torch.einsum("jk,jkv->jv", k[t], h))
            h = h + k[t][:, :, None] * correction[:, None, :]
            outputs.append(scale * torch.einsum("jk,jkv->jv", q[t], h))
        finals.append(h)
    return torch.stack(outputs)[None], torch.stack(finals)


def make_leaves(seed, device, dtype, lengths=(37, 64, 1, 90), H=2, HV=4, K=64, V=64):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    values = dict(q=randn(1, T, H, K), k=randn(1, T, H, K), v=randn(1, T, HV, V),
                  g=torch.nn.functional.logsigmoid(randn(1, T, HV)) / 4, beta=torch.sigmoid(randn(1, T, HV)),
                  h0=randn(len(lengths), HV, K, V))
    leaves = {n: x.to(device, dtype if n in ("q", "k", "v") else torch.float32).requires_grad_(True)
              for n, x in values.items()}
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    return leaves, cu


def relative_error(actual, expected):
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert torch.isfinite(actual).all()
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_outputs_and_gradients_match_autograd_of_the_recurrence(device, dtype, rng):
    if device == "cpu" and dtype == "bfloat16":
        pytest.skip("the CPU backends take float16/bfloat16 too, but this checks the GPU's tolerance")
    tolerance = 2e-4 if dtype == "float32" else 2e-2
    leaves, cu = make_leaves(int(rng.integers(2**31)), device, getattr(torch, dtype))
    *qkvgb, h0 = leaves.values()
    o, final_state = dtt.chunk_gated_delta_rule(*qkvgb, scale=0.2, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, cu_seqlens=cu.to(device),
                                                cu_seqlens_cpu=cu)
    assert o.dtype == leaves["v"].dtype and final_state.dtype == torch.float32
    want_o, want_final = recurrence(*leaves.values(), cu, scale=0.2)
    assert relative_error(o, want_o) < tolerance
    assert relative_error(final_state, want_final) < tolerance

    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(final_state.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((o, final_state), list(leaves.values()), (do.to(o), dht.to(final_state)))
    want = torch.autograd.grad((want_o, want_final), list(leaves.values()), (do.to(device), dht.to(device)))
    for name, got, expected in zip(leaves, grads, want):
        assert got.dtype == leaves[name].dtype, name
        assert relative_error(got, expected) < tolerance, name


@pytest.mark.parametrize("device", DEVICES)
def test_views_are_read_where_they_point(device, rng):
    """A tensor that starts inside a larger storage gives the results of a compact copy; one with gaps between
    its rows is refused by the binding (it reads the strides); deltatrain.torch copies that one, and one that
    starts off a 16-byte boundary, and gives the same results."""
    leaves, cu = make_leaves(int(rng.integers(2**31)), device, torch.float32)
    x = {n: t.detach() for n, t in leaves.items()}
    offset = 4 * int(rng.integers(1, 25))  # floats: 16-byte steps, as the cuda backend's vector loads need
    storage = torch.zeros(offset + x["v"].numel(), device=device)
    storage[offset:] = x["v"].flatten()
    v_offset = storage[offset:].view(x["v"].shape)
    padded = torch.zeros(*x["v"].shape[:-1], x["v"].shape[-1] + 3, device=device)
    padded[..., 3:] = x["v"]
    v_gapped = padded[..., 3:]
    assert v_offset.storage_offset() == offset and not v_gapped.is_contiguous()

    def forward(v):
        o, final = torch.empty_like(x["v"]), torch.empty_like(x["h0"])
        stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
        _deltatrain.gdn.chunk_forward(x["q"], x["k"], v, x["g"], x["beta"], o, final, x["h0"], cu_seqlens=cu,
                                      stream=stream)
        return o, final

    expected = forward(x["v"])
    for got, want in zip(forward(v_offset), expected):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="v.*contiguous"):
        forward(v_gapped)
    v_shifted = storage[offset - 1:-1].view(x["v"].shape)  # off a 16-byte boundary
    v_shifted.copy_(x["v"])
    for v in (v_gapped, v_shifted):
        o, _ = dtt.chunk_gated_delta_rule(x["q"], x["k"], v, x["g"], x["beta"], initial_state=x["h0"],
                                          cu_seqlens=cu)
        assert torch.equal(o, expected[0])


@pytest.mark.parametrize("device", DEVICES)
def test_the_forward_keeps_the_backends_buffer_only_for_a_backward(device, rng, monkeypatch):
    """The saved buffer is asked for (and, where the backend keeps something, allocated and filled) exactly when
    autograd records a chunked forward; the gradients through it are checked above."""
    asked = []
    size_of = dtt._gdn.saved_bytes
    monkeypatch.setattr(dtt._gdn, "saved_bytes", lambda *args, **kwargs: asked.append(size_of(*args, **kwargs)) or
                        asked[-1])
    # K = V = 128: on an H100 or H200 both operations then read W from prepare, so the buffer holds something
    # (docs/cuda-backend.md, "What the forward keeps for the backward").
    leaves, cu = make_leaves(int(rng.integers(2**31)), device, torch.bfloat16 if device == "cuda" else torch.float32,
                             K=128, V=128)
    call = dict(initial_state=leaves["h0"], cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    inputs = {n: leaves[n] for n in ("q", "k", "v", "g", "beta")}
    with torch.no_grad():
        dtt.chunk_gated_delta_rule(**inputs, **call)
    dtt.chunk_gated_delta_rule(**{n: x.detach() for n, x in inputs.items()}, initial_state=leaves["h0"].detach(),
                               cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    dtt.fused_recurrent_gated_delta_rule(**inputs, **call)
    assert asked == []
    o, _ = dtt.chunk_gated_delta_rule(**inputs, **call)
    assert len(asked) == 1
    assert (asked[0] > 0) == (device == "cuda")  # the CPU backends keep nothing
    assert all(g is not None for g in torch.autograd.grad(o.float().sum(), list(leaves.values())))


def test_a_tensor_of_an_unsupported_dtype_is_refused_by_name():
    leaves, cu = make_leaves(0, "cpu", torch.float32, lengths=(8,))
    x = {n: t.detach() for n, t in leaves.items()}
    with pytest.raises(ValueError, match="beta.*dtype"):
        dtt.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"].to(torch.int16), cu_seqlens=cu)


def gradients(outputs, leaves, seed):
    """The gradients of <outputs, random cotangents> with respect to `leaves` (fixed cotangents per seed)."""
    gen = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x) for x in outputs]
    return torch.autograd.grad(outputs, leaves, cotangents)


# Head dims other than 64, 128 and 256 (fla's tests use 60 and 100), K and V unequal.
HEAD_DIMS = [(16, 200), (60, 100), (100, 60), (128, 256), (200, 16), (256, 128)]


@pytest.mark.parametrize("K,V", HEAD_DIMS, ids=[f"K{k}_V{v}" for k, v in HEAD_DIMS])
@pytest.mark.parametrize("device", DEVICES)
def test_every_head_dim_up_to_256(device, K, V, rng):
    if device == "cuda" and K > 128:
        dtype, tolerance = torch.bfloat16, 2e-2  # float32 runs K <= 128 on the GPU (shared memory)
    else:
        dtype, tolerance = torch.float32, 2e-4
    leaves, cu = make_leaves(int(rng.integers(2**31)), device, dtype, lengths=(65, 0, 3), H=1, HV=2, K=K, V=V)
    *qkvgb, h0 = leaves.values()
    got = dtt.chunk_gated_delta_rule(*qkvgb, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                     cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    want = recurrence(*leaves.values(), cu, scale=K ** -0.5)
    for name, a, b in zip(["o", "final_state"], got, want):
        assert relative_error(a, b) < tolerance, name
    seed = int(rng.integers(2**31))
    for name, a, b in zip(leaves, gradients(got, list(leaves.values()), seed),
                          gradients(want, list(leaves.values()), seed)):
        assert relative_error(a, b) < tolerance, name


@pytest.mark.parametrize("device", DEVICES)
def test_fused_recurrent_is_the_chunked_function_token_by_token(device, rng):
    """fla's fused_recurrent_gated_delta_rule signature: the same outputs as the chunked form and the float64
    recurrence, and gradients (fla has none) equal to the chunked form's: the same backward on the same inputs."""
    leaves, cu = make_leaves(int(rng.integers(2**31)), device, torch.float32, lengths=(5, 1, 0, 9), K=60, V=100)
    q, k, v, g, beta, h0 = leaves.values()
    options = dict(scale=0.3, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                   cu_seqlens=cu.to(device))
    recurrent = dtt.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **options)
    chunked = dtt.chunk_gated_delta_rule(q, k, v, g, beta, **options)
    want = recurrence(*leaves.values(), cu, scale=0.3)
    for name, a, b, c in zip(["o", "final_state"], recurrent, chunked, want):
        assert a.dtype == b.dtype, name
        assert relative_error(a, c) < 2e-4, name
        assert relative_error(a, b) < 2e-4, name
    seed = int(rng.integers(2**31))
    for name, a, b, c in zip(leaves, gradients(recurrent, list(leaves.values()), seed),
                             gradients(chunked, list(leaves.values()), seed),
                             gradients(want, list(leaves.values()), seed)):
        assert torch.equal(a, b), name
        assert relative_error(a, c) < 2e-4, name


def test_fused_recurrent_without_g_or_beta_means_no_decay_and_beta_one(rng):
    leaves, cu = make_leaves(int(rng.integers(2**31)), "cpu", torch.float32, lengths=(12,), H=1, HV=1, K=16, V=16)
    x = {n: t.detach() for n, t in leaves.items()}
    o, final = dtt.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], initial_state=x["h0"],
                                                    output_final_state=True)
    want_o, want_final = recurrence(x["q"], x["k"], x["v"], torch.zeros_like(x["g"]), torch.ones_like(x["beta"]),
                                    x["h0"], cu, scale=16 ** -0.5, l2norm=False)
    assert relative_error(o, want_o) < 2e-4 and relative_error(final, want_final) < 2e-4


# What rounding a result to its dtype alone costs, in relative_error's measure (with some margin).
ROUNDING = {torch.float32: 0, torch.float16: 2e-3, torch.bfloat16: 1e-2}

MIXED = [  # (q and k, v, g, beta, initial_state): what fla's own tests pass
    (torch.float32, torch.float16, torch.float32, torch.float16, torch.float32),
    (torch.float16, torch.float16, torch.float16, torch.float32, torch.float16),
    (torch.bfloat16, torch.float16, torch.bfloat16, torch.bfloat16, torch.bfloat16),
]


@pytest.mark.parametrize("dtypes", MIXED, ids=["qk_f32_v_f16", "g_h0_f16", "qk_bf16_v_f16"])
@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_are_cast_where_fla_casts(device, dtypes, rng):
    """The module docstring's rule: compute in the common dtype of q, k and v (float32 for float16 with
    bfloat16), g and beta in float32 unless of that dtype, states float32; o in q's dtype from the chunked form
    and in v's from the recurrent one; every gradient in its input's dtype. Values against the float64
    recurrence on the same (rounded) inputs."""
    qk, v_dtype, g_dtype, beta_dtype, h0_dtype = dtypes
    leaves, cu = make_leaves(int(rng.integers(2**31)), device, torch.float32, lengths=(40, 30), K=64, V=64)
    types = dict(q=qk, k=qk, v=v_dtype, g=g_dtype, beta=beta_dtype, h0=h0_dtype)
    leaves = {n: x.detach().to(types[n]).requires_grad_(True) for n, x in leaves.items()}
    compute = torch.promote_types(qk, v_dtype)
    # What the backend owes in the computing dtype (float16 on the GPU: tensor-core products of float16 operands
    # and intermediates, as tests/gdn_cuda's tolerance), gradients twice that.
    tolerance = 5e-4 if compute == torch.float32 else 8e-3 if device == "cuda" else 2e-3
    want = recurrence(*leaves.values(), cu, scale=0.25)
    seed = int(rng.integers(2**31))
    expected = gradients(want, list(leaves.values()), seed)
    *qkvgb, h0 = leaves.values()
    options = dict(scale=0.25, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                   cu_seqlens=cu.to(device))
    for form, o_dtype in [(dtt.chunk_gated_delta_rule, qk), (dtt.fused_recurrent_gated_delta_rule, v_dtype)]:
        q, k, v, g, beta = qkvgb
        got = form(q, k, v, g=g, beta=beta, **options)
        assert got[0].dtype == o_dtype and got[1].dtype == torch.float32
        assert relative_error(got[0], want[0]) < max(tolerance, ROUNDING[o_dtype])
        assert relative_error(got[1], want[1]) < tolerance
        for name, a, b in zip(leaves, gradients(got, list(leaves.values()), seed), expected):
            assert a.dtype == leaves[name].dtype, name
            assert relative_error(a, b) < max(tolerance, ROUNDING[a.dtype]), name


def test_fla_options_deltatrain_does_not_implement_are_refused_by_name():
    leaves, cu = make_leaves(0, "cpu", torch.float32, lengths=(8,), H=1, HV=1, K=16, V=16)
    q, k, v, g, beta, h0 = (t.detach() for t in leaves.values())
    for option in ("use_beta_sigmoid_in_kernel", "state_v_first", "use_gate_in_kernel"):
        with pytest.raises(ValueError, match=option):
            dtt.chunk_gated_delta_rule(q, k, v, g, beta, **{option: True})
    with pytest.raises(ValueError, match="gk"):
        dtt.fused_recurrent_gated_delta_rule(q, k, v, g, gk=torch.zeros_like(q), beta=beta)
    with pytest.raises(TypeError, match="surprise"):
        dtt.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, surprise=1)
    # options that only tune fla's kernels are accepted and change nothing
    a, _ = dtt.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=32)
    b, _ = dtt.chunk_gated_delta_rule(q, k, v, g, beta)
    assert torch.equal(a, b)
