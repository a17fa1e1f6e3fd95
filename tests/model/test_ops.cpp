// Tests of the CPU model kernels (model/ops.h), on fresh random data each run (the seed is printed on failure;
// DELTATRAIN_TEST_SEED=<seed> replays it): every forward against a naive float64 evaluation written here,
// every backward against central finite differences of sum(dout * forward), packed sequences against the
// sequences one by one, bitwise determinism across thread counts, and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "deltatrain/core/error.h"
#include "model_testing.h"
#include "ops.h"

namespace deltatrain::model {
namespace {

using testing::columns_of;

using Index = std::int64_t;
using Values = std::vector<double>;
using Offsets = std::vector<std::int32_t>;

// A float64 host vector as the [n] view cross_entropy takes for weights and log-probabilities.
TensorView doubles(const Values& values) {
  return TensorView::contiguous(const_cast<double*>(values.data()), DType::f64,
                                {static_cast<std::int64_t>(values.size())});
}

constexpr DType f32 = DType::f32, f64 = DType::f64;
const double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------------------------------------------------
// Host tensors: values travel as doubles, rounded to the tensor's dtype when stored.

class Tensor {
 public:
  Tensor() = default;
  // A [rows, cols] matrix whose rows lie cols + pad elements apart, as a view into a wider matrix; the
  // padding holds a sentinel that no kernel may touch.
  Tensor(DType dtype, Index rows, Index cols, Index pad = 0)
      : dtype_(dtype), ndim_(2), rows_(rows), cols_(cols), ld_(cols + pad) {
    f32_.assign(dtype == f32 ? rows * ld_ : 0, kSentinel);
    f64_.assign(dtype == f64 ? rows * ld_ : 0, kSentinel);
    for (Index i = 0; i < size(); ++i) put(i, 0);
  }
  static Tensor vec(DType dtype, Index n) {
    Tensor t(dtype, 1, n);
    t.ndim_ = 1;
    return t;
  }

  Index size() const { return rows_ * cols_; }
  double at(Index i) const { return dtype_ == f32 ? f32_[slot(i)] : f64_[slot(i)]; }
  void put(Index i, double value) {
    if (dtype_ == f32) {
      f32_[slot(i)] = static_cast<float>(value);
    } else {
      f64_[slot(i)] = value;
    }
  }
  Tensor& set(const Values& values) {
    for (Index i = 0; i < size(); ++i) put(i, values[i]);
    return *this;
  }
  Values values() const {
    Values out(size());
    for (Index i = 0; i < size(); ++i) out[i] = at(i);
    return out;
  }
  bool padding_intact() const {
    for (Index r = 0; r < rows_; ++r)
      for (Index c = cols_; c < ld_; ++c)
        if (at_slot(r * ld_ + c) != kSentinel) return false;
    return true;
  }

  TensorView view() const { return rows_view(0, rows_); }
  // Rows [first, last) of a matrix, without a copy.
  TensorView rows_view(Index first, Index last) const {
    TensorView v;
    v.data = dtype_ == f32 ? static_cast<void*>(&f32_[first * ld_]) : static_cast<void*>(&f64_[first * ld_]);
    v.dtype = dtype_;
    v.ndim = ndim_;
    if (ndim_ == 1) {
      v.shape[0] = cols_;
      v.strides[0] = 1;
    } else {
      v.shape[0] = last - first;
      v.shape[1] = cols_;
      v.strides[0] = ld_;
      v.strides[1] = 1;
    }
    return v;
  }

 private:
  static constexpr float kSentinel = 7.25f;
  Index slot(Index i) const { return (i / cols_) * ld_ + i % cols_; }
  double at_slot(Index s) const { return dtype_ == f32 ? f32_[s] : f64_[s]; }

