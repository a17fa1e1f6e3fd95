// Test support for the GDN operator: host tensors in any dtype, random problems, calls through the public
// API, and error measures. Values travel as doubles already rounded to their tensor's dtype, so a run of
// the fp64 reference on "the same inputs" sees exactly what a half-precision run saw.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "deltatrain/core/tensor.h"
#include "deltatrain/gdn/gdn.h"

namespace deltatrain {
// Test names and failure messages show dtypes by name.
inline void PrintTo(DType dtype, std::ostream* os) { *os << dtype_name(dtype); }
}  // namespace deltatrain

namespace deltatrain::gdn::testing {

// `value` rounded to the nearest number representable in `dtype` (ties to even).
double round_to(DType dtype, double value);

// A dense row-major host array that owns its bytes.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<std::int64_t> shape);  // zero-filled
  HostTensor(const std::vector<double>& values, DType dtype, std::vector<std::int64_t> shape);

  bool empty() const { return shape_.empty(); }
  DType dtype() const { return dtype_; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  TensorView view() const;
  std::vector<double> values() const;
  const std::vector<std::uint8_t>& bytes() const { return bytes_; }

 private:
  DType dtype_ = DType::f32;
  std::vector<std::int64_t> shape_;
  mutable std::vector<std::uint8_t> bytes_;  // a view hands out a writable pointer
};

// Sizes: B rows of T tokens, or (B == 1) packed sequences given by cu_seqlens.
struct Layout {
  std::int64_t B = 1, T = 0, H = 1, HV = 1, K = 16, V = 16;
  std::vector<std::int64_t> cu_seqlens;  // empty: no packing
  std::int64_t sequences() const { return cu_seqlens.empty() ? B : static_cast<std::int64_t>(cu_seqlens.size()) - 1; }
  std::vector<std::int64_t> qk_shape() const { return {B, T, H, K}; }
  std::vector<std::int64_t> v_shape() const { return {B, T, HV, V}; }
  std::vector<std::int64_t> gate_shape() const { return {B, T, HV}; }
  std::vector<std::int64_t> state_shape() const { return {sequences(), HV, K, V}; }
};
// A packed layout of the given sequence lengths (zero allowed).
Layout packed(std::vector<std::int64_t> lengths, std::int64_t H, std::int64_t HV, std::int64_t K, std::int64_t V);

// One call's inputs as values (rounded to their dtypes).
struct Sample {
  Layout layout;
  DType io = DType::f32;    // q, k, v (and o, do)
  DType gate = DType::f32;  // g, beta
  DType cu_dtype = DType::i32;
  bool l2norm = false;
  std::vector<double> q, k, v, g, beta;
  std::vector<double> h0;  // empty: no initial state
  DType state() const { return io == DType::f64 ? DType::f64 : DType::f32; }
};

struct GateRange {
  double lo = -0.12, hi = 0.0;  // log-space decay: e^-0.12 per token keeps several chunks of memory
};

// Random inputs: without the in-kernel L2 norm, keys have norm near 1 so the recurrence stays contractive.
Sample random_sample(const Layout& layout, DType io, DType gate, bool l2norm, bool initial_state, std::mt19937& rng,
                     GateRange gates = {});
// The same values in float64 (exactly representable), for the reference.
Sample as_float64(Sample sample);
// The same values rounded to another dtype (for bitwise comparisons within one dtype).
Sample rounded_to(Sample sample, DType io, DType gate);

// Gradients flowing into the forward's outputs; dht empty: no final-state gradient.
struct Cotangents {
  std::vector<double> d_o, dht;
};
Cotangents random_cotangents(const Sample& sample, bool with_dht, std::mt19937& rng);

struct RunOptions {
  std::string backend = "cpu";
  bool recurrent = false;   // the recurrent step instead of the chunked forward
  bool final_state = true;  // output_final_state
  int threads = 0;
};
struct ForwardResult {
  HostTensor o, ht;  // ht empty when not requested
};
ForwardResult run_forward(const Sample& sample, const RunOptions& options);

struct BackwardResult {
  HostTensor dq, dk, dv, dg, dbeta, dh0;  // dh0 empty without an initial state
};
BackwardResult run_backward(const Sample& sample, const Cotangents& cotangents, const RunOptions& options);

// A pool of S states that the recurrent step addresses through state_indices (gdn.h).
struct StatePool {
  std::int64_t rows = 0;              // S
  std::vector<double> initial;        // [S, HV, K, V]: the states the sequences start from
  std::vector<double> final_before;   // a separate final_state pool's values before the call; empty: the final
                                      // states go into the initial pool itself (in place)
  std::vector<std::int32_t> indices;  // [N]: sequence n's row
  std::vector<std::int64_t> shape(const Layout& layout) const { return {rows, layout.HV, layout.K, layout.V}; }
};
// A pool of `rows` random states in the sample's state dtype, and with `in_place` false a separate final pool of
// other random values.
StatePool random_pool(const Sample& sample, std::int64_t rows, std::vector<std::int32_t> indices, bool in_place,
                      std::mt19937& rng);
// The same call without a pool: the rows the indices name gathered as the sample's initial states.
Sample gathered(Sample sample, const StatePool& pool);
// The final pool a call on `pool` must leave: the pool the final states go into, with row indices[n] replaced by
// sequence n's state of `final_states` [N, HV, K, V].
std::vector<double> scattered(const StatePool& pool, const Layout& layout, const std::vector<double>& final_states);
// The recurrent step on the pool (sample.h0 is not used): o, and in ht the final pool (when options.final_state).
ForwardResult run_recurrent_on_pool(const Sample& sample, const StatePool& pool, const RunOptions& options);

// max |actual - expected| / max |expected| (infinite when anything is not finite).
double relative_error(const std::vector<double>& actual, const std::vector<double>& expected);
::testing::AssertionResult close(const std::string& what, const std::vector<double>& actual,
                                 const std::vector<double>& expected, double tolerance);
::testing::AssertionResult all_finite(const std::string& what, const std::vector<double>& values);

// The accuracy a backend owes the reference for inputs of this dtype.
double tolerance(DType io);

// Rows [begin, end) of a row-major array whose rows hold `row` values.
std::vector<double> rows(const std::vector<double>& values, std::int64_t row, std::int64_t begin, std::int64_t end);
void append(std::vector<double>& to, const std::vector<double>& more);

// Fresh random data each run; the seed is printed on failure, and DELTATRAIN_TEST_SEED replays it.
class SeededTest : public ::testing::Test {
 protected:
  SeededTest();
  void TearDown() override;
  unsigned seed_;
  std::mt19937 rng_;
};

}  // namespace deltatrain::gdn::testing
