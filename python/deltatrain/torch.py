"""deltatrain.torch: fla's gated delta rule on deltatrain's kernels, differentiable in PyTorch.

A trainer that calls fla switches by changing one import::

    # from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from deltatrain.torch import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

or without editing it at all: ``deltatrain.torch.install_as_fla()`` before that code is imported makes
``fla.ops.gated_delta_rule`` hand out these two functions (see its docstring).

Both functions take fla 0.6's signatures and return ``(o, final_state)``, final_state None unless asked.
Gradients flow to q, k, v, g, beta and initial_state through the chunked backward, for the recurrent form too
(fla's has none). Tensors reach the kernels through DLPack without copies (non-contiguous inputs, and views
that start off a 16-byte boundary, are copied first, as fla's input_guard makes inputs contiguous), outputs are
allocated by torch, and the kernels run on torch's current stream. With cu_seqlens on the GPU, pass its host
copy as cu_seqlens_cpu (as with fla) so that no call waits for the device; without it, one copy per call reads
the boundaries back.

Dtypes, as fla accepts them (its Triton kernels load every tensor in its own dtype and compute in float32):

- q, k and v may differ: the call computes in their common dtype (torch.promote_types: float32 with
  float16 is float32, bfloat16 with float16 is float32), and those of another dtype are cast to it.
- g and beta are used as given when float32 or of that common dtype, and cast to float32 otherwise.
- initial_state may be any floating dtype: it is cast to float32, the dtype of states (fla loads it as
  float32); final_state is float32.
- o has q's dtype from chunk_gated_delta_rule and v's dtype from fused_recurrent_gated_delta_rule, as fla's.
- Every gradient has its input's dtype.
- A call whose q, k or v is float64 computes in float64 throughout (g, beta and the states too).
The casts are part of the autograd graph; a call whose tensors already agree copies nothing.

Head dims: any K and V up to 256 (the CPU backends take any), as fla. fla's options that change the function
(use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cp_context, per-key or
per-value decays gk and gv) raise ValueError; those that tune how fla computes (chunk_size, chunk_indices)
are ignored. ``backend`` ("auto" or a name from deltatrain.backends()) picks the kernels.
"""

import importlib.abc
import importlib.util
import sys

import torch

from . import _deltatrain

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "install_as_fla"]

_gdn = _deltatrain.gdn

# fla options that only tune how fla computes (chunk_size 64 is what deltatrain uses).
_IGNORED = ("chunk_indices", "chunk_size")


def _refuse(**options):
    """fla options that change the function computed; deltatrain does not implement them."""
    for name, value in options.items():
        if value is not None and value is not False:
            shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
            raise ValueError(f"{name}={shown} is an fla option deltatrain does not implement")


def _contiguous_aligned(x):
    # The cuda backend reads rows as 16-byte vectors; torch allocates at 256-byte boundaries, so only a view
    # that starts inside its storage can be off (fla takes those, so they are copied here, not refused).
    if x is None:
        return None
    x = x.contiguous()
    return x.clone() if x.data_ptr() % 16 else x


def _floating(*tensors):
    return all(isinstance(x, torch.Tensor) and x.is_floating_point() for x in tensors)


def _as_fla_casts(q, k, v, g, beta, initial_state):
    """The dtypes rule of the module docstring. Anything not a floating tensor is passed on unchanged, for the
    library to refuse by name."""
    if not _floating(q, k, v):
        return q, k, v, g, beta, initial_state
    compute = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    q, k, v = (x.to(compute) for x in (q, k, v))
    wide = compute == torch.float64

    def gate(x):
        if not _floating(x) or x.dtype in ((torch.float64,) if wide else (torch.float32, compute)):
            return x
        return x.to(torch.float64 if wide else torch.float32)

    if _floating(initial_state):
        initial_state = initial_state.to(torch.float64 if wide else torch.float32)
    return q, k, v, gate(g), gate(beta), initial_state


def _stream(x):
    return torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0


# The call's options that size its saved buffer (_gdn.saved_bytes).
_SAVED_BYTES_OPTIONS = ("scale", "use_qk_l2norm_in_kernel", "cu_seqlens", "cu_seqlens_cpu", "backend")