  DType dtype_ = f64;
  int ndim_ = 2;
  Index rows_ = 0, cols_ = 0, ld_ = 0;
  mutable std::vector<float> f32_;  // a view hands out a writable pointer
  mutable std::vector<double> f64_;
};

Values uniform(std::mt19937& rng, Index n, double lo = -1, double hi = 1) {
  std::uniform_real_distribution<double> dist(lo, hi);
  Values v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

Tensor random(std::mt19937& rng, DType dtype, Index rows, Index cols, Index pad = 0, double lo = -1, double hi = 1) {
  return Tensor(dtype, rows, cols, pad).set(uniform(rng, rows * cols, lo, hi));
}

Tensor random_vec(std::mt19937& rng, DType dtype, Index n, double lo = -1, double hi = 1) {
  return Tensor::vec(dtype, n).set(uniform(rng, n, lo, hi));
}

// Filled with NaN: an output that must be overwritten, never read.
Tensor unset(DType dtype, Index rows, Index cols, Index pad = 0) {
  return Tensor(dtype, rows, cols, pad).set(Values(rows * cols, kNaN));
}

Offsets offsets(const std::vector<Index>& lengths) {
  Offsets cu{0};
  for (const Index n : lengths) cu.push_back(static_cast<std::int32_t>(cu.back() + n));
  return cu;
}

double dot(const Values& a, const Values& b) {
  double sum = 0;
  for (std::size_t i = 0; i < a.size(); ++i) sum += a[i] * b[i];
  return sum;
}

Values minus(const Values& a, const Values& b) {
  Values out(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) out[i] = a[i] - b[i];
  return out;
}

// max |actual - expected| / max |expected| (infinite when sizes differ or anything is not finite).
double relative_error(const Values& actual, const Values& expected) {
  if (actual.size() != expected.size()) return INFINITY;
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i]) || !std::isfinite(expected[i])) return INFINITY;
    diff = std::max(diff, std::abs(actual[i] - expected[i]));
    scale = std::max(scale, std::abs(expected[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

::testing::AssertionResult close(const std::string& what, const Values& actual, const Values& expected,
                                 double tolerance) {
  const double error = relative_error(actual, expected);
  if (error <= tolerance) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": relative error " << error << " > " << tolerance;
}

// The accuracy owed to a float64 evaluation by a kernel computing in `dtype`.
double tolerance(DType dtype) { return dtype == f32 ? 1e-5 : 1e-12; }

// Central differences of sum(dout * f()) with respect to each element of `input`, perturbed in place.
Values numeric_gradient(Tensor& input, const std::function<Values()>& f, const Values& dout) {
  constexpr double h = 1e-6;
  Values grad(input.size());
  for (Index i = 0; i < input.size(); ++i) {
    const double x = input.at(i);
    input.put(i, x + h);
    const double up = dot(dout, f());
    input.put(i, x - h);
    const double down = dot(dout, f());
    input.put(i, x);
    grad[i] = (up - down) / (2 * h);
  }
  return grad;
}
constexpr double kGradTolerance = 1e-6;

// Fresh random data each run; the seed is in every failure's trace.
unsigned test_seed() {
  const char* fixed = std::getenv("DELTATRAIN_TEST_SEED");
  return fixed ? static_cast<unsigned>(std::strtoul(fixed, nullptr, 10)) : std::random_device{}();
}

class OpsTest : public ::testing::Test {
 protected:
  unsigned seed_ = test_seed();
  ::testing::ScopedTrace trace_{
      __FILE__, __LINE__,
      "random seed " + std::to_string(seed_) + ": replay with DELTATRAIN_TEST_SEED=" + std::to_string(seed_)};
  std::mt19937 rng_{seed_};
  std::unique_ptr<Ops> ops_ = make_cpu_ops(2);
};

// ---------------------------------------------------------------------------------------------------------
// Naive float64 evaluations, straight from the formulas of ops.h.

double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }
double silu(double x) { return x * sigmoid(x); }

// x [R, C] -> (out, rstd)
std::pair<Values, Values> naive_rmsnorm(const Values& x, const Values& w, Index R, Index C, double eps, bool zc) {
  Values out(R * C), rstd(R);
  for (Index r = 0; r < R; ++r) {
    double ss = 0;
    for (Index c = 0; c < C; ++c) ss += x[r * C + c] * x[r * C + c];
    rstd[r] = 1 / std::sqrt(ss / C + eps);
    for (Index c = 0; c < C; ++c) out[r * C + c] = x[r * C + c] * rstd[r] * (zc ? 1 + w[c] : w[c]);
  }
  return {out, rstd};
}

std::pair<Values, Values> naive_gated_rmsnorm(const Values& x, const Values& z, const Values& w, Index R, Index C,
                                              double eps) {
  auto [out, rstd] = naive_rmsnorm(x, w, R, C, eps, false);
  for (Index i = 0; i < R * C; ++i) out[i] *= silu(z[i]);
  return {out, rstd};
}

Values naive_conv(const Values& x, const Values& w, Index C, Index W, const Offsets& cu) {
  Values out(x.size());
  for (std::size_t n = 0; n + 1 < cu.size(); ++n)
    for (Index t = cu[n]; t < cu[n + 1]; ++t)
      for (Index c = 0; c < C; ++c) {
        double pre = 0;
        for (Index j = 0; j < W; ++j) {
          const Index src = t - (W - 1) + j;
          if (src >= cu[n]) pre += w[c * W + j] * x[src * C + c];
        }
        out[t * C + c] = silu(pre);
      }
  return out;
}

// (g, beta)
std::pair<Values, Values> naive_gates(const Values& a, const Values& b, const Values& a_log, const Values& dt_bias,
                                      Index H) {
  Values g(a.size()), beta(b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    g[i] = -std::exp(a_log[i % H]) * std::log(1 + std::exp(a[i] + dt_bias[i % H]));
    beta[i] = sigmoid(b[i]);
  }
  return {g, beta};
}

Values naive_rope(Values x, Index heads, Index head_dim, Index rotary_dim, double theta, const Offsets& cu) {
  const Index half = rotary_dim / 2;
  for (std::size_t n = 0; n + 1 < cu.size(); ++n)
    for (Index t = cu[n]; t < cu[n + 1]; ++t)
      for (Index h = 0; h < heads; ++h)
        for (Index i = 0; i < half; ++i) {
          const double angle = (t - cu[n]) * std::pow(theta, -2.0 * i / rotary_dim);
          double& x1 = x[t * heads * head_dim + h * head_dim + i];
          double& x2 = x[t * heads * head_dim + h * head_dim + i + half];
          const double r1 = x1 * std::cos(angle) - x2 * std::sin(angle);
          const double r2 = x2 * std::cos(angle) + x1 * std::sin(angle);
          x1 = r1;
          x2 = r2;
        }
  return x;
}

struct Heads {
  Index q, kv, dim;
};

// (o [T, Hq D], lse [Hq, T]): a direct softmax over each query's causal window in its sequence.
std::pair<Values, Values> naive_attention(const Values& q, const Values& k, const Values& v, Heads h, double scale,
                                          const Offsets& cu) {
  const Index T = cu.back(), D = h.dim;
  Values o(T * h.q * D), lse(h.q * T);
  for (std::size_t n = 0; n + 1 < cu.size(); ++n)
    for (Index head = 0; head < h.q; ++head) {
      const Index kvh = head / (h.q / h.kv);
      for (Index t = cu[n]; t < cu[n + 1]; ++t) {
        Values s;
        for (Index u = cu[n]; u <= t; ++u) {
          double d = 0;
          for (Index i = 0; i < D; ++i) d += q[(t * h.q + head) * D + i] * k[(u * h.kv + kvh) * D + i];
          s.push_back(scale * d);
        }
        const double m = *std::max_element(s.begin(), s.end());
        double z = 0;
        for (const double x : s) z += std::exp(x - m);
        for (Index u = cu[n]; u <= t; ++u)
          for (Index i = 0; i < D; ++i)
            o[(t * h.q + head) * D + i] += std::exp(s[u - cu[n]] - m) / z * v[(u * h.kv + kvh) * D + i];
        lse[head * T + t] = m + std::log(z);
      }
    }
  return {o, lse};
}

Values naive_logprob(const Values& logits, const std::vector<std::int32_t>& targets, Index V) {
  Values out(targets.size());
  for (std::size_t r = 0; r < targets.size(); ++r) {
    if (targets[r] < 0) continue;
    double z = 0;
    for (Index c = 0; c < V; ++c) z += std::exp(logits[r * V + c]);
    out[r] = logits[r * V + targets[r]] - std::log(z);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// gemm, embedding

TEST_F(OpsTest, GemmMatchesNaiveProductForEveryTransposition) {
  const Index M = 5, K = 7, N = 6;
  for (const DType dtype : {f32, f64})
    for (const bool ta : {false, true})
      for (const bool tb : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + (ta ? " a^T" : " a") + (tb ? " b^T" : " b"));
        const Tensor a = ta ? random(rng_, dtype, K, M, 2) : random(rng_, dtype, M, K, 1);
        const Tensor b = tb ? random(rng_, dtype, N, K, 0) : random(rng_, dtype, K, N, 3);
        Tensor c = random(rng_, dtype, M, N, 2);
        const Values av = a.values(), bv = b.values(), c0 = c.values();
        const double alpha = 0.7, beta = -0.4;
        ops_->gemm(ta, tb, alpha, a.view(), b.view(), beta, c.view());
        Values expected(M * N);
        for (Index i = 0; i < M; ++i)
          for (Index j = 0; j < N; ++j) {
            double sum = 0;
            for (Index p = 0; p < K; ++p)
              sum += (ta ? av[p * M + i] : av[i * K + p]) * (tb ? bv[j * K + p] : bv[p * N + j]);
            expected[i * N + j] = alpha * sum + beta * c0[i * N + j];
          }
        EXPECT_TRUE(close("c", c.values(), expected, tolerance(dtype)));
        EXPECT_TRUE(c.padding_intact());
      }
}

TEST_F(OpsTest, EmbeddingForwardGathersRows) {
  const Index V = 9, H = 7;
  const std::vector<std::int32_t> tokens{3, 0, 8, 3, 3, 5, 0, 1};
  for (const DType dtype : {f32, f64}) {
    const Tensor table = random(rng_, dtype, V, H, 2);
    const Tensor out = unset(dtype, static_cast<Index>(tokens.size()), H, 1);
    ops_->embedding_forward(out.view(), tokens, table.view());
    const Values tv = table.values(), ov = out.values();
    for (std::size_t t = 0; t < tokens.size(); ++t)
      for (Index c = 0; c < H; ++c) EXPECT_EQ(ov[t * H + c], tv[tokens[t] * H + c]);
    EXPECT_TRUE(out.padding_intact());
  }
}

TEST_F(OpsTest, EmbeddingBackwardAccumulatesFiniteDifferences) {
  const Index V = 9, H = 5;
  const std::vector<std::int32_t> tokens{3, 0, 8, 3, 3, 5, 0, 1, 3};
  const Index T = static_cast<Index>(tokens.size());
  Tensor table = random(rng_, f64, V, H);
  const Tensor dout = random(rng_, f64, T, H, 2);
  const auto forward = [&] {
    const Tensor out(f64, T, H);
    ops_->embedding_forward(out.view(), tokens, table.view());
    return out.values();
  };
  const Tensor dtable = random(rng_, f64, V, H, 1);
  const Values before = dtable.values();
  ops_->embedding_backward(dtable.view(), tokens, dout.view());
  EXPECT_TRUE(
      close("dtable", minus(dtable.values(), before), numeric_gradient(table, forward, dout.values()), kGradTolerance));
  EXPECT_TRUE(dtable.padding_intact());
}

// ---------------------------------------------------------------------------------------------------------
// RMSNorm

TEST_F(OpsTest, RmsnormForwardMatchesNaive) {
  const Index R = 7, C = 12;
  const double eps = 1e-6;
  for (const DType dtype : {f32, f64})
    for (const bool zc : {true, false}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (zc ? " zero-centred" : " plain"));
      const Tensor x = random(rng_, dtype, R, C, 3, -2, 2), w = random_vec(rng_, dtype, C);
      const Tensor out = unset(dtype, R, C, 1), rstd = Tensor::vec(dtype, R);
      ops_->rmsnorm_forward(out.view(), rstd.view(), x.view(), w.view(), eps, zc);
      const auto [expected, expected_rstd] = naive_rmsnorm(x.values(), w.values(), R, C, eps, zc);
      EXPECT_TRUE(close("out", out.values(), expected, tolerance(dtype)));
      EXPECT_TRUE(close("rstd", rstd.values(), expected_rstd, tolerance(dtype)));
      EXPECT_TRUE(out.padding_intact());
    }
}

TEST_F(OpsTest, RmsnormBackwardMatchesFiniteDifferences) {
  const Index R = 6, C = 9;
  const double eps = 1e-5;
  for (const bool zc : {true, false})
    for (const bool accumulate : {false, true}) {
      SCOPED_TRACE(std::string(zc ? "zero-centred" : "plain") + (accumulate ? ", accumulate dx" : ""));
      Tensor x = random(rng_, f64, R, C, 2), w = random_vec(rng_, f64, C);
      const Tensor dout = random(rng_, f64, R, C, 1);
      const Tensor rstd = Tensor::vec(f64, R);
      const auto forward = [&] {
        const Tensor out(f64, R, C), r = Tensor::vec(f64, R);
        ops_->rmsnorm_forward(out.view(), r.view(), x.view(), w.view(), eps, zc);
        return out.values();
      };
      ops_->rmsnorm_forward(Tensor(f64, R, C).view(), rstd.view(), x.view(), w.view(), eps, zc);
      const Tensor dx = accumulate ? random(rng_, f64, R, C, 3) : unset(f64, R, C, 3);
      const Tensor dw = random_vec(rng_, f64, C);
      const Values dx0 = accumulate ? dx.values() : Values(R * C, 0.0), dw0 = dw.values();
      ops_->rmsnorm_backward(dx.view(), dw.view(), dout.view(), x.view(), rstd.view(), w.view(), zc, accumulate);
      EXPECT_TRUE(close("dx", minus(dx.values(), dx0), numeric_gradient(x, forward, dout.values()), kGradTolerance));
      EXPECT_TRUE(
          close("dweight", minus(dw.values(), dw0), numeric_gradient(w, forward, dout.values()), kGradTolerance));
      EXPECT_TRUE(dx.padding_intact());
    }
}

// Rows of 3 heads of C columns each, normalised per head: the naive norm over the [R * 3, C] rows.
TEST_F(OpsTest, GatedRmsnormForwardMatchesNaive) {
  const Index R = 8, heads = 3, C = 6;
  const double eps = 1e-6;
  for (const DType dtype : {f32, f64}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor x = random(rng_, dtype, R, heads * C, 1), z = random(rng_, dtype, R, heads * C, 0, -4, 4);
    const Tensor w = random_vec(rng_, dtype, C, 0.5, 1.5);
    const Tensor out = unset(dtype, R, heads * C, 2), rstd = Tensor::vec(dtype, R * heads);
    ops_->gated_rmsnorm_forward(out.view(), rstd.view(), x.view(), z.view(), w.view(), eps);
    const auto [expected, expected_rstd] =
        naive_gated_rmsnorm(x.values(), z.values(), w.values(), R * heads, C, eps);
    EXPECT_TRUE(close("out", out.values(), expected, tolerance(dtype)));
    EXPECT_TRUE(close("rstd", rstd.values(), expected_rstd, tolerance(dtype)));
  }
}

TEST_F(OpsTest, GatedRmsnormBackwardMatchesFiniteDifferences) {
  const Index R = 6, heads = 2, C = 8, cols = heads * C;
  const double eps = 1e-6;
  Tensor x = random(rng_, f64, R, cols, 1), z = random(rng_, f64, R, cols, 2, -3, 3), w = random_vec(rng_, f64, C);
  const Tensor dout = random(rng_, f64, R, cols);
  const auto forward = [&] {
    const Tensor out(f64, R, cols), r = Tensor::vec(f64, R * heads);
    ops_->gated_rmsnorm_forward(out.view(), r.view(), x.view(), z.view(), w.view(), eps);
    return out.values();
  };
  const Tensor rstd = Tensor::vec(f64, R * heads);
  ops_->gated_rmsnorm_forward(Tensor(f64, R, cols).view(), rstd.view(), x.view(), z.view(), w.view(), eps);
  const Tensor dx = unset(f64, R, cols, 3), dz = unset(f64, R, cols), dw = random_vec(rng_, f64, C);
  const Values dw0 = dw.values();
  ops_->gated_rmsnorm_backward(dx.view(), dz.view(), dw.view(), dout.view(), x.view(), z.view(), rstd.view(), w.view());
  const Values dv = dout.values();
  EXPECT_TRUE(close("dx", dx.values(), numeric_gradient(x, forward, dv), kGradTolerance));
  EXPECT_TRUE(close("dz", dz.values(), numeric_gradient(z, forward, dv), kGradTolerance));
  EXPECT_TRUE(close("dweight", minus(dw.values(), dw0), numeric_gradient(w, forward, dv), kGradTolerance));
}

// ---------------------------------------------------------------------------------------------------------
// Causal convolution

TEST_F(OpsTest, Conv1dForwardMatchesNaivePerSequence) {
  const Offsets cu = offsets({5, 1, 9, 2, 1});
  const Index T = cu.back();
  for (const DType dtype : {f32, f64})
    for (const Index W : {1, 3, 4})
      for (const Index C : {6, 37}) {  // 37: more than one block of channels
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " W " + std::to_string(W) + " C " + std::to_string(C));
        const Tensor x = random(rng_, dtype, T, C, 2), w = random(rng_, dtype, C, W);
        const Tensor out = unset(dtype, T, C, 1);
        ops_->conv1d_silu_forward(out.view(), x.view(), w.view(), cu);
        EXPECT_TRUE(close("out", out.values(), naive_conv(x.values(), w.values(), C, W, cu), tolerance(dtype)));
        EXPECT_TRUE(out.padding_intact());
      }
}

TEST_F(OpsTest, Conv1dBackwardMatchesFiniteDifferences) {
  const Offsets cu = offsets({5, 1, 7, 2, 1});
  const Index T = cu.back();
  for (const Index W : {1, 4})
    for (const Index C : {5, 35}) {
      SCOPED_TRACE("W " + std::to_string(W) + " C " + std::to_string(C));
      Tensor x = random(rng_, f64, T, C, 1, -2, 2), w = random(rng_, f64, C, W, 2);
      const Tensor dout = random(rng_, f64, T, C, 3);
      const auto forward = [&] {
        const Tensor out(f64, T, C);
        ops_->conv1d_silu_forward(out.view(), x.view(), w.view(), cu);
        return out.values();
      };
      const Tensor dx = unset(f64, T, C, 2), dw = random(rng_, f64, C, W, 1);
      const Values dw0 = dw.values();
      ops_->conv1d_silu_backward(dx.view(), dw.view(), dout.view(), x.view(), w.view(), cu);
      EXPECT_TRUE(close("dx", dx.values(), numeric_gradient(x, forward, dout.values()), kGradTolerance));
      EXPECT_TRUE(
          close("dweight", minus(dw.values(), dw0), numeric_gradient(w, forward, dout.values()), kGradTolerance));
      EXPECT_TRUE(dx.padding_intact() && dw.padding_intact());
    }
}

// ---------------------------------------------------------------------------------------------------------
// GDN gates

TEST_F(OpsTest, GatesForwardMatchesNaive) {
  const Index T = 11, H = 4;
  for (const DType dtype : {f32, f64}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor a = random(rng_, dtype, T, H, 1, -4, 4), b = random(rng_, dtype, T, H, 2, -6, 6);
    const Tensor a_log = random_vec(rng_, dtype, H, -1, 1), dt_bias = random_vec(rng_, dtype, H, -1, 1);
    const Tensor g = unset(dtype, T, H, 2), beta = unset(dtype, T, H);
    ops_->gdn_gates_forward(g.view(), beta.view(), a.view(), b.view(), a_log.view(), dt_bias.view());
    const auto [eg, ebeta] = naive_gates(a.values(), b.values(), a_log.values(), dt_bias.values(), H);
    EXPECT_TRUE(close("g", g.values(), eg, tolerance(dtype)));
    EXPECT_TRUE(close("beta", beta.values(), ebeta, tolerance(dtype)));
  }
}

TEST_F(OpsTest, GatesAreStableForLargeInputs) {
  const Tensor a = Tensor(f32, 1, 4).set({30, -200, 100, 0}), b = Tensor(f32, 1, 4).set({-200, 200, 0, 90});
  const Tensor a_log = Tensor::vec(f32, 4), dt_bias = Tensor::vec(f32, 4);
  const Tensor g(f32, 1, 4), beta(f32, 1, 4);
  ops_->gdn_gates_forward(g.view(), beta.view(), a.view(), b.view(), a_log.view(), dt_bias.view());
  EXPECT_TRUE(close("g", g.values(), Values{-30, 0, -100, -std::log(2.0)}, 1e-7));  // softplus: identity above 20
  EXPECT_EQ(beta.values(), (Values{0, 1, 0.5, 1}));
}

TEST_F(OpsTest, GatesBackwardMatchesFiniteDifferences) {
  const Index T = 9, H = 3;
  Tensor a = random(rng_, f64, T, H, 1, -3, 3), b = random(rng_, f64, T, H, 0, -3, 3);
  Tensor a_log = random_vec(rng_, f64, H), dt_bias = random_vec(rng_, f64, H);
  const Tensor dg = random(rng_, f64, T, H, 2), dbeta = random(rng_, f64, T, H, 1);
  const auto forward = [&] {  // g and beta, concatenated
    const Tensor g(f64, T, H), beta(f64, T, H);
    ops_->gdn_gates_forward(g.view(), beta.view(), a.view(), b.view(), a_log.view(), dt_bias.view());
    Values out = g.values(), bv = beta.values();
    out.insert(out.end(), bv.begin(), bv.end());
    return out;
  };
  Values dout = dg.values(), dbv = dbeta.values();
  dout.insert(dout.end(), dbv.begin(), dbv.end());
  const Tensor da = unset(f64, T, H, 1), db = unset(f64, T, H, 2);
  const Tensor da_log = random_vec(rng_, f64, H), ddt_bias = random_vec(rng_, f64, H);
  const Values da_log0 = da_log.values(), ddt_bias0 = ddt_bias.values();
  ops_->gdn_gates_backward(da.view(), db.view(), da_log.view(), ddt_bias.view(), dg.view(), dbeta.view(), a.view(),
                           b.view(), a_log.view(), dt_bias.view());
  EXPECT_TRUE(close("da", da.values(), numeric_gradient(a, forward, dout), kGradTolerance));
  EXPECT_TRUE(close("db", db.values(), numeric_gradient(b, forward, dout), kGradTolerance));
  EXPECT_TRUE(close("dA_log", minus(da_log.values(), da_log0), numeric_gradient(a_log, forward, dout), kGradTolerance));
  EXPECT_TRUE(
      close("ddt_bias", minus(ddt_bias.values(), ddt_bias0), numeric_gradient(dt_bias, forward, dout), kGradTolerance));
}

// ---------------------------------------------------------------------------------------------------------
// RoPE

struct RopeCase {
  Index heads, head_dim, rotary_dim;
};
const RopeCase kRopeCases[] = {{3, 8, 4}, {2, 6, 6}, {2, 16, 4}};

TEST_F(OpsTest, RopeMatchesNaiveAndInverseUndoesIt) {
  const Offsets cu = offsets({12, 1, 20, 3});
  const Index T = cu.back();
  const double theta = 10000;
  for (const DType dtype : {f32, f64})
    for (const RopeCase rc : kRopeCases) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " head_dim " + std::to_string(rc.head_dim) + " rotary_dim " +
                   std::to_string(rc.rotary_dim));
      const Tensor x = random(rng_, dtype, T, rc.heads * rc.head_dim, 3);
      const Values x0 = x.values();
      ops_->rope(x.view(), static_cast<int>(rc.heads), static_cast<int>(rc.head_dim), static_cast<int>(rc.rotary_dim),
                 theta, cu, false);
      EXPECT_TRUE(
          close("rope", x.values(), naive_rope(x0, rc.heads, rc.head_dim, rc.rotary_dim, theta, cu), tolerance(dtype)));
      ops_->rope(x.view(), static_cast<int>(rc.heads), static_cast<int>(rc.head_dim), static_cast<int>(rc.rotary_dim),
                 theta, cu, true);
      EXPECT_TRUE(close("inverse(rope)", x.values(), x0, tolerance(dtype)));
      EXPECT_TRUE(x.padding_intact());
    }
}

