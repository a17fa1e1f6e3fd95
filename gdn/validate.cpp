// Validation at the operator's boundary: tensors and options in, a Problem out, or an InvalidArgument
// that names the argument, the rule, and what was passed.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"
#include "deltatrain/gdn/backend.h"

namespace deltatrain::gdn {

const char* operation_name(Operation op) {
  switch (op) {
    case Operation::chunk_forward:
      return "chunked forward";
    case Operation::chunk_backward:
      return "chunked backward";
    case Operation::recurrent:
      return "recurrent step";
  }
  return "?";
}

std::int64_t Problem::max_seqlen() const {
  std::int64_t longest = 0;
  for (std::size_t n = 0; n + 1 < offsets.size(); ++n) longest = std::max(longest, offsets[n + 1] - offsets[n]);
  return longest;
}

namespace {

std::string shape_of(std::initializer_list<std::int64_t> dims) {
  std::string text = "[";
  bool first = true;
  for (std::int64_t d : dims) {
    text += (first ? "" : ", ") + std::to_string(d);
    first = false;
  }
  return text + "]";
}

void expect_rank(const char* name, const TensorView& t, int rank, const char* layout) {
  if (t.ndim != rank) {
    throw InvalidArgument(name, "expected " + std::to_string(rank) + " dimensions " + layout + ", got shape " +
                                    t.shape_string());
  }
}

void expect_shape(const char* name, const TensorView& t, std::initializer_list<std::int64_t> dims,
                  const char* layout) {
  expect_rank(name, t, static_cast<int>(dims.size()), layout);
  int d = 0;
  for (std::int64_t extent : dims) {
    if (t.shape[d++] != extent) {
      throw InvalidArgument(name, "expected shape " + shape_of(dims) + " " + layout + ", got " + t.shape_string());
    }
  }
}

void expect_dtype(const char* name, const TensorView& t, DType dtype, const std::string& why) {
  if (t.dtype != dtype) {
    throw InvalidArgument(name, std::string("expected dtype ") + dtype_name(dtype) + " (" + why + "), got " +
                                    dtype_name(t.dtype));
  }
}

std::string number_text(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

// Backends read elements through typed pointers: a misaligned one is undefined behaviour (and a fault
// on some CPUs and every GPU), so such a view (NumPy makes one from a buffer at an odd offset) is refused.
void expect_aligned(const char* name, const TensorView& t) {
  const std::size_t element = dtype_size(t.dtype);
  if (t.numel() > 0 && reinterpret_cast<std::uintptr_t>(t.data) % element != 0) {
    throw InvalidArgument(name, "data pointer " + std::to_string(reinterpret_cast<std::uintptr_t>(t.data)) +
                                    " is not a multiple of its " + std::to_string(element) + "-byte " +
                                    dtype_name(t.dtype) + " elements; pass an aligned copy");
  }
}

void expect_common(const char* name, const TensorView& t, Device device) {
  if (t.data == nullptr && t.numel() > 0) throw InvalidArgument(name, "data pointer is null");
  expect_aligned(name, t);
  if (!t.is_contiguous()) {
    throw InvalidArgument(name, "must be contiguous (row-major, no gaps); got shape " + t.shape_string() +
                                    " with non-contiguous strides; make a contiguous copy first");
  }
  if (!(t.device == device)) {
    throw InvalidArgument(name, "must be on " + device_name(device) + " like q, but is on " + device_name(t.device));
  }
}

template <class Index>
std::vector<std::int64_t> read_offsets(const TensorView& cu) {
  const Index* values = cu.ptr<const Index>();
  return std::vector<std::int64_t>(values, values + cu.shape[0]);
}

// state_indices (and its host copy) into p.state_indices, and the pool's size into p.state_rows: the recurrent step
// only, one int32 row per sequence, each naming a row of initial_state.
void read_state_indices(const Inputs& in, Problem& p) {
  if (p.op != Operation::recurrent) {
    throw InvalidArgument("state_indices", std::string("addresses pools of states in the recurrent step only, not in the ") +
                                               operation_name(p.op));
  }
  if (!in.initial_state) {
    throw InvalidArgument("state_indices", "names rows of initial_state, which is then required (the pool [S, HV, K, V])");
  }
  const TensorView& indices = *in.state_indices;
  expect_shape("state_indices", indices, {p.N}, "[N], one state row per sequence");
  expect_dtype("state_indices", indices, DType::i32, "state rows are int32");
  expect_common("state_indices", indices, p.device);
  const TensorView* host = &indices;
  if (indices.device.type != DeviceType::cpu) {
    if (!in.state_indices_host) {
      throw InvalidArgument("state_indices_host", "a host copy of state_indices is required when state_indices is on " +
                                                      device_name(indices.device));
    }
    host = &*in.state_indices_host;
    if (host->device.type != DeviceType::cpu || host->ndim != 1 || host->shape[0] != p.N ||
        host->dtype != DType::i32 || !host->is_contiguous()) {
      throw InvalidArgument("state_indices_host", "must be a contiguous int32 CPU tensor of shape " +
                                                      indices.shape_string() + " like state_indices, got " +
                                                      host->shape_string() + " " + dtype_name(host->dtype) + " on " +
                                                      device_name(host->device));
    }
    expect_aligned("state_indices_host", *host);
  }
  const TensorView& pool = *in.initial_state;
  expect_rank("initial_state", pool, 4, "[S, HV, K, V], the pool state_indices addresses");
  p.state_rows = pool.shape[0];
  const std::int32_t* values = host->ptr<const std::int32_t>();
  p.state_indices.assign(values, values + p.N);
  for (std::int64_t n = 0; n < p.N; ++n) {
    if (p.state_indices[n] < 0 || p.state_indices[n] >= p.state_rows) {
      throw InvalidArgument("state_indices", "entry " + std::to_string(n) + " is " + std::to_string(p.state_indices[n]) +
                                                 ", outside the rows [0, " + std::to_string(p.state_rows) +
                                                 ") of the state pool initial_state");
    }
  }
}

}  // namespace

void check_cpu_threads(int cpu_threads) {
  // More threads than a few per core only costs, and asking libgomp for far more crashes it or makes
  // it print and exit: the bound keeps that out of reach.
  constexpr int kThreadsPerCore = 4;
  const int max_threads = std::max(1, cpu_info().logical_cores) * kThreadsPerCore;
  if (cpu_threads < 0 || cpu_threads > max_threads) {
    throw InvalidArgument("cpu_threads", "must be in [0, " + std::to_string(max_threads) + "] (0 = all cores; at most " +
                                             std::to_string(kThreadsPerCore) + " per logical core, and this machine has " +
                                             std::to_string(cpu_info().logical_cores) + "), got " +
                                             std::to_string(cpu_threads));
  }
}

Problem make_problem(const Inputs& in, const Options& options, Operation op) {
  Problem p;
  p.op = op;
  const Device device = in.q.device;
  p.device = device;
  p.stream = options.stream;
  p.cpu_threads = options.cpu_threads;
  check_cpu_threads(options.cpu_threads);

  expect_rank("q", in.q, 4, "[B, T, H, K]");
  p.B = in.q.shape[0];
  p.T = in.q.shape[1];
  p.H = in.q.shape[2];
  p.K = in.q.shape[3];
  expect_rank("v", in.v, 4, "[B, T, HV, V]");
  p.HV = in.v.shape[2];
  p.V = in.v.shape[3];
  if (p.B < 1 || p.T < 0 || p.H < 1 || p.K < 1) {
    throw InvalidArgument("q", "expected B >= 1, T >= 0, H >= 1, K >= 1, got shape " + in.q.shape_string());
  }
  if (p.HV < 1 || p.V < 1) throw InvalidArgument("v", "expected HV >= 1 and V >= 1, got shape " + in.v.shape_string());
  expect_shape("k", in.k, {p.B, p.T, p.H, p.K}, "[B, T, H, K] like q");
  expect_shape("v", in.v, {p.B, p.T, p.HV, p.V}, "[B, T, HV, V] with B, T of q");
  if (p.HV % p.H != 0) {
    throw InvalidArgument("v", "the number of value heads HV = " + std::to_string(p.HV) +
                                   " must be a multiple of the number of q/k heads H = " + std::to_string(p.H));
  }
  expect_shape("g", in.g, {p.B, p.T, p.HV}, "[B, T, HV]");
  expect_shape("beta", in.beta, {p.B, p.T, p.HV}, "[B, T, HV]");

  for (auto [name, t] : {std::pair{"q", &in.q}, {"k", &in.k}, {"v", &in.v}, {"g", &in.g}, {"beta", &in.beta}}) {
    expect_common(name, *t, device);
    if (!is_floating(t->dtype)) {
      throw InvalidArgument(name, std::string("must be a floating-point tensor, got ") + dtype_name(t->dtype));
    }
  }
  p.io_dtype = in.q.dtype;
  expect_dtype("k", in.k, p.io_dtype, "k must have q's dtype");
  expect_dtype("v", in.v, p.io_dtype, "v must have q's dtype");
  p.gate_dtype = in.g.dtype;
  p.beta_dtype = in.beta.dtype;
  const bool fp64 = p.io_dtype == DType::f64;
  p.state_dtype = fp64 ? DType::f64 : DType::f32;
  for (auto [name, t] : {std::pair{"g", &in.g}, {"beta", &in.beta}}) {
    if (fp64) {
      expect_dtype(name, *t, DType::f64, "a float64 call is float64 throughout");
    } else if (t->dtype != DType::f32 && t->dtype != p.io_dtype) {
      throw InvalidArgument(name, std::string("expected float32 or q's dtype ") + dtype_name(p.io_dtype) + ", got " +
                                      dtype_name(t->dtype));
    }
  }

  // Sequences: B rows of T tokens, or N packed sequences in one row of T tokens.
  if (in.cu_seqlens) {
    const TensorView& cu = *in.cu_seqlens;
    if (p.B != 1) {
      throw InvalidArgument("cu_seqlens", "packed sequences need batch size B == 1 (all sequences concatenated "
                                          "along T), got B = " + std::to_string(p.B));
    }
    if (cu.ndim != 1 || cu.shape[0] < 2) {
      throw InvalidArgument("cu_seqlens", "expected a 1-D tensor [N + 1] with N >= 1, got shape " + cu.shape_string());
    }
    if (cu.dtype != DType::i32 && cu.dtype != DType::i64) {
      throw InvalidArgument("cu_seqlens", std::string("expected int32 or int64, got ") + dtype_name(cu.dtype));
    }
    if (!cu.is_contiguous()) throw InvalidArgument("cu_seqlens", "must be contiguous");
    expect_aligned("cu_seqlens", cu);
    if (cu.device.type != DeviceType::cpu && !(cu.device == device)) {
      throw InvalidArgument("cu_seqlens", "must be on the CPU or on " + device_name(device) + ", is on " +
                                              device_name(cu.device));
    }
    const TensorView* host = &cu;
    if (cu.device.type != DeviceType::cpu) {
      if (!in.cu_seqlens_host) {
        throw InvalidArgument("cu_seqlens_host", "a host copy of cu_seqlens is required when cu_seqlens is on " +
                                                     device_name(cu.device));
      }
      host = &*in.cu_seqlens_host;
      if (host->device.type != DeviceType::cpu || host->ndim != 1 || host->shape[0] != cu.shape[0] ||
          (host->dtype != DType::i32 && host->dtype != DType::i64) || !host->is_contiguous()) {
        throw InvalidArgument("cu_seqlens_host", "must be a contiguous int32/int64 CPU tensor of shape " +
                                                     cu.shape_string() + " like cu_seqlens, got " + host->shape_string() +
                                                     " " + dtype_name(host->dtype) + " on " + device_name(host->device));
      }
      expect_aligned("cu_seqlens_host", *host);
    }
    p.offsets = host->dtype == DType::i32 ? read_offsets<std::int32_t>(*host) : read_offsets<std::int64_t>(*host);
    p.N = static_cast<std::int64_t>(p.offsets.size()) - 1;
    p.varlen = true;
    if (p.offsets.front() != 0) {
      throw InvalidArgument("cu_seqlens", "must start at 0, got cu_seqlens[0] = " + std::to_string(p.offsets.front()));
    }
    for (std::int64_t n = 0; n < p.N; ++n) {
      if (p.offsets[n + 1] < p.offsets[n]) {
        throw InvalidArgument("cu_seqlens", "must be non-decreasing, got cu_seqlens[" + std::to_string(n + 1) +
                                                "] = " + std::to_string(p.offsets[n + 1]) + " < cu_seqlens[" +
                                                std::to_string(n) + "] = " + std::to_string(p.offsets[n]));
      }
    }
    if (p.offsets.back() != p.T) {
      throw InvalidArgument("cu_seqlens", "must end at T = " + std::to_string(p.T) + " (the packed length), got " +
                                              std::to_string(p.offsets.back()));
    }
  } else {
    p.N = p.B;
    p.offsets.resize(p.B + 1);
    for (std::int64_t b = 0; b <= p.B; ++b) p.offsets[b] = b * p.T;
  }

  p.state_rows = p.N;
  if (in.state_indices) read_state_indices(in, p);
  if (in.initial_state) {
    const TensorView& h0 = *in.initial_state;
    expect_shape("initial_state", h0, {p.state_rows, p.HV, p.K, p.V},
                 !p.state_indices.empty() ? "[S, HV, K, V], the pool state_indices addresses"
                 : p.varlen             ? "[N, HV, K, V], N = number of sequences in cu_seqlens"
                                        : "[N, HV, K, V], N = B");
    expect_common("initial_state", h0, device);
    expect_dtype("initial_state", h0, p.state_dtype, fp64 ? "a float64 call is float64 throughout" : "states are float32");
    p.has_initial_state = true;
  }

  p.scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(p.K)));
  if (!std::isfinite(p.scale)) throw InvalidArgument("scale", "must be finite, got " + number_text(p.scale));
  // Every backend but float64 calls computes in float32: a scale beyond its range is inf there (every
  // output inf), and a nonzero one below it is 0 (every output 0).
  if (!fp64) {
    const float in_compute_type = static_cast<float>(p.scale);
    if (std::isinf(in_compute_type) || (in_compute_type == 0.0f && p.scale != 0.0)) {
      throw InvalidArgument("scale", "must be representable in float32, the compute type of a " +
                                         std::string(dtype_name(p.io_dtype)) + " call (|scale| <= " +
                                         number_text(std::numeric_limits<float>::max()) + ", and not below " +
                                         number_text(std::numeric_limits<float>::denorm_min()) +
                                         " unless 0), got " + number_text(p.scale));
    }
  }
  p.l2norm = options.use_qk_l2norm_in_kernel;
  return p;
}

