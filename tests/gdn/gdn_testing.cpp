#include "gdn_testing.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>

namespace deltatrain::gdn::testing {

double round_to(DType dtype, double value) {
  switch (dtype) {
    case DType::f64:
      return value;
    case DType::f32:
      return static_cast<float>(value);
    case DType::f16:
      return static_cast<double>(static_cast<_Float16>(value));
    case DType::bf16: {
      // 8 significant bits: scale the mantissa to [128, 256), round to an integer (ties to even), scale back.
      if (value == 0 || !std::isfinite(value)) return value;
      int exponent = 0;
      const double mantissa = std::frexp(value, &exponent);
      return std::ldexp(std::nearbyint(std::ldexp(mantissa, 8)), exponent - 8);
    }
    case DType::i32:
    case DType::i64:
    case DType::u8:
      return std::nearbyint(value);
  }
  return value;
}

namespace {

std::int64_t count_of(const std::vector<std::int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
}

template <class T>
T load(const std::uint8_t* bytes, std::int64_t i) {
  T value;
  std::memcpy(&value, bytes + i * sizeof(T), sizeof(T));
  return value;
}

template <class T>
void store(std::uint8_t* bytes, std::int64_t i, T value) {
  std::memcpy(bytes + i * sizeof(T), &value, sizeof(T));
}

}  // namespace

HostTensor::HostTensor(DType dtype, std::vector<std::int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)), bytes_(count_of(shape_) * dtype_size(dtype), 0) {}

HostTensor::HostTensor(const std::vector<double>& values, DType dtype, std::vector<std::int64_t> shape)
    : HostTensor(dtype, std::move(shape)) {
  const std::int64_t n = count_of(shape_);
  if (static_cast<std::int64_t>(values.size()) != n) throw std::logic_error("HostTensor: value count != shape");
  std::uint8_t* out = bytes_.data();
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = round_to(dtype_, values[i]);
    switch (dtype_) {
      case DType::f64: store<double>(out, i, x); break;
      case DType::f32: store<float>(out, i, static_cast<float>(x)); break;
      case DType::f16: store<_Float16>(out, i, static_cast<_Float16>(x)); break;
      case DType::bf16: {  // x is exact in float; bfloat16 is its upper half
        std::uint32_t word;
        const float f = static_cast<float>(x);
        std::memcpy(&word, &f, sizeof word);
        store<std::uint16_t>(out, i, static_cast<std::uint16_t>(word >> 16));
        break;
      }
      case DType::i32: store<std::int32_t>(out, i, static_cast<std::int32_t>(x)); break;
      case DType::i64: store<std::int64_t>(out, i, static_cast<std::int64_t>(x)); break;
      case DType::u8: store<std::uint8_t>(out, i, static_cast<std::uint8_t>(x)); break;
    }
  }
}

TensorView HostTensor::view() const {
  TensorView view;
  view.data = bytes_.empty() ? nullptr : bytes_.data();
  view.dtype = dtype_;
  view.ndim = static_cast<int>(shape_.size());
  std::int64_t stride = 1;
  for (int d = view.ndim - 1; d >= 0; --d) {
    view.shape[d] = shape_[d];
    view.strides[d] = stride;
    stride *= shape_[d];
  }
  return view;
}

std::vector<double> HostTensor::values() const {
  const std::int64_t n = count_of(shape_);
  std::vector<double> values(n);
  const std::uint8_t* in = bytes_.data();
  for (std::int64_t i = 0; i < n; ++i) {
    switch (dtype_) {
      case DType::f64: values[i] = load<double>(in, i); break;
      case DType::f32: values[i] = load<float>(in, i); break;
      case DType::f16: values[i] = static_cast<double>(load<_Float16>(in, i)); break;
      case DType::bf16: {
        const std::uint32_t word = static_cast<std::uint32_t>(load<std::uint16_t>(in, i)) << 16;
        float f;
        std::memcpy(&f, &word, sizeof f);
        values[i] = f;
        break;
      }
      case DType::i32: values[i] = load<std::int32_t>(in, i); break;
      case DType::i64: values[i] = static_cast<double>(load<std::int64_t>(in, i)); break;
      case DType::u8: values[i] = load<std::uint8_t>(in, i); break;
    }
  }
  return values;
}