// The backward of a rotation is the inverse rotation of the output gradient.
TEST_F(OpsTest, RopeInverseIsTheBackward) {
  const Offsets cu = offsets({6, 1, 9});
  const Index T = cu.back();
  for (const RopeCase rc : kRopeCases) {
    const int heads = static_cast<int>(rc.heads), hd = static_cast<int>(rc.head_dim),
              rot = static_cast<int>(rc.rotary_dim);
    Tensor x = random(rng_, f64, T, rc.heads * rc.head_dim);
    const Tensor dout = random(rng_, f64, T, rc.heads * rc.head_dim, 1);
    const auto forward = [&] {
      Tensor y = x;
      ops_->rope(y.view(), heads, hd, rot, 1e6, cu, false);
      return y.values();
    };
    const Values expected = numeric_gradient(x, forward, dout.values());
    ops_->rope(dout.view(), heads, hd, rot, 1e6, cu, true);
    EXPECT_TRUE(close("dx", dout.values(), expected, kGradTolerance));
  }
}

// ---------------------------------------------------------------------------------------------------------
// Attention

struct AttentionCase {
  Heads heads;
  std::vector<Index> lengths;
};
const AttentionCase kAttentionCases[] = {
    {{4, 2, 8}, {7, 1, 12, 3, 1}},  // GQA, packed with sequences of length 1
    {{2, 2, 4}, {9}},
    {{3, 1, 16}, {1, 5, 4}},
};