void check_forward_outputs(const Problem& p, const ForwardOutputs& out) {
  expect_shape("o", out.o, {p.B, p.T, p.HV, p.V}, "[B, T, HV, V]");
  expect_common("o", out.o, p.device);
  expect_dtype("o", out.o, p.io_dtype, "o has v's dtype");
  if (out.final_state) {
    expect_shape("final_state", *out.final_state, {p.state_rows, p.HV, p.K, p.V},
                 p.state_indices.empty() ? "[N, HV, K, V]" : "[S, HV, K, V] like the pool initial_state");
    expect_common("final_state", *out.final_state, p.device);
    expect_dtype("final_state", *out.final_state, p.state_dtype, "states are float32, or float64 in a float64 call");
    // Two sequences ending in one row would race for it.
    std::vector<std::int64_t> writer(p.state_indices.empty() ? 0 : p.state_rows, -1);
    for (std::int64_t n = 0; n < std::ssize(p.state_indices); ++n) {
      std::int64_t& first = writer[p.state_indices[n]];
      if (first >= 0) {
        throw InvalidArgument("state_indices", "entries " + std::to_string(first) + " and " + std::to_string(n) +
                                                   " both name state row " + std::to_string(p.state_indices[n]) +
                                                   ": the sequences writing final_state need distinct rows");
      }
      first = n;
    }
  }
}