class _GatedDeltaRule(torch.autograd.Function):
    """The forward `run` (the chunked or the recurrent kernels: the same function) and the chunked backward."""

    @staticmethod
    def forward(ctx, run, q, k, v, g, beta, initial_state, scale, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, cu_seqlens_cpu, backend, keep_for_backward):
        sequences = cu_seqlens.numel() - 1 if cu_seqlens is not None else q.shape[0]
        o = torch.empty_like(v)
        final_state = None
        if output_final_state:
            state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            final_state = torch.empty(sequences, v.shape[2], q.shape[3], v.shape[3], dtype=state_dtype,
                                      device=q.device)
        options = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                       cu_seqlens_cpu=cu_seqlens_cpu, backend=backend, stream=_stream(q))
        inputs = (q.detach(), k.detach(), v.detach(), g.detach(), beta.detach())
        h0 = None if initial_state is None else initial_state.detach()
        # A chunked forward whose backward may run keeps what the backend asks for it (the cuda backend: the
        # chunks' decays and inverses, ~400 bytes a token and value head), so that the backward need not recompute it.
        saved = None
        if keep_for_backward:
            saved_bytes = _gdn.saved_bytes(*inputs, h0, **{n: options[n] for n in _SAVED_BYTES_OPTIONS})
            if saved_bytes:
                saved = torch.empty(saved_bytes, dtype=torch.uint8, device=q.device)
        run(*inputs, o, final_state, h0, **options, saved=saved)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, saved)
        ctx.options = options
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, saved = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dg, dbeta = torch.empty_like(g), torch.empty_like(beta)
        dh0 = None if initial_state is None else torch.empty_like(initial_state)
        options = dict(ctx.options, stream=_stream(q), saved=saved)
        _gdn.chunk_backward(q.detach(), k.detach(), v.detach(), g.detach(), beta.detach(), do.contiguous(),
                            dq, dk, dv, dg, dbeta, _contiguous_aligned(dht), dh0,
                            None if initial_state is None else initial_state.detach(), **options)
        return None, dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None, None, None


def _apply(run, out_dtype, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
           cu_seqlens, cu_seqlens_cpu, backend):
    if cu_seqlens is not None and cu_seqlens.is_cuda and cu_seqlens_cpu is None:
        cu_seqlens_cpu = cu_seqlens.cpu()
    q, k, v, g, beta, initial_state = _as_fla_casts(q, k, v, g, beta, initial_state)
    q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu = (
        _contiguous_aligned(x) for x in (q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu))
    # Whether autograd will record this call (inside the Function's forward grad mode is always off, and
    # ctx.needs_input_grad ignores it): a chunked forward then keeps what its backward would recompute.
    keep_for_backward = run is _gdn.chunk_forward and torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    o, final_state = _GatedDeltaRule.apply(run, q, k, v, g, beta, initial_state, scale, output_final_state,
                                           use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, backend,
                                           keep_for_backward)
    if _floating(o) and out_dtype.is_floating_point:
        o = o.to(out_dtype)
    return o, final_state