TEST_F(OpsTest, AttentionForwardMatchesNaiveSoftmax) {
  for (const DType dtype : {f32, f64})
    for (const AttentionCase& ac : kAttentionCases) {
      const Heads h = ac.heads;
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " heads " + std::to_string(h.q) + "/" + std::to_string(h.kv) +
                   " dim " + std::to_string(h.dim));
      const Offsets cu = offsets(ac.lengths);
      const Index T = cu.back();
      const double scale = 1 / std::sqrt(static_cast<double>(h.dim));
      const Tensor q = random(rng_, dtype, T, h.q * h.dim, 2, -2, 2),
                   k = random(rng_, dtype, T, h.kv * h.dim, 1, -2, 2);
      const Tensor v = random(rng_, dtype, T, h.kv * h.dim, 3);
      const Tensor o = unset(dtype, T, h.q * h.dim, 1), lse = unset(dtype, h.q, T, 2);
      ops_->attention_forward(o.view(), lse.view(), q.view(), k.view(), v.view(), static_cast<int>(h.q),
                              static_cast<int>(h.kv), static_cast<int>(h.dim), scale, cu);
      const auto [eo, e_lse] = naive_attention(q.values(), k.values(), v.values(), h, scale, cu);
      EXPECT_TRUE(close("o", o.values(), eo, tolerance(dtype)));
      EXPECT_TRUE(close("lse", lse.values(), e_lse, tolerance(dtype)));
      EXPECT_TRUE(o.padding_intact() && lse.padding_intact());
    }
}

TEST_F(OpsTest, AttentionBackwardMatchesFiniteDifferences) {
  for (const AttentionCase& ac : kAttentionCases) {
    const Heads h = ac.heads;
    SCOPED_TRACE("heads " + std::to_string(h.q) + "/" + std::to_string(h.kv) + " dim " + std::to_string(h.dim));
    const Offsets cu = offsets(ac.lengths);
    const Index T = cu.back();
    const int hq = static_cast<int>(h.q), hkv = static_cast<int>(h.kv), d = static_cast<int>(h.dim);
    const double scale = 0.4;
    Tensor q = random(rng_, f64, T, h.q * h.dim, 1), k = random(rng_, f64, T, h.kv * h.dim, 2);
    Tensor v = random(rng_, f64, T, h.kv * h.dim);
    const Tensor dout = random(rng_, f64, T, h.q * h.dim, 3);
    const Tensor o(f64, T, h.q * h.dim, 1), lse(f64, h.q, T);
    const auto forward = [&] {
      const Tensor out(f64, T, h.q * h.dim), l(f64, h.q, T);
      ops_->attention_forward(out.view(), l.view(), q.view(), k.view(), v.view(), hq, hkv, d, scale, cu);
      return out.values();
    };
    ops_->attention_forward(o.view(), lse.view(), q.view(), k.view(), v.view(), hq, hkv, d, scale, cu);
    const Tensor dq = unset(f64, T, h.q * h.dim, 2), dk = unset(f64, T, h.kv * h.dim),
                 dv = unset(f64, T, h.kv * h.dim, 1);
    ops_->attention_backward(dq.view(), dk.view(), dv.view(), dout.view(), q.view(), k.view(), v.view(), o.view(),
                             lse.view(), hq, hkv, d, scale, cu);
    const Values dov = dout.values();
    EXPECT_TRUE(close("dq", dq.values(), numeric_gradient(q, forward, dov), kGradTolerance));
    EXPECT_TRUE(close("dk", dk.values(), numeric_gradient(k, forward, dov), kGradTolerance));
    EXPECT_TRUE(close("dv", dv.values(), numeric_gradient(v, forward, dov), kGradTolerance));
  }
}

// ---------------------------------------------------------------------------------------------------------
// Packing: a packed batch equals its sequences done one by one (views of the same rows), bitwise.