Layout packed(std::vector<std::int64_t> lengths, std::int64_t H, std::int64_t HV, std::int64_t K, std::int64_t V) {
  Layout layout{1, 0, H, HV, K, V, {0}};
  for (std::int64_t length : lengths) layout.cu_seqlens.push_back(layout.cu_seqlens.back() + length);
  layout.T = layout.cu_seqlens.back();
  return layout;
}

namespace {

std::vector<double> draw(std::int64_t n, std::mt19937& rng, auto&& distribution, DType dtype) {
  std::vector<double> values(n);
  for (double& x : values) x = round_to(dtype, distribution(rng));
  return values;
}

std::vector<double> rounded(std::vector<double> values, DType dtype) {
  for (double& x : values) x = round_to(dtype, x);
  return values;
}

}  // namespace

Sample random_sample(const Layout& layout, DType io, DType gate, bool l2norm, bool initial_state, std::mt19937& rng,
                     GateRange gates) {
  Sample s;
  s.layout = layout;
  s.io = io;
  s.gate = gate;
  s.l2norm = l2norm;
  const std::int64_t qk = count_of(layout.qk_shape()), per_gate = count_of(layout.gate_shape());
  std::normal_distribution<double> normal(0.0, 1.0);
  // With the norm inside the kernel, raw q and k of any scale are fair game; without it, unit-norm-ish keys.
  const double key_scale = l2norm ? 3.0 : 1.0 / std::sqrt(static_cast<double>(layout.K));
  s.q = draw(qk, rng, normal, io);
  s.k = draw(qk, rng, [&](std::mt19937& r) { return key_scale * normal(r); }, io);
  s.v = draw(count_of(layout.v_shape()), rng, normal, io);
  s.g = draw(per_gate, rng, std::uniform_real_distribution<double>(gates.lo, gates.hi), gate);
  s.beta = draw(per_gate, rng, std::uniform_real_distribution<double>(0.02, 0.98), gate);
  if (initial_state) s.h0 = draw(count_of(layout.state_shape()), rng, normal, s.state());
  return s;
}

Sample as_float64(Sample sample) {
  sample.io = DType::f64;
  sample.gate = DType::f64;
  return sample;
}

Sample rounded_to(Sample s, DType io, DType gate) {
  s.io = io;
  s.gate = gate;
  for (auto* values : {&s.q, &s.k, &s.v}) *values = rounded(std::move(*values), io);
  for (auto* values : {&s.g, &s.beta}) *values = rounded(std::move(*values), gate);
  s.h0 = rounded(std::move(s.h0), s.state());
  return s;
}

Cotangents random_cotangents(const Sample& sample, bool with_dht, std::mt19937& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  Cotangents c;
  c.d_o = draw(count_of(sample.layout.v_shape()), rng, normal, sample.io);
  if (with_dht) c.dht = draw(count_of(sample.layout.state_shape()), rng, normal, sample.state());
  return c;
}

namespace {

// The sample's tensors, alive for the duration of a call.
struct Bound {
  HostTensor q, k, v, g, beta, h0, cu_seqlens;
  Inputs inputs;

