"""deltatrain.torch: outputs and gradients of fla's signature against autograd through an independent float64
torch recurrence, on CPU tensors and (where there is a GPU) CUDA tensors; tensors reach the kernels by
address, views included. Skipped where torch is not installed."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltatrain.torch as dtt  # noqa: E402
from deltatrain import _deltatrain  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def recurrence(q, k, v, g, beta, h0, cu_seqlens, scale):
    """The gated delta rule token by token in float64 torch, differentiable; l2norm of q and k included."""
    q, k, v, g, beta, h0 = (x.double() for x in (q, k, v, g, beta, h0))
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


def test_a_tensor_of_an_unsupported_dtype_is_refused_by_name():
    leaves, cu = make_leaves(0, "cpu", torch.float32, lengths=(8,))
    x = {n: t.detach() for n, t in leaves.items()}
    with pytest.raises(ValueError, match="beta.*dtype"):
        dtt.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"].to(torch.int16), cu_seqlens=cu)