TEST_F(OpsTest, PackedSequencesEqualSequencesOneByOne) {
  const std::vector<Index> lengths{6, 1, 11, 2};
  const Offsets cu = offsets(lengths);
  const Index T = cu.back(), C = 10;
  const Heads h{4, 2, 6};
  for (const DType dtype : {f32, f64}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor x = random(rng_, dtype, T, C, 1), w = random(rng_, dtype, C, 4);
    const Tensor q = random(rng_, dtype, T, h.q * h.dim, 2), k = random(rng_, dtype, T, h.kv * h.dim);
    const Tensor v = random(rng_, dtype, T, h.kv * h.dim, 1);
    Tensor conv_packed(dtype, T, C), rope_packed = q, o_packed(dtype, T, h.q * h.dim), lse_packed(dtype, h.q, T);
    Tensor conv_single = conv_packed, rope_single = q, o_single = o_packed, lse_single = lse_packed;
    const int hq = static_cast<int>(h.q), hkv = static_cast<int>(h.kv), d = static_cast<int>(h.dim);
    ops_->conv1d_silu_forward(conv_packed.view(), x.view(), w.view(), cu);
    ops_->rope(rope_packed.view(), hq, d, 4, 1e4, cu, false);
    ops_->attention_forward(o_packed.view(), lse_packed.view(), q.view(), k.view(), v.view(), hq, hkv, d, 0.3, cu);
    for (std::size_t n = 0; n < lengths.size(); ++n) {
      const Index first = cu[n], last = cu[n + 1];
      const Offsets one{0, static_cast<std::int32_t>(last - first)};
      ops_->conv1d_silu_forward(conv_single.rows_view(first, last), x.rows_view(first, last), w.view(), one);
      ops_->rope(rope_single.rows_view(first, last), hq, d, 4, 1e4, one, false);
      TensorView lse_columns = lse_single.view();  // columns [first, last) of lse [Hq, T]
      lse_columns.data = static_cast<char*>(lse_columns.data) + first * dtype_size(dtype);
      lse_columns.shape[1] = last - first;
      ops_->attention_forward(o_single.rows_view(first, last), lse_columns, q.rows_view(first, last),
                              k.rows_view(first, last), v.rows_view(first, last), hq, hkv, d, 0.3, one);
    }
    EXPECT_EQ(conv_packed.values(), conv_single.values());
    EXPECT_EQ(rope_packed.values(), rope_single.values());
    EXPECT_EQ(o_packed.values(), o_single.values());
    EXPECT_EQ(lse_packed.values(), lse_single.values());
  }
}

// ---------------------------------------------------------------------------------------------------------
// Elementwise operations

TEST_F(OpsTest, SigmoidGateAndSwigluMatchNaive) {
  const Index R = 5, C = 9;
  for (const DType dtype : {f32, f64}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor x = random(rng_, dtype, R, C, 1, -3, 3), gate = random(rng_, dtype, R, C, 2, -8, 8);
    const Tensor out = unset(dtype, R, C, 3), out2 = unset(dtype, R, C);
    ops_->sigmoid_gate_forward(out.view(), x.view(), gate.view());
    ops_->swiglu_forward(out2.view(), gate.view(), x.view());
    const Values xv = x.values(), gv = gate.values();
    Values e1(R * C), e2(R * C);
    for (Index i = 0; i < R * C; ++i) {
      e1[i] = xv[i] * sigmoid(gv[i]);
      e2[i] = silu(gv[i]) * xv[i];
    }
    EXPECT_TRUE(close("sigmoid_gate", out.values(), e1, tolerance(dtype)));
    EXPECT_TRUE(close("swiglu", out2.values(), e2, tolerance(dtype)));
    EXPECT_TRUE(out.padding_intact());
  }
}

TEST_F(OpsTest, SigmoidGateAndSwigluBackwardMatchFiniteDifferences) {
  const Index R = 4, C = 7;
  Tensor x = random(rng_, f64, R, C, 1, -3, 3), gate = random(rng_, f64, R, C, 2, -5, 5);
  const Tensor dout = random(rng_, f64, R, C, 3);
  const Values dv = dout.values();
  const auto sigmoid_gate = [&] {
    const Tensor out(f64, R, C);
    ops_->sigmoid_gate_forward(out.view(), x.view(), gate.view());
    return out.values();
  };
  const auto swiglu = [&] {  // gate = gate, up = x
    const Tensor out(f64, R, C);
    ops_->swiglu_forward(out.view(), gate.view(), x.view());
    return out.values();
  };
  const Tensor dx = unset(f64, R, C, 1), dgate = unset(f64, R, C, 2);
  ops_->sigmoid_gate_backward(dx.view(), dgate.view(), dout.view(), x.view(), gate.view());
  EXPECT_TRUE(close("sigmoid_gate dx", dx.values(), numeric_gradient(x, sigmoid_gate, dv), kGradTolerance));
  EXPECT_TRUE(close("sigmoid_gate dgate", dgate.values(), numeric_gradient(gate, sigmoid_gate, dv), kGradTolerance));
  const Tensor dg2 = unset(f64, R, C), dup = unset(f64, R, C, 3);
  ops_->swiglu_backward(dg2.view(), dup.view(), dout.view(), gate.view(), x.view());
  EXPECT_TRUE(close("swiglu dgate", dg2.values(), numeric_gradient(gate, swiglu, dv), kGradTolerance));
  EXPECT_TRUE(close("swiglu dup", dup.values(), numeric_gradient(x, swiglu, dv), kGradTolerance));
}

TEST_F(OpsTest, AddCopyAndFillZeroRespectRowStrides) {
  const Index R = 6, C = 5;
  for (const DType dtype : {f32, f64}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor y = random(rng_, dtype, R, C, 2), x = random(rng_, dtype, R, C, 0);
    const Values y0 = y.values(), xv = x.values();
    ops_->add(y.view(), x.view());
    Values sum(R * C);
    for (Index i = 0; i < R * C; ++i) sum[i] = y0[i] + xv[i];
    EXPECT_TRUE(close("add", y.values(), sum, tolerance(dtype)));
    const Tensor dst = unset(dtype, R, C, 3);
    ops_->copy(dst.view(), y.view());
    EXPECT_EQ(dst.values(), y.values());
    ops_->fill_zero(dst.view());
    EXPECT_EQ(dst.values(), Values(R * C, 0.0));
    EXPECT_TRUE(y.padding_intact() && dst.padding_intact());
  }
}

// ---------------------------------------------------------------------------------------------------------
// Cross-entropy

TEST_F(OpsTest, CrossEntropyLogprobMatchesLogSoftmax) {
  const Index R = 9, V = 13;
  const std::vector<std::int32_t> targets{3, -1, 0, 12, 7, -100, 5, 5, 1};
  Values weights = uniform(rng_, R, 0, 2);
  for (const DType dtype : {f32, f64})
    for (const double offset : {0.0, 500.0}) {  // large logits: max subtraction
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " offset " + std::to_string(offset));
      const Tensor logits = random(rng_, dtype, R, V, 2, offset - 4, offset + 4);
      const Values lv = logits.values();
      Values logprob(R, kNaN);
      ops_->cross_entropy(logits.view(), targets, doubles(weights), doubles(logprob), false);
      EXPECT_TRUE(close("logprob", logprob, naive_logprob(lv, targets, V), tolerance(dtype)));
      EXPECT_EQ(logits.values(), lv);  // untouched without want_grad
      ops_->cross_entropy(logits.view(), targets, doubles(weights), doubles(logprob), true);
      EXPECT_TRUE(close("logprob with grad", logprob, naive_logprob(lv, targets, V), tolerance(dtype)));
      const Values grad = logits.values();
      for (Index r = 0; r < R; ++r) {
        if (targets[r] >= 0) continue;
        EXPECT_EQ(logprob[r], 0.0);
        for (Index c = 0; c < V; ++c) EXPECT_EQ(grad[r * V + c], 0.0);
      }
      EXPECT_TRUE(logits.padding_intact());
    }
}

TEST_F(OpsTest, CrossEntropyGradientMatchesFiniteDifferences) {
  const Index R = 7, V = 11;
  const std::vector<std::int32_t> targets{3, -1, 0, 10, 7, 7, -5};
  const Values weights = uniform(rng_, R, 0, 2);
  Tensor logits = random(rng_, f64, R, V, 1, -3, 3);
  const auto loss = [&] {  // sum(w * -logprob), as one output
    Tensor copy = logits;
    Values logprob(R);
    ops_->cross_entropy(copy.view(), targets, doubles(weights), doubles(logprob), false);
    double sum = 0;
    for (Index r = 0; r < R; ++r) sum -= weights[r] * logprob[r];
    return Values{sum};
  };
  const Values expected = numeric_gradient(logits, loss, {1.0});
  Values logprob(R);
  ops_->cross_entropy(logits.view(), targets, doubles(weights), doubles(logprob), true);
  EXPECT_TRUE(close("dlogits", logits.values(), expected, kGradTolerance));
}