  explicit Bound(const Sample& s) {
    const Layout& l = s.layout;
    q = HostTensor(s.q, s.io, l.qk_shape());
    k = HostTensor(s.k, s.io, l.qk_shape());
    v = HostTensor(s.v, s.io, l.v_shape());
    g = HostTensor(s.g, s.gate, l.gate_shape());
    beta = HostTensor(s.beta, s.gate, l.gate_shape());
    inputs = Inputs{q.view(), k.view(), v.view(), g.view(), beta.view(), std::nullopt, std::nullopt, std::nullopt};
    if (!s.h0.empty()) {
      h0 = HostTensor(s.h0, s.state(), l.state_shape());
      inputs.initial_state = h0.view();
    }
    if (!l.cu_seqlens.empty()) {
      cu_seqlens = HostTensor(std::vector<double>(l.cu_seqlens.begin(), l.cu_seqlens.end()), s.cu_dtype,
                              {static_cast<std::int64_t>(l.cu_seqlens.size())});
      inputs.cu_seqlens = cu_seqlens.view();
    }
  }
};

Options options_of(const Sample& s, const RunOptions& run) {
  Options options;
  options.backend = run.backend;
  options.use_qk_l2norm_in_kernel = s.l2norm;
  options.cpu_threads = run.threads;
  return options;
}

}  // namespace

ForwardResult run_forward(const Sample& s, const RunOptions& run) {
  const Bound bound(s);
  ForwardResult result{HostTensor(s.io, s.layout.v_shape()), {}};
  ForwardOutputs outputs{result.o.view(), std::nullopt};
  if (run.final_state) {
    result.ht = HostTensor(s.state(), s.layout.state_shape());
    outputs.final_state = result.ht.view();
  }
  if (run.recurrent) {
    recurrent_forward(bound.inputs, outputs, options_of(s, run));
  } else {
    chunk_forward(bound.inputs, outputs, options_of(s, run));
  }
  return result;
}

BackwardResult run_backward(const Sample& s, const Cotangents& c, const RunOptions& run) {
  const Bound bound(s);
  const Layout& l = s.layout;
  const HostTensor d_o(c.d_o, s.io, l.v_shape());
  HostTensor dht;
  BackwardInputs grads_in{d_o.view(), std::nullopt};
  if (!c.dht.empty()) {
    dht = HostTensor(c.dht, s.state(), l.state_shape());
    grads_in.dht = dht.view();
  }
  BackwardResult r{HostTensor(s.io, l.qk_shape()),   HostTensor(s.io, l.qk_shape()),
                   HostTensor(s.io, l.v_shape()),    HostTensor(s.gate, l.gate_shape()),
                   HostTensor(s.gate, l.gate_shape()), {}};
  Gradients grads_out{r.dq.view(), r.dk.view(), r.dv.view(), r.dg.view(), r.dbeta.view(), std::nullopt};
  if (!s.h0.empty()) {
    r.dh0 = HostTensor(s.state(), l.state_shape());
    grads_out.dh0 = r.dh0.view();
  }
  chunk_backward(bound.inputs, grads_in, grads_out, options_of(s, run));
  return r;
}

StatePool random_pool(const Sample& s, std::int64_t rows, std::vector<std::int32_t> indices, bool in_place,
                      std::mt19937& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  StatePool pool{rows, {}, {}, std::move(indices)};
  const std::int64_t count = count_of(pool.shape(s.layout));
  pool.initial = draw(count, rng, normal, s.state());
  if (!in_place) pool.final_before = draw(count, rng, normal, s.state());
  return pool;
}

Sample gathered(Sample s, const StatePool& pool) {
  const Layout& l = s.layout;
  const std::int64_t per_state = l.HV * l.K * l.V;
  s.h0.clear();
  for (const std::int32_t row : pool.indices) append(s.h0, rows(pool.initial, per_state, row, row + 1));
  return s;
}

std::vector<double> scattered(const StatePool& pool, const Layout& l, const std::vector<double>& final_states) {
  const std::int64_t per_state = l.HV * l.K * l.V;
  std::vector<double> result = pool.final_before.empty() ? pool.initial : pool.final_before;
  for (std::size_t n = 0; n < pool.indices.size(); ++n) {
    std::copy_n(final_states.begin() + static_cast<std::int64_t>(n) * per_state, per_state,
                result.begin() + pool.indices[n] * per_state);
  }
  return result;
}

