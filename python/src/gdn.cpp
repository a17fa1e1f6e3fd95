// The GDN operator's low-level binding, `_deltatrain.gdn`: every tensor, outputs included, is passed in
// (the Python layer in deltatrain/__init__.py and the autograd wrapper in deltatrain/torch.py allocate
// them with the caller's framework). The GIL is released while the operator runs.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "deltatrain/core/error.h"
#include "deltatrain/gdn/backend.h"
#include "deltatrain/gdn/gdn.h"
#include "deltatrain/gdn/registry.h"
#include "tensor.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace deltatrain::python {
namespace {

using gdn::Inputs;
using gdn::Options;

Inputs inputs_of(TensorArgs& args, nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta,
                 nb::handle initial_state, nb::handle cu_seqlens, nb::handle cu_seqlens_cpu) {
  Inputs in{args.input(q, "q"), args.input(k, "k"), args.input(v, "v"), args.input(g, "g"), args.input(beta, "beta"),
            std::nullopt, std::nullopt, std::nullopt};
  in.initial_state = args.optional_input(initial_state, "initial_state");
  in.cu_seqlens = args.optional_input(cu_seqlens, "cu_seqlens");
  in.cu_seqlens_host = args.optional_input(cu_seqlens_cpu, "cu_seqlens_cpu");
  return in;
}

// Every argument arrives as a Python object and is converted here (tensors by TensorArgs, None included): a
// wrong type is then a ValueError naming the argument, where a typed parameter would give nanobind's dump of
// the function's signature.
[[noreturn]] void wrong_type(nb::handle object, const char* name, const char* expected) {
  throw InvalidArgument(name, std::string("expected ") + expected + ", got " + nb::type_name(object.type()).c_str() +
                                  " " + nb::repr(object).c_str());
}

template <class Number>
Number number_of(nb::handle object, const char* name, const char* expected) {
  Number value{};
  if (PyBool_Check(object.ptr()) || !nb::try_cast(object, value)) wrong_type(object, name, expected);
  return value;
}

bool flag_of(nb::handle object, const char* name) {
  bool value = false;  // True or False, as a typed bool parameter takes
  if (!nb::try_cast(object, value)) wrong_type(object, name, "True or False");
  return value;
}

std::string text_of(nb::handle object, const char* name, const char* expected) {
  if (!nb::isinstance<nb::str>(object)) wrong_type(object, name, expected);
  return nb::cast<std::string>(object);
}

Options options_of(nb::handle scale, nb::handle l2norm, nb::handle backend, nb::handle stream,
                   nb::handle cpu_threads) {
  Options options;
  if (!scale.is_none()) options.scale = number_of<double>(scale, "scale", "a float or None");
  options.use_qk_l2norm_in_kernel = flag_of(l2norm, "use_qk_l2norm_in_kernel");
  options.backend = text_of(backend, "backend", "a backend's name (a str)");
  options.stream = reinterpret_cast<void*>(
      number_of<std::uintptr_t>(stream, "stream", "an int (a cudaStream_t, 0 = the default stream)"));
  options.cpu_threads = number_of<int>(cpu_threads, "cpu_threads", "an int (0 = all cores)");
  return options;
}

using ForwardFunction = void (*)(const Inputs&, const gdn::ForwardOutputs&, const Options&);

template <ForwardFunction run>
void forward(nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta, nb::handle o,
             nb::handle final_state, nb::handle initial_state, nb::handle scale, nb::handle l2norm,
             nb::handle cu_seqlens, nb::handle cu_seqlens_cpu, nb::handle backend, nb::handle stream,
             nb::handle cpu_threads, nb::handle saved) {
  TensorArgs args;
  const Inputs in = inputs_of(args, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu);
  const gdn::ForwardOutputs out{args.output(o, "o"), args.optional_output(final_state, "final_state"),
                                args.optional_output(saved, "saved")};
  const Options options = options_of(scale, l2norm, backend, stream, cpu_threads);
  nb::gil_scoped_release unlocked;
  run(in, out, options);
}

void backward(nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta, nb::handle d_o, nb::handle dq,
              nb::handle dk, nb::handle dv, nb::handle dg, nb::handle dbeta, nb::handle dht, nb::handle dh0,
              nb::handle initial_state, nb::handle scale, nb::handle l2norm, nb::handle cu_seqlens,
              nb::handle cu_seqlens_cpu, nb::handle backend, nb::handle stream, nb::handle cpu_threads,
              nb::handle saved) {
  TensorArgs args;
  const Inputs in = inputs_of(args, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu);
  const gdn::BackwardInputs grads_in{args.input(d_o, "do"), args.optional_input(dht, "dht"),
                                     args.optional_input(saved, "saved")};
  const gdn::Gradients grads_out{args.output(dq, "dq"),       args.output(dk, "dk"),
                                 args.output(dv, "dv"),       args.output(dg, "dg"),
                                 args.output(dbeta, "dbeta"), args.optional_output(dh0, "dh0")};
  const Options options = options_of(scale, l2norm, backend, stream, cpu_threads);
  nb::gil_scoped_release unlocked;
  gdn::chunk_backward(in, grads_in, grads_out, options);
}

// The validated sizes and dtypes of a call, for allocating its outputs.
nb::dict problem(nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta, nb::handle initial_state,
                 nb::handle scale, nb::handle cu_seqlens, nb::handle cu_seqlens_cpu) {
  TensorArgs args;
  const Inputs in = inputs_of(args, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu);
  const Options options = options_of(scale, nb::bool_(false), nb::str("auto"), nb::int_(0), nb::int_(0));
  const gdn::Problem p = gdn::make_problem(in, options, gdn::Operation::chunk_forward);
  nb::dict d;
  d["B"] = p.B, d["T"] = p.T, d["H"] = p.H, d["HV"] = p.HV, d["K"] = p.K, d["V"] = p.V, d["N"] = p.N;
  d["scale"] = p.scale;
  d["io_dtype"] = dtype_name(p.io_dtype);
  d["gate_dtype"] = dtype_name(p.gate_dtype);
  d["beta_dtype"] = dtype_name(p.beta_dtype);
  d["state_dtype"] = dtype_name(p.state_dtype);
  d["device"] = device_name(p.device);
  return d;
}

std::size_t saved_bytes(nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta,
                        nb::handle initial_state, nb::handle scale, nb::handle l2norm, nb::handle cu_seqlens,
                        nb::handle cu_seqlens_cpu, nb::handle backend) {
  TensorArgs args;
  const Inputs in = inputs_of(args, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu);
  return gdn::forward_saved_bytes(in, options_of(scale, l2norm, backend, nb::int_(0), nb::int_(0)));
}

std::string resolve_backend(nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta,
                            nb::handle initial_state, nb::handle scale, nb::handle l2norm, nb::handle cu_seqlens,
                            nb::handle cu_seqlens_cpu, nb::handle backend, nb::handle backward) {
  TensorArgs args;
  const Inputs in = inputs_of(args, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu);
  return gdn::resolve_backend(in, options_of(scale, l2norm, backend, nb::int_(0), nb::int_(0)),
                              flag_of(backward, "backward"));
}

nb::list backends() {
  nb::list list;
  for (const auto& backend : gdn::Registry::instance().backends()) {
    const gdn::Availability here = backend->available();
    nb::dict details;
    for (const auto& [key, value] : backend->details()) details[key.c_str()] = value;
    nb::dict entry;
    entry["name"] = backend->name();
    entry["available"] = here.ok;
    entry["reason"] = here.reason;
    entry["details"] = details;
    entry["priority"] = backend->priority();
    list.append(entry);
  }
  return list;
}

constexpr const char* kForwardDoc = R"(Chunked forward of the gated delta rule, into preallocated outputs.

chunk_forward(q, k, v, g, beta, o, final_state=None, initial_state=None, *, scale=None,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, backend="auto",
              stream=0, cpu_threads=0, saved=None) -> None

Tensors are NumPy arrays or DLPack tensors (torch, ...), contiguous, on one device:
  q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] (float32 or q's dtype);
  initial_state [N, HV, K, V] float32 (float64 for float64 inputs) or None;
  cu_seqlens [N + 1] int32/int64 (B must be 1) or None, with cu_seqlens_cpu a host copy when it lives on a GPU;
  o [B, T, HV, V] with v's dtype (written); final_state [N, HV, K, V] like initial_state or None (written).
scale defaults to K ** -0.5; stream is a cudaStream_t as an int (0: the default stream); cpu_threads 0 = all.
saved (chunk_forward only): a uint8 tensor of saved_bytes(...) bytes the backend fills with what its backward
would compute again; pass it to chunk_backward with the same inputs and options (written).
Raises ValueError for bad arguments (naming the argument) and RuntimeError when the backend cannot serve
the call (naming the backend and the reason). The GIL is released during the computation.)";

