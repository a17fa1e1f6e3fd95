"""deltatrain.torch: fla's ``chunk_gated_delta_rule`` on deltatrain's kernels, differentiable in PyTorch.

A trainer that calls fla switches by changing one import::

    # from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from deltatrain.torch import chunk_gated_delta_rule

    o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                            output_final_state=False, use_qk_l2norm_in_kernel=False,
                                            cu_seqlens=None, cu_seqlens_cpu=None)

Gradients flow to q, k, v, g, beta and initial_state. Tensors reach the kernels through DLPack without
copies (non-contiguous inputs, and views that start off a 16-byte boundary, are copied first, as fla's
input_guard makes inputs contiguous), outputs are allocated by torch, and the kernels run on torch's current
stream. With cu_seqlens on the GPU, pass its host copy as cu_seqlens_cpu (as with fla) so that no call waits
for the device; without it, one copy per call reads the boundaries back.
"""

import torch

from . import _deltatrain

__all__ = ["chunk_gated_delta_rule"]

_gdn = _deltatrain.gdn

# fla options that change the function computed; deltatrain does not implement them.
_UNSUPPORTED = ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first",
                "cp_context", "head_first")
# fla options that only tune how fla computes (chunk_size 64 is what deltatrain uses).
_IGNORED = ("chunk_indices", "chunk_size")


def _contiguous_aligned(x):
    # The cuda backend reads rows as 16-byte vectors; torch allocates at 256-byte boundaries, so only a view
    # that starts inside its storage can be off (fla takes those, so they are copied here, not refused).
    if x is None:
        return None
    x = x.contiguous()
    return x.clone() if x.data_ptr() % 16 else x


def _state_dtype(q):
    # States are float32, as in fla; a float64 call is float64 throughout (the library's rule).
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _stream(x):
    return torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0


class _ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, cu_seqlens_cpu, backend):
        sequences = cu_seqlens.numel() - 1 if cu_seqlens is not None else q.shape[0]
        o = torch.empty_like(v)
        final_state = None
        if output_final_state:
            final_state = torch.empty(sequences, v.shape[2], q.shape[3], v.shape[3], dtype=_state_dtype(q),
                                      device=q.device)
        options = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                       cu_seqlens_cpu=cu_seqlens_cpu, backend=backend, stream=_stream(q))
        _gdn.chunk_forward(q.detach(), k.detach(), v.detach(), g.detach(), beta.detach(), o, final_state,
                           None if initial_state is None else initial_state.detach(), **options)
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.options = options
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dg, dbeta = torch.empty_like(g), torch.empty_like(beta)
        dh0 = None if initial_state is None else torch.empty_like(initial_state)
        options = dict(ctx.options, stream=_stream(q))
        _gdn.chunk_backward(q.detach(), k.detach(), v.detach(), g.detach(), beta.detach(), do.contiguous(),
                            dq, dk, dv, dg, dbeta, _contiguous_aligned(dht), dh0,
                            None if initial_state is None else initial_state.detach(), **options)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None, None


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, backend="auto", **kwargs):
    """fla's chunk_gated_delta_rule: returns (o, final_state), final_state None unless asked.

    q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H); g (log-space decay), beta [B, T, HV];
    initial_state [N, HV, K, V]; cu_seqlens [N + 1] packs N sequences along T (B == 1), with
    cu_seqlens_cpu=its host copy as a keyword. backend: "auto" or a name from deltatrain.backends().
    """
    cu_seqlens_cpu = kwargs.pop("cu_seqlens_cpu", None)
    for name in _UNSUPPORTED:
        if kwargs.get(name):
            raise ValueError(f"{name}={kwargs[name]!r} is an fla option deltatrain does not implement")
        kwargs.pop(name, None)
    for name in _IGNORED:
        kwargs.pop(name, None)
    if kwargs:
        raise TypeError(f"chunk_gated_delta_rule() got unexpected keyword arguments {sorted(kwargs)}")
    if cu_seqlens is not None and cu_seqlens.is_cuda and cu_seqlens_cpu is None:
        cu_seqlens_cpu = cu_seqlens.cpu()
    if initial_state is not None and initial_state.dtype != _state_dtype(q):
        initial_state = initial_state.to(_state_dtype(q))  # as fla casts it to float32 (differentiable)
    q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu = (
        _contiguous_aligned(x) for x in (q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu))
    return _ChunkGatedDeltaRule.apply(q, k, v, g, beta, initial_state, scale, output_final_state,
                                      use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, backend)