def _no_unknown(function, kwargs):
    for name in _IGNORED:
        kwargs.pop(name, None)
    if kwargs:
        raise TypeError(f"{function}() got unexpected keyword arguments {sorted(kwargs)}")


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, *, backend="auto", **kwargs):
    """fla's chunk_gated_delta_rule (training, prefill): returns (o, final_state).

    q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H); g (log-space decay), beta [B, T, HV];
    initial_state [N, HV, K, V]; cu_seqlens [N + 1] packs N sequences along T (B == 1), cu_seqlens_cpu its
    host copy. scale defaults to K ** -0.5. Dtypes and the options not implemented: see the module docstring.
    """
    _refuse(use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            state_v_first=state_v_first, cp_context=cp_context,
            use_gate_in_kernel=kwargs.pop("use_gate_in_kernel", None), head_first=kwargs.pop("head_first", None))
    for name in ("A_log", "dt_bias"):  # fla reads them only with use_gate_in_kernel
        kwargs.pop(name, None)
    _no_unknown("chunk_gated_delta_rule", kwargs)
    return _apply(_gdn.chunk_forward, q.dtype, q, k, v, g, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, backend)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, *, backend="auto", **kwargs):
    """fla's fused_recurrent_gated_delta_rule (rollout, decode): the same function token by token; returns
    (o, final_state), o in v's dtype.

    Arguments as chunk_gated_delta_rule; g None means no decay (g = 0) and beta None means beta = 1, as in fla.
    Differentiable (through the chunked backward). cu_seqlens_cpu may be passed as a keyword.
    """
    _refuse(gk=gk, gv=gv, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            state_v_first=state_v_first)
    cu_seqlens_cpu = kwargs.pop("cu_seqlens_cpu", None)
    _no_unknown("fused_recurrent_gated_delta_rule", kwargs)
    if isinstance(v, torch.Tensor):
        gates = dict(dtype=torch.float64 if v.dtype == torch.float64 else torch.float32, device=v.device)
        if g is None:
            g = torch.zeros(v.shape[:3], **gates)
        if beta is None:
            beta = torch.ones(v.shape[:3], **gates)
    out_dtype = v.dtype if isinstance(v, torch.Tensor) else q.dtype
    return _apply(_gdn.recurrent_forward, out_dtype, q, k, v, g, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, backend)


# What install_as_fla puts in place of fla's functions, under fla's names and aliases.
_AS_FLA = {
    "chunk_gated_delta_rule": chunk_gated_delta_rule,
    "chunk_gdn": chunk_gated_delta_rule,
    "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
    "fused_recurrent_gdn": fused_recurrent_gated_delta_rule,
}
_FLA_MODULE = "fla.ops.gated_delta_rule"


def _take_over(module):
    for name, function in _AS_FLA.items():
        setattr(module, name, function)


class _PatchingLoader(importlib.abc.Loader):
    """fla's own loader of fla.ops.gated_delta_rule, which then replaces the module's functions with ours (so
    that fla.ops, fla's layers and everything importing them from there see ours too)."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _take_over(module)

    def __getattr__(self, name):  # get_source, get_code, ...: fla's loader answers
        return getattr(self._loader, name)


class _StandInLoader(importlib.abc.Loader):
    """fla is not installed: a package `fla`, `fla.ops` or `fla.ops.gated_delta_rule` of our own, the last
    holding our functions under fla's names."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__doc__ = "A stand-in for fla made by deltatrain.torch.install_as_fla() (fla is not installed)."
        if module.__name__ == _FLA_MODULE:
            _take_over(module)
            module.__all__ = list(_AS_FLA)


class _FlaFinder(importlib.abc.MetaPathFinder):
    _PACKAGES = ("fla", "fla.ops", _FLA_MODULE)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self._PACKAGES:
            return None
        spec = None
        for finder in sys.meta_path:  # the module as it would be found without us
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None:
            return importlib.util.spec_from_loader(fullname, _StandInLoader(), is_package=True)
        if fullname == _FLA_MODULE and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


def install_as_fla():
    """Make ``fla.ops.gated_delta_rule`` hand out deltatrain's chunk_gated_delta_rule and
    fused_recurrent_gated_delta_rule (and fla's aliases chunk_gdn, fused_recurrent_gdn), so that code which
    imports them from there (HF transformers' Qwen3-Next and Qwen3.5 modeling, fla's own layers, Megatron,
    slime) runs on deltatrain's kernels without being edited.

    With fla installed, its module is loaded as usual and these names are then replaced (its other modules,
    fla.ops.gated_delta_rule.naive say, stay fla's); without fla, stand-in packages fla, fla.ops and
    fla.ops.gated_delta_rule hold just these functions. Call it before the code that imports fla is imported:
    a name bound by an earlier ``from fla.ops.gated_delta_rule import ...`` stays fla's (transformers binds
    them when its modeling module is imported). fla.ops.gated_delta_rule and fla.ops are updated in place if
    they are already imported. Calling it again does nothing more.
    """
    if not any(isinstance(finder, _FlaFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FlaFinder())
    if _FLA_MODULE in sys.modules:
        _take_over(sys.modules[_FLA_MODULE])
        if "fla.ops" in sys.modules:
            _take_over(sys.modules["fla.ops"])
