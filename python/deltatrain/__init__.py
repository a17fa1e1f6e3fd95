"""deltatrain: Gated DeltaNet training runtime for colocated RL.

The GDN operator with fla's conventions (seq-first layout, GVA, packed varlen, in-kernel q/k L2 norm):

    o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, ...)
    dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, ...)
    o, final_state = fused_recurrent_gated_delta_rule(q, k, v, g, beta, ...)
    backends()

Inputs are NumPy arrays or DLPack tensors. Outputs are NumPy arrays, or torch tensors on the input's
device when the inputs are torch tensors: o has v's dtype; states are float32 (float64 for float64
inputs). bfloat16 NumPy arrays (ml_dtypes) are accepted. Bad arguments raise ValueError naming the
argument; a backend that cannot serve the call raises RuntimeError naming the backend and the reason.

The low-level functions, which take preallocated outputs, a CUDA stream and a host copy of cu_seqlens,
are in `deltatrain._deltatrain.gdn` (see their docstrings); `deltatrain.torch` builds autograd on them.
"""

import numpy as _np

from . import _deltatrain

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_bwd",
    "fused_recurrent_gated_delta_rule",
    "backends",
    "parse_version",
]

# CMakeLists.txt's project version, compiled into the native module (the package metadata has the same one).
__version__ = _deltatrain.__version__

_gdn = _deltatrain.gdn

# Robust version parsing for gating on library, runtime and driver versions:
# parse_version("2.9.0+cu128").release == (2, 9, 0); parse_version("12.8rc1") >= parse_version("12.8").
parse_version = _deltatrain.parse_version


def backends():
    """Every GDN backend, fastest first: a list of {name, available, reason, details, priority}."""
    return _gdn.backends()


def _is_torch(x):
    module = type(x).__module__
    return module == "torch" or module.startswith("torch.")


class _Call:
    """One call's validated sizes, and where and how its outputs are allocated."""

    def __init__(self, q, k, v, g, beta, scale, initial_state, cu_seqlens):
        self.torch = _is_torch(q)
        self.device = q.device if self.torch else None
        self.stream = 0
        self.cu_seqlens_cpu = None
        if self.torch and q.is_cuda:
            import torch

            self.stream = torch.cuda.current_stream(q.device).cuda_stream
            if cu_seqlens is not None and cu_seqlens.is_cuda:
                # The library reads sequence boundaries on the host; this copy synchronises once per call.
                self.cu_seqlens_cpu = cu_seqlens.cpu()
        self.sizes = _gdn.problem(q, k, v, g, beta, initial_state, scale=scale, cu_seqlens=cu_seqlens,
                                  cu_seqlens_cpu=self.cu_seqlens_cpu)

    def shape(self, kind):
        s = self.sizes
        return {
            "qk": (s["B"], s["T"], s["H"], s["K"]),
            "v": (s["B"], s["T"], s["HV"], s["V"]),
            "gate": (s["B"], s["T"], s["HV"]),
            "state": (s["N"], s["HV"], s["K"], s["V"]),
        }[kind]

    def empty(self, name, kind, dtype_key):
        """The output `name`, uninitialised; a MemoryError names it (the framework's own says only a size)."""
        dtype = self.sizes[dtype_key]
        shape = self.shape(kind)
        try:
            if self.torch:
                import torch

                return torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            if dtype == "bfloat16":
                try:
                    import ml_dtypes
                except ImportError as error:
                    raise ValueError("bfloat16 outputs as NumPy arrays need the ml_dtypes package; "
                                     "or pass torch tensors") from error
                return _np.empty(shape, dtype=ml_dtypes.bfloat16)
            return _np.empty(shape, dtype=dtype)
        except MemoryError as error:
            raise MemoryError(f"out of memory allocating the output '{name}' of shape {list(shape)} ({dtype}): "
                              f"{error}") from error

    def common(self, scale, use_qk_l2norm_in_kernel, cu_seqlens, backend):
        return dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                    cu_seqlens_cpu=self.cu_seqlens_cpu, backend=backend, stream=self.stream)


def _detached(*tensors):
    """torch refuses to export tensors that require grad; these functions are not differentiable
    (deltatrain.torch is), so they read the values only."""
    return [t.detach() if _is_torch(t) else t for t in tensors]


def _forward(run, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
             cu_seqlens, backend):
    q, k, v, g, beta, initial_state = _detached(q, k, v, g, beta, initial_state)
    call = _Call(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    o = call.empty("o", "v", "io_dtype")
    final_state = call.empty("final_state", "state", "state_dtype") if output_final_state else None
    run(q, k, v, g, beta, o, final_state, initial_state,
        **call.common(scale, use_qk_l2norm_in_kernel, cu_seqlens, backend))
    return o, final_state


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, backend="auto"):
    """The chunked forward (training, prefill). Returns (o, final_state); final_state is None unless asked.

    q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H (value head j reads q/k head j // (HV // H));
    g (log-space decay) and beta [B, T, HV]; initial_state [N, HV, K, V]; cu_seqlens [N + 1] (int32 or
    int64, B == 1) packs N sequences along T. scale defaults to K ** -0.5. backend: "auto" (the fastest
    that can serve the call) or a name from backends().
    """
    return _forward(_gdn.chunk_forward, q, k, v, g, beta, scale, initial_state, output_final_state,
                    use_qk_l2norm_in_kernel, cu_seqlens, backend)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, backend="auto"):
    """The same function token by token (rollout / decode). Returns (o, final_state)."""
    return _forward(_gdn.recurrent_forward, q, k, v, g, beta, scale, initial_state, output_final_state,
                    use_qk_l2norm_in_kernel, cu_seqlens, backend)


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, backend="auto"):
    """Gradients of chunk_gated_delta_rule given do (like o) and dht (like final_state, or None).

    Returns (dq, dk, dv, dg, dbeta, dh0), each shaped and typed like its input; dh0 is None without an
    initial state.
    """
    q, k, v, g, beta, do, dht, initial_state = _detached(q, k, v, g, beta, do, dht, initial_state)
    call = _Call(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    dq, dk = call.empty("dq", "qk", "io_dtype"), call.empty("dk", "qk", "io_dtype")
    dv = call.empty("dv", "v", "io_dtype")
    dg, dbeta = call.empty("dg", "gate", "gate_dtype"), call.empty("dbeta", "gate", "beta_dtype")
    dh0 = call.empty("dh0", "state", "state_dtype") if initial_state is not None else None
    _gdn.chunk_backward(q, k, v, g, beta, do, dq, dk, dv, dg, dbeta, dht, dh0, initial_state,
                        **call.common(scale, use_qk_l2norm_in_kernel, cu_seqlens, backend))
    return dq, dk, dv, dg, dbeta, dh0