void check_backward_tensors(const Problem& p, const Inputs& in, const BackwardInputs& gi, const Gradients& go) {
  expect_shape("do", gi.d_o, {p.B, p.T, p.HV, p.V}, "[B, T, HV, V] like o");
  expect_common("do", gi.d_o, p.device);
  expect_dtype("do", gi.d_o, p.io_dtype, "do has o's dtype");
  if (gi.dht) {
    expect_shape("dht", *gi.dht, {p.N, p.HV, p.K, p.V}, "[N, HV, K, V] like final_state");
    expect_common("dht", *gi.dht, p.device);
    expect_dtype("dht", *gi.dht, p.state_dtype, "dht has final_state's dtype");
  }
  const std::pair<const char*, std::pair<const TensorView*, const TensorView*>> pairs[] = {
      {"dq", {&go.dq, &in.q}}, {"dk", {&go.dk, &in.k}}, {"dv", {&go.dv, &in.v}},
      {"dg", {&go.dg, &in.g}}, {"dbeta", {&go.dbeta, &in.beta}}};
  for (const auto& [name, tensors] : pairs) {
    const auto [grad, input] = tensors;
    if (grad->ndim != input->ndim || grad->shape != input->shape) {
      throw InvalidArgument(name, "expected the shape of its input " + input->shape_string() + ", got " +
                                      grad->shape_string());
    }
    expect_common(name, *grad, p.device);
    expect_dtype(name, *grad, input->dtype, "a gradient has its input's dtype");
  }
  if (p.has_initial_state != go.dh0.has_value()) {
    throw InvalidArgument("dh0", p.has_initial_state ? "required: initial_state was given"
                                                     : "must be absent: no initial_state was given");
  }
  if (go.dh0) {
    expect_shape("dh0", *go.dh0, {p.N, p.HV, p.K, p.V}, "[N, HV, K, V] like initial_state");
    expect_common("dh0", *go.dh0, p.device);
    expect_dtype("dh0", *go.dh0, p.state_dtype, "dh0 has initial_state's dtype");
  }
}

void check_saved(const Problem& p, const TensorView& saved, std::size_t bytes) {
  expect_shape("saved", saved, {static_cast<std::int64_t>(bytes)},
               bytes == 0 ? "(forward_saved_bytes is 0 for this call: its backend keeps nothing; pass none)"
                          : "(forward_saved_bytes for this call)");
  expect_common("saved", saved, p.device);
  expect_dtype("saved", saved, DType::u8, "a buffer of bytes");
  // The backend lays its float2 and 16-byte vector rows out from the buffer's start.
  if (bytes > 0 && reinterpret_cast<std::uintptr_t>(saved.data) % 16 != 0) {
    throw InvalidArgument("saved", "data pointer " + std::to_string(reinterpret_cast<std::uintptr_t>(saved.data)) +
                                       " is not 16-byte aligned; allocate the buffer on its own");
  }
}

}  // namespace deltatrain::gdn