// ---------------------------------------------------------------------------------------------------------
// Determinism: threads 1, 2 and 3 give the same bits, for every operation with a reduction.

std::vector<Values> run_everything(Ops& ops, DType dtype, unsigned seed) {
  std::mt19937 rng(seed);
  const Offsets cu = offsets({40, 1, 33, 17, 9});
  const Index T = cu.back(), C = 70, V = 50;
  const Heads h{4, 2, 8};
  const int hq = static_cast<int>(h.q), hkv = static_cast<int>(h.kv), d = static_cast<int>(h.dim);
  std::vector<Values> out;

  const Tensor x = random(rng, dtype, T, C, 1), z = random(rng, dtype, T, C), dout = random(rng, dtype, T, C, 2);
  const Tensor w = random_vec(rng, dtype, C), rstd = Tensor::vec(dtype, T), y(dtype, T, C);
  const Tensor dx = random(rng, dtype, T, C), dw = random_vec(rng, dtype, C), dz(dtype, T, C);
  ops.rmsnorm_forward(y.view(), rstd.view(), x.view(), w.view(), 1e-6, true);
  ops.rmsnorm_backward(dx.view(), dw.view(), dout.view(), x.view(), rstd.view(), w.view(), true, true);
  out.insert(out.end(), {y.values(), rstd.values(), dx.values(), dw.values()});
  ops.gated_rmsnorm_forward(y.view(), rstd.view(), x.view(), z.view(), w.view(), 1e-6);
  ops.gated_rmsnorm_backward(dx.view(), dz.view(), dw.view(), dout.view(), x.view(), z.view(), rstd.view(), w.view());
  out.insert(out.end(), {y.values(), dx.values(), dz.values(), dw.values()});

  const Tensor cw = random(rng, dtype, C, 4), dcw = random(rng, dtype, C, 4);
  ops.conv1d_silu_forward(y.view(), x.view(), cw.view(), cu);
  ops.conv1d_silu_backward(dx.view(), dcw.view(), dout.view(), x.view(), cw.view(), cu);
  out.insert(out.end(), {y.values(), dx.values(), dcw.values()});

  const Tensor a_log = random_vec(rng, dtype, C), dt_bias = random_vec(rng, dtype, C);
  const Tensor da_log = random_vec(rng, dtype, C), ddt_bias = random_vec(rng, dtype, C);
  ops.gdn_gates_forward(y.view(), dz.view(), x.view(), z.view(), a_log.view(), dt_bias.view());
  ops.gdn_gates_backward(dx.view(), dz.view(), da_log.view(), ddt_bias.view(), dout.view(), y.view(), x.view(),
                         z.view(), a_log.view(), dt_bias.view());
  out.insert(out.end(), {y.values(), dx.values(), dz.values(), da_log.values(), ddt_bias.values()});

  std::vector<std::int32_t> tokens(T);
  for (Index t = 0; t < T; ++t) tokens[t] = static_cast<std::int32_t>(rng() % 7);  // many repeats
  const Tensor dtable = random(rng, dtype, 7, C);
  ops.embedding_backward(dtable.view(), tokens, dout.view());
  out.push_back(dtable.values());

  const Tensor q = random(rng, dtype, T, h.q * h.dim), k = random(rng, dtype, T, h.kv * h.dim);
  const Tensor v = random(rng, dtype, T, h.kv * h.dim), dao = random(rng, dtype, T, h.q * h.dim);
  const Tensor o(dtype, T, h.q * h.dim), lse(dtype, h.q, T), dq(dtype, T, h.q * h.dim), dk(dtype, T, h.kv * h.dim);
  const Tensor dv(dtype, T, h.kv * h.dim);
  ops.rope(q.view(), hq, d, 4, 1e4, cu, false);
  ops.attention_forward(o.view(), lse.view(), q.view(), k.view(), v.view(), hq, hkv, d, 0.35, cu);
  ops.attention_backward(dq.view(), dk.view(), dv.view(), dao.view(), q.view(), k.view(), v.view(), o.view(),
                         lse.view(), hq, hkv, d, 0.35, cu);
  out.insert(out.end(), {q.values(), o.values(), lse.values(), dq.values(), dk.values(), dv.values()});

  const Tensor product(dtype, T, C);
  ops.gemm(false, true, 1.0, x.view(), random(rng, dtype, C, C).view(), 0.0, product.view());
  out.push_back(product.values());

  const Tensor logits = random(rng, dtype, T, V, 0, -5, 5);
  std::vector<std::int32_t> targets(T);
  for (Index t = 0; t < T; ++t) targets[t] = static_cast<std::int32_t>(rng() % V) - (t % 5 == 0 ? V : 0);
  Values logprob(T);
  ops.cross_entropy(logits.view(), targets, doubles(uniform(rng, T, 0, 1)), doubles(logprob), true);
  out.insert(out.end(), {logprob, logits.values()});
  return out;
}