constexpr const char* kRecurrentDoc = R"(The same function computed token by token (the rollout / decode step).

recurrent_forward(q, k, v, g, beta, o, final_state=None, initial_state=None, *, scale=None,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, backend="auto",
                  stream=0, cpu_threads=0, saved=None) -> None

Arguments as chunk_forward; saved must be None (the recurrent step keeps nothing).)";

constexpr const char* kBackwardDoc = R"(Backward of chunk_forward, into preallocated gradients.

chunk_backward(q, k, v, g, beta, do, dq, dk, dv, dg, dbeta, dht=None, dh0=None, initial_state=None, *,
               scale=None, use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None,
               backend="auto", stream=0, cpu_threads=0, saved=None) -> None

do has o's shape and dtype; dht is the final-state gradient (like final_state) or None. Each written
gradient has its input's shape and dtype (dq like q, ..., dg like g, dbeta like beta); dh0 is required
exactly when initial_state is given. saved: what chunk_forward filled for these inputs and options, or None
(the gradients are the same bit for bit; with it the backward skips that work). Errors and threading as
chunk_forward.)";

}  // namespace

void bind_gdn(nb::module_& m) {
  register_error_translators();
  nb::module_ gdn = m.def_submodule("gdn", "The Gated DeltaNet operator (low level: callers allocate outputs)");
  // Tensors accept None too, so that a missing one is refused naming it (TensorArgs) like any other bad one.
  gdn.def("chunk_forward", &forward<gdn::chunk_forward>, "q"_a.none(), "k"_a.none(), "v"_a.none(), "g"_a.none(),
          "beta"_a.none(), "o"_a.none(), "final_state"_a.none() = nb::none(), "initial_state"_a.none() = nb::none(),
          nb::kw_only(), "scale"_a.none() = nb::none(), "use_qk_l2norm_in_kernel"_a = nb::bool_(false),
          "cu_seqlens"_a.none() = nb::none(), "cu_seqlens_cpu"_a.none() = nb::none(), "backend"_a = nb::str("auto"),
          "stream"_a = nb::int_(0), "cpu_threads"_a = nb::int_(0), "saved"_a.none() = nb::none(), kForwardDoc);
  gdn.def("recurrent_forward", &forward<gdn::recurrent_forward>, "q"_a.none(), "k"_a.none(), "v"_a.none(),
          "g"_a.none(), "beta"_a.none(), "o"_a.none(), "final_state"_a.none() = nb::none(),
          "initial_state"_a.none() = nb::none(), nb::kw_only(), "scale"_a.none() = nb::none(),
          "use_qk_l2norm_in_kernel"_a = nb::bool_(false), "cu_seqlens"_a.none() = nb::none(),
          "cu_seqlens_cpu"_a.none() = nb::none(), "backend"_a = nb::str("auto"), "stream"_a = nb::int_(0),
          "cpu_threads"_a = nb::int_(0), "saved"_a.none() = nb::none(), kRecurrentDoc);
  gdn.def("chunk_backward", &backward, "q"_a.none(), "k"_a.none(), "v"_a.none(), "g"_a.none(), "beta"_a.none(),
          "do"_a.none(), "dq"_a.none(), "dk"_a.none(), "dv"_a.none(), "dg"_a.none(), "dbeta"_a.none(),
          "dht"_a.none() = nb::none(), "dh0"_a.none() = nb::none(), "initial_state"_a.none() = nb::none(),
          nb::kw_only(), "scale"_a.none() = nb::none(), "use_qk_l2norm_in_kernel"_a = nb::bool_(false),
          "cu_seqlens"_a.none() = nb::none(), "cu_seqlens_cpu"_a.none() = nb::none(), "backend"_a = nb::str("auto"),
          "stream"_a = nb::int_(0), "cpu_threads"_a = nb::int_(0), "saved"_a.none() = nb::none(), kBackwardDoc);
  gdn.def("problem", &problem, "q"_a.none(), "k"_a.none(), "v"_a.none(), "g"_a.none(), "beta"_a.none(),
          "initial_state"_a.none() = nb::none(), nb::kw_only(), "scale"_a.none() = nb::none(),
          "cu_seqlens"_a.none() = nb::none(), "cu_seqlens_cpu"_a.none() = nb::none(),
          "Validate a call's inputs and return its sizes and dtypes, to allocate outputs:\n"
          "{B, T, H, HV, K, V, N, scale, io_dtype, gate_dtype, beta_dtype, state_dtype, device}.");
  gdn.def("saved_bytes", &saved_bytes, "q"_a.none(), "k"_a.none(), "v"_a.none(), "g"_a.none(), "beta"_a.none(),
          "initial_state"_a.none() = nb::none(), nb::kw_only(), "scale"_a.none() = nb::none(),
          "use_qk_l2norm_in_kernel"_a = nb::bool_(false), "cu_seqlens"_a.none() = nb::none(),
          "cu_seqlens_cpu"_a.none() = nb::none(), "backend"_a = nb::str("auto"),
          "The size in bytes of chunk_forward's saved buffer for this call (0: its backend keeps nothing; pass None).");
  gdn.def("resolve_backend", &resolve_backend, "q"_a.none(), "k"_a.none(), "v"_a.none(), "g"_a.none(),
          "beta"_a.none(), "initial_state"_a.none() = nb::none(), nb::kw_only(), "scale"_a.none() = nb::none(),
          "use_qk_l2norm_in_kernel"_a = nb::bool_(false), "cu_seqlens"_a.none() = nb::none(),
          "cu_seqlens_cpu"_a.none() = nb::none(), "backend"_a = nb::str("auto"), "backward"_a = nb::bool_(false),
          "The name of the backend `backend` resolves to for this call (what \"auto\" picks).");
  gdn.def("backends", &backends,
          "Every registered backend, fastest first: [{name, available, reason, details, priority}].");
}

}  // namespace deltatrain::python