ForwardResult run_recurrent_on_pool(const Sample& s, const StatePool& pool, const RunOptions& run) {
  Sample without_h0 = s;
  without_h0.h0.clear();
  Bound bound(without_h0);
  const bool in_place = run.final_state && pool.final_before.empty();
  ForwardResult result{HostTensor(s.io, s.layout.v_shape()), {}};
  if (run.final_state) {
    result.ht = HostTensor(in_place ? pool.initial : pool.final_before, s.state(), pool.shape(s.layout));
  }
  // In place, the final pool's tensor is the initial pool too.
  const HostTensor initial = in_place ? HostTensor() : HostTensor(pool.initial, s.state(), pool.shape(s.layout));
  const HostTensor indices(std::vector<double>(pool.indices.begin(), pool.indices.end()), DType::i32,
                           {static_cast<std::int64_t>(pool.indices.size())});
  bound.inputs.initial_state = in_place ? result.ht.view() : initial.view();
  bound.inputs.state_indices = indices.view();
  ForwardOutputs outputs{result.o.view(), std::nullopt};
  if (run.final_state) outputs.final_state = result.ht.view();
  recurrent_forward(bound.inputs, outputs, options_of(s, run));
  return result;
}

double relative_error(const std::vector<double>& actual, const std::vector<double>& expected) {
  if (actual.size() != expected.size()) return std::numeric_limits<double>::infinity();
  double largest = 0, error = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i]) || !std::isfinite(expected[i])) return std::numeric_limits<double>::infinity();
    largest = std::max(largest, std::abs(expected[i]));
    error = std::max(error, std::abs(actual[i] - expected[i]));
  }
  if (largest == 0) return error == 0 ? 0 : std::numeric_limits<double>::infinity();
  return error / largest;
}

::testing::AssertionResult close(const std::string& what, const std::vector<double>& actual,
                                 const std::vector<double>& expected, double tolerance) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << what << ": " << actual.size() << " values, expected " << expected.size();
  }
  const double error = relative_error(actual, expected);
  if (error <= tolerance) return ::testing::AssertionSuccess();
  std::size_t worst = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double gap = std::abs(actual[i] - expected[i]);
    if (!(gap <= std::abs(actual[worst] - expected[worst]))) worst = i;
  }
  return ::testing::AssertionFailure() << what << ": relative error " << error << " > " << tolerance
                                       << " (worst at flat index " << worst << ": " << actual[worst] << " vs "
                                       << expected[worst] << ")";
}

::testing::AssertionResult all_finite(const std::string& what, const std::vector<double>& values) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return ::testing::AssertionFailure() << what << "[" << i << "] = " << values[i];
    }
  }
  return ::testing::AssertionSuccess();
}

double tolerance(DType io) {
  switch (io) {
    case DType::f64:
      return 1e-10;
    case DType::f32:
      return 1e-4;
    case DType::f16:  // outputs rounded to 11 significant bits
      return 2e-3;
    case DType::bf16:  // outputs rounded to 8 significant bits
      return 1.5e-2;
    default:
      return 0;
  }
}

std::vector<double> rows(const std::vector<double>& values, std::int64_t row, std::int64_t begin, std::int64_t end) {
  return std::vector<double>(values.begin() + begin * row, values.begin() + end * row);
}

void append(std::vector<double>& to, const std::vector<double>& more) { to.insert(to.end(), more.begin(), more.end()); }

SeededTest::SeededTest() {
  const char* fixed = std::getenv("DELTATRAIN_TEST_SEED");
  seed_ = fixed ? static_cast<unsigned>(std::strtoul(fixed, nullptr, 10)) : std::random_device{}();
  rng_.seed(seed_);
}

void SeededTest::TearDown() {
  if (HasFailure()) std::fprintf(stderr, "random seed %u: replay with DELTATRAIN_TEST_SEED=%u\n", seed_, seed_);
}

}  // namespace deltatrain::gdn::testing