TEST_F(OpsTest, ResultsAreBitwiseIdenticalForAnyThreadCount) {
  for (const DType dtype : {f32, f64}) {
    SCOPED_TRACE(dtype_name(dtype));
    const std::vector<Values> one = run_everything(*make_cpu_ops(1), dtype, seed_);
    for (const int threads : {2, 3}) {
      const std::vector<Values> many = run_everything(*make_cpu_ops(threads), dtype, seed_);
      ASSERT_EQ(one.size(), many.size());
      for (std::size_t i = 0; i < one.size(); ++i)
        EXPECT_EQ(one[i], many[i]) << "result " << i << " differs with " << threads << " threads";
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Inference: copies into and out of cache slots, the conv decode step, RoPE at given positions, attention over
// a cache.

// A contiguous cache [S, L, C] of random values (a Tensor of S * L rows seen in 3-D).
TensorView cache_view(const Tensor& rows, Index slots, Index slot_rows) {
  TensorView v = rows.view();
  v.ndim = 3;
  v.shape = {slots, slot_rows, v.shape[1]};
  v.strides = {slot_rows * v.shape[2], v.shape[2], 1};
  return v;
}

TEST_F(OpsTest, CopyRowsMovesTheNamedRows) {
  for (const DType dtype : {f32, f64}) {
    const Tensor src = random(rng_, dtype, 7, 5, 2), dst = random(rng_, dtype, 9, 5, 1);
    const std::vector<std::int32_t> to{8, 0, 3, 4}, from{6, 6, 0, 2};
    Values expected = dst.values();
    const Values source = src.values();
    for (std::size_t i = 0; i < to.size(); ++i)
      for (Index c = 0; c < 5; ++c) expected[to[i] * 5 + c] = source[from[i] * 5 + c];
    ops_->copy_rows(dst.view(), to, src.view(), from);
    EXPECT_EQ(dst.values(), expected);
    EXPECT_TRUE(dst.padding_intact());
  }
}

// `call` throws InvalidArgument naming `argument`.
template <class Call>
void expect_invalid(const std::string& argument, const Call& call) {
  try {
    call();
    ADD_FAILURE() << "no InvalidArgument for " << argument;
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
  }
}

// The conv's output and its gradient in column parts (the model's q, k and v) carry the whole matrix's values,
// bitwise, in the forward, the backward and the decode step; widths that split every channel block.
TEST_F(OpsTest, Conv1dInColumnPartsEqualsTheWholeMatrix) {
  const Offsets cu = offsets({5, 1, 7, 2});
  const Index T = cu.back(), W = 4, C = 13, S = 4;
  const Index first[3] = {0, 5, 8}, widths[3] = {5, 3, 5};
  for (const DType dtype : {f32, f64}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor x = random(rng_, dtype, T, C, 1), w = random(rng_, dtype, C, W), dout = random(rng_, dtype, T, C, 2);
    std::vector<Tensor> out, d;
    for (int p = 0; p < 3; ++p) {
      out.push_back(unset(dtype, T, widths[p], p));
      d.push_back(Tensor(dtype, T, widths[p], 1).set(columns_of(dout.values(), C, first[p], widths[p])));
    }
    const Tensor whole = unset(dtype, T, C, 1);
    ops_->conv1d_silu_forward(whole.view(), x.view(), w.view(), cu);
    ops_->conv1d_silu_forward({out[0].view(), out[1].view(), out[2].view()}, x.view(), w.view(), cu);
    for (int p = 0; p < 3; ++p) {
      EXPECT_EQ(out[p].values(), columns_of(whole.values(), C, first[p], widths[p])) << "part " << p;
      EXPECT_TRUE(out[p].padding_intact());
    }

    const Tensor dx_whole = unset(dtype, T, C), dw_whole(dtype, C, W), dx = unset(dtype, T, C), dw(dtype, C, W);
    ops_->conv1d_silu_backward(dx_whole.view(), dw_whole.view(), dout.view(), x.view(), w.view(), cu);
    ops_->conv1d_silu_backward(dx.view(), dw.view(), {d[0].view(), d[1].view(), d[2].view()}, x.view(), w.view(), cu);
    EXPECT_EQ(dx.values(), dx_whole.values());
    EXPECT_EQ(dw.values(), dw_whole.values());

    Tensor state_whole(dtype, S * (W - 1), C), state(dtype, S * (W - 1), C);
    const Values history = uniform(rng_, S * (W - 1) * C);
    state_whole.set(history);
    state.set(history);
    const std::vector<std::int32_t> slots{2, 0};
    const Tensor in = random(rng_, dtype, 2, C), step_whole = unset(dtype, 2, C);
    std::vector<Tensor> step;
    for (int p = 0; p < 3; ++p) step.push_back(unset(dtype, 2, widths[p]));
    ops_->conv1d_silu_step(step_whole.view(), in.view(), w.view(), cache_view(state_whole, S, W - 1), slots);
    ops_->conv1d_silu_step({step[0].view(), step[1].view(), step[2].view()}, in.view(), w.view(),
                           cache_view(state, S, W - 1), slots);
    for (int p = 0; p < 3; ++p)
      EXPECT_EQ(step[p].values(), columns_of(step_whole.values(), C, first[p], widths[p])) << "step part " << p;
    EXPECT_EQ(state.values(), state_whole.values());
  }
}

TEST_F(OpsTest, ColumnPartsThatDoNotAddUpAreRefusedNamingTheArgument) {
  const Offsets cu = offsets({3});
  const Tensor x = random(rng_, f64, 3, 6), w = random(rng_, f64, 6, 2), a(f64, 3, 2), b(f64, 3, 3), c(f64, 2, 1);
  expect_invalid("out", [&] { ops_->conv1d_silu_forward({a.view(), b.view()}, x.view(), w.view(), cu); });
  expect_invalid("out", [&] { ops_->conv1d_silu_forward({a.view(), b.view(), c.view()}, x.view(), w.view(), cu); });
  expect_invalid("parts", [&] { ColumnParts({a.view(), a.view(), a.view(), a.view()}); });
}

// Stepping the conv one token at a time from a zero history, each sequence in its own slot, gives the forward
// over the whole sequence (naive_conv), row by row; the state is the last W - 1 inputs; other slots untouched.
TEST_F(OpsTest, Conv1dStepEqualsTheForwardTokenByToken) {
  const Index C = 7, W = 4, S = 5;
  const std::vector<Index> lengths{6, 1, 3};
  const std::vector<std::int32_t> slots{3, 0, 4};
  for (const DType dtype : {f32, f64}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Offsets cu = offsets(lengths);
    const Tensor x = random(rng_, dtype, cu.back(), C), w = random(rng_, dtype, C, W);
    const Values expected = naive_conv(x.values(), w.values(), C, W, cu);
    Tensor state(dtype, S * (W - 1), C);
    const Values untouched = uniform(rng_, (W - 1) * C);
    for (Index i = 0; i < (W - 1) * C; ++i) state.put(1 * (W - 1) * C + i, untouched[i]);  // slot 1: not stepped
    const Values before = state.values();
    Values got(expected.size(), kNaN);
    const Values xs = x.values();
    for (Index t = 0; t < *std::max_element(lengths.begin(), lengths.end()); ++t) {
      std::vector<std::int32_t> step_slots;
      Values rows;
      std::vector<Index> where;
      for (std::size_t n = 0; n < lengths.size(); ++n) {
        if (t >= lengths[n]) continue;
        step_slots.push_back(slots[n]);
        where.push_back(cu[n] + t);
        rows.insert(rows.end(), xs.begin() + (cu[n] + t) * C, xs.begin() + (cu[n] + t + 1) * C);
      }
      const Index N = std::ssize(step_slots);
      const Tensor in = Tensor(dtype, N, C).set(rows), out = unset(dtype, N, C, 1);
      ops_->conv1d_silu_step(out.view(), in.view(), w.view(), cache_view(state, S, W - 1), step_slots);
      const Values o = out.values();
      for (Index i = 0; i < N; ++i) std::copy_n(o.begin() + i * C, C, got.begin() + where[i] * C);
    }
    EXPECT_TRUE(close("conv1d_silu_step", got, expected, tolerance(dtype)));
    const Values st = state.values();
    for (std::size_t n = 0; n < lengths.size(); ++n)
      for (Index j = 0; j < W - 1; ++j) {
        const Index p = lengths[n] - (W - 1) + j;  // the input at history row j
        for (Index c = 0; c < C; ++c)
          EXPECT_EQ(st[(slots[n] * (W - 1) + j) * C + c], p >= 0 ? xs[(cu[n] + p) * C + c] : 0.0);
      }
    EXPECT_EQ(Values(st.begin() + (W - 1) * C, st.begin() + 2 * (W - 1) * C),
              Values(before.begin() + (W - 1) * C, before.begin() + 2 * (W - 1) * C));
  }
}

TEST_F(OpsTest, RopeAtPositionsEqualsRopeInsideSequences) {
  // Rows of packed sequences rotated by rope equal the same rows rotated at their positions, in any order.
  const Offsets cu = offsets({5, 1, 9});
  const Index T = cu.back();
  std::vector<std::int32_t> positions;
  for (std::size_t n = 0; n + 1 < cu.size(); ++n)
    for (Index t = cu[n]; t < cu[n + 1]; ++t) positions.push_back(static_cast<std::int32_t>(t - cu[n]));
  for (const DType dtype : {f32, f64})
    for (const RopeCase rc : kRopeCases) {
      const Tensor x = random(rng_, dtype, T, rc.heads * rc.head_dim, 2);
      const Values expected = naive_rope(x.values(), rc.heads, rc.head_dim, rc.rotary_dim, 1e4, cu);
      ops_->rope_at_positions(x.view(), static_cast<int>(rc.heads), static_cast<int>(rc.head_dim),
                              static_cast<int>(rc.rotary_dim), 1e4, positions);
      EXPECT_TRUE(close("rope_at_positions", x.values(), expected, tolerance(dtype)));
      EXPECT_TRUE(x.padding_intact());
    }
}

// Attention of new rows over a cache equals attention_forward (naive_attention) over the whole sequence, for
// the sequence's last rows: the cache holds the sequence's keys and values, the new rows' last.
TEST_F(OpsTest, CachedAttentionEqualsAttentionOverTheWholeSequence) {
  const Heads h{4, 2, 8};
  const Index S = 4, L = 12, kv_cols = h.kv * h.dim, q_cols = h.q * h.dim;
  const std::vector<Index> lengths{5, 3, 12}, news{1, 3, 2};
  const std::vector<std::int32_t> slots{2, 0, 3};
  const double scale = 1 / std::sqrt(8.0);
  for (const DType dtype : {f32, f64}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor k_cache = random(rng_, dtype, S * L, kv_cols, 0, -2, 2), v_cache = random(rng_, dtype, S * L, kv_cols);
    const Values kc = k_cache.values(), vc = v_cache.values();
    Values q_new, expected;
    Offsets cu{0};
    for (std::size_t n = 0; n < lengths.size(); ++n) {
      // The whole sequence as one packed batch: queries random, keys and values the cache's rows.
      const Index len = lengths[n];
      const Values q = uniform(rng_, len * q_cols, -2, 2);
      const Values k(kc.begin() + slots[n] * L * kv_cols, kc.begin() + (slots[n] * L + len) * kv_cols);
      const Values v(vc.begin() + slots[n] * L * kv_cols, vc.begin() + (slots[n] * L + len) * kv_cols);
      const Values o = naive_attention(q, k, v, h, scale, Offsets{0, static_cast<std::int32_t>(len)}).first;
      q_new.insert(q_new.end(), q.end() - news[n] * q_cols, q.end());
      expected.insert(expected.end(), o.end() - news[n] * q_cols, o.end());
      cu.push_back(static_cast<std::int32_t>(cu.back() + news[n]));
    }
    const Tensor q = Tensor(dtype, cu.back(), q_cols).set(q_new), o = unset(dtype, cu.back(), q_cols, 1);
    const std::vector<std::int32_t> lens(lengths.begin(), lengths.end());
    ops_->cached_attention(o.view(), q.view(), cache_view(k_cache, S, L), cache_view(v_cache, S, L), 4, 2, 8, scale,
                           cu, slots, lens);
    EXPECT_TRUE(close("cached_attention", o.values(), expected, tolerance(dtype)));
    EXPECT_TRUE(o.padding_intact());
  }
}

TEST_F(OpsTest, InferenceOpsRefuseBadInputByName) {
  const Tensor src(f32, 4, 3), dst(f32, 5, 3);
  using Ids = std::vector<std::int32_t>;
  expect_invalid("dst_rows", [&] { ops_->copy_rows(dst.view(), Ids{1, 1}, src.view(), Ids{0, 2}); });
  expect_invalid("dst_rows", [&] { ops_->copy_rows(dst.view(), Ids{5}, src.view(), Ids{0}); });
  expect_invalid("src_rows", [&] { ops_->copy_rows(dst.view(), Ids{0}, src.view(), Ids{4}); });
  expect_invalid("src_rows", [&] { ops_->copy_rows(dst.view(), Ids{0, 1}, src.view(), Ids{0}); });
  expect_invalid("src", [&] { ops_->copy_rows(dst.view(), Ids{0}, Tensor(f32, 4, 2).view(), Ids{0}); });

  const Tensor x(f32, 2, 3), out(f32, 2, 3), w(f32, 3, 4), state(f32, 4 * 3, 3);
  const TensorView st = cache_view(state, 4, 3);
  expect_invalid("slots", [&] { ops_->conv1d_silu_step(out.view(), x.view(), w.view(), st, Ids{0, 4}); });
  expect_invalid("slots", [&] { ops_->conv1d_silu_step(out.view(), x.view(), w.view(), st, Ids{1, 1}); });
  expect_invalid("slots", [&] { ops_->conv1d_silu_step(out.view(), x.view(), w.view(), st, Ids{1}); });
  expect_invalid("state", [&] {
    ops_->conv1d_silu_step(out.view(), x.view(), w.view(), cache_view(state, 6, 2), Ids{0, 1});
  });
  expect_invalid("state", [&] { ops_->conv1d_silu_step(out.view(), x.view(), w.view(), state.view(), Ids{0, 1}); });

  const Tensor xr(f32, 2, 8);
  expect_invalid("positions", [&] { ops_->rope_at_positions(xr.view(), 2, 4, 2, 1e4, Ids{0, -1}); });
  expect_invalid("positions", [&] { ops_->rope_at_positions(xr.view(), 2, 4, 2, 1e4, Ids{0}); });
  expect_invalid("rotary_dim", [&] { ops_->rope_at_positions(xr.view(), 2, 4, 3, 1e4, Ids{0, 1}); });

  const Tensor q(f32, 2, 8), o(f32, 2, 8), kc(f32, 3 * 5, 4);
  const TensorView k = cache_view(kc, 3, 5);
  expect_invalid("lengths", [&] {
    ops_->cached_attention(o.view(), q.view(), k, k, 2, 1, 4, 0.5, Offsets{0, 2}, Ids{0}, Ids{1});
  });
  expect_invalid("lengths", [&] {
    ops_->cached_attention(o.view(), q.view(), k, k, 2, 1, 4, 0.5, Offsets{0, 2}, Ids{0}, Ids{6});
  });
  expect_invalid("slots", [&] {
    ops_->cached_attention(o.view(), q.view(), k, k, 2, 1, 4, 0.5, Offsets{0, 2}, Ids{3}, Ids{2});
  });
  expect_invalid("v_cache", [&] {
    ops_->cached_attention(o.view(), q.view(), k, cache_view(kc, 5, 3), 2, 1, 4, 0.5, Offsets{0, 2}, Ids{0}, Ids{2});
  });
  expect_invalid("cu_seqlens", [&] {
    ops_->cached_attention(o.view(), q.view(), k, k, 2, 1, 4, 0.5, Offsets{0, 1}, Ids{0}, Ids{2});
  });
}

// ---------------------------------------------------------------------------------------------------------
// Bad input

TEST_F(OpsTest, BadInputThrowsInvalidArgumentNamingTheArgument) {
  const Tensor x32(f32, 4, 6), out32(f32, 4, 6), out64(f64, 4, 6), rstd32 = Tensor::vec(f32, 4);
  const Tensor w32 = Tensor::vec(f32, 6), w5 = Tensor::vec(f32, 5);
  TensorView xi = x32.view();  // the same bytes called int32
  xi.dtype = DType::i32;
  expect_invalid("out",
                 [&] { ops_->rmsnorm_forward(out64.view(), rstd32.view(), x32.view(), w32.view(), 1e-6, true); });
  expect_invalid("weight",
                 [&] { ops_->rmsnorm_forward(out32.view(), rstd32.view(), x32.view(), w5.view(), 1e-6, true); });
  expect_invalid("x", [&] { ops_->rmsnorm_forward(out32.view(), rstd32.view(), xi, w32.view(), 1e-6, true); });
  const Tensor empty32(f32, 4, 0);
  expect_invalid("x's columns", [&] {
    ops_->gated_rmsnorm_forward(empty32.view(), rstd32.view(), empty32.view(), empty32.view(), w32.view(), 1e-6);
  });
  expect_invalid("x", [&] {  // 6 columns are not whole heads of 5
    ops_->gated_rmsnorm_forward(out32.view(), rstd32.view(), x32.view(), x32.view(), w5.view(), 1e-6);
  });
  expect_invalid("b", [&] { ops_->gemm(false, false, 1, x32.view(), x32.view(), 0, out32.view()); });
  expect_invalid(
      "a", [&] { ops_->gemm(false, true, 1, Tensor(f64, 4, 6).view(), x32.view(), 0, Tensor(f32, 4, 4).view()); });

  TensorView overlapping = x32.view();  // rows closer than a row's length
  overlapping.strides[0] = 3;
  expect_invalid("x", [&] { ops_->fill_zero(overlapping); });
  TensorView strided = x32.view();
  strided.strides[1] = 2;
  expect_invalid("src", [&] { ops_->copy(out32.view(), strided); });

  const std::vector<std::int32_t> tokens{0, 1, 9, 2};
  expect_invalid("tokens", [&] { ops_->embedding_forward(out32.view(), tokens, x32.view()); });
  expect_invalid("cu_seqlens", [&] { ops_->rope(x32.view(), 2, 3, 2, 1e4, Offsets{0, 3}, false); });
  expect_invalid("rotary_dim", [&] { ops_->rope(x32.view(), 2, 3, 3, 1e4, Offsets{0, 4}, false); });
  expect_invalid("cu_seqlens", [&] {
    ops_->conv1d_silu_forward(out32.view(), x32.view(), Tensor(f32, 6, 4).view(), Offsets{0, 5});
  });

  const Tensor q(f32, 4, 8), kv(f32, 4, 4), o(f32, 4, 8), lse(f32, 2, 4), bad_lse(f32, 4, 2);
  expect_invalid("lse", [&] {
    ops_->attention_forward(o.view(), bad_lse.view(), q.view(), kv.view(), kv.view(), 2, 1, 4, 0.5, Offsets{0, 4});
  });
  expect_invalid("q_heads", [&] {
    ops_->attention_forward(o.view(), lse.view(), q.view(), kv.view(), kv.view(), 2, 3, 4, 0.5, Offsets{0, 4});
  });
  expect_invalid("k", [&] {
    ops_->attention_forward(o.view(), lse.view(), q.view(), Tensor(f64, 4, 4).view(), kv.view(), 2, 1, 4, 0.5,
                            Offsets{0, 4});
  });

  Values logprob(4);
  const std::vector<std::int32_t> targets{0, 5, 6, -1};
  expect_invalid("targets", [&] { ops_->cross_entropy(x32.view(), targets, doubles(Values(4, 1.0)), doubles(logprob), true); });
  const std::vector<std::int32_t> good_targets{0, 1, 2, 3};
  expect_invalid("weights", [&] { ops_->cross_entropy(x32.view(), good_targets, doubles(Values(3, 1.0)), doubles(logprob), true); });
  expect_invalid("threads", [] { make_cpu_ops(-1); });
}

}  // namespace
}  // namespace deltatrain::model
