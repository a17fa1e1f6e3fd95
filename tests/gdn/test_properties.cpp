// Properties that any backend must have, checked on each host backend: packing sequences changes nothing,
// a sequence split in two with its state carried (and dh0 carried back as dht) equals the whole, the
// recurrent step token by token equals the chunked forward, GVA equals repeating the q/k heads, and the
// cpu backend is bitwise deterministic whatever the thread count.
#include <string>
#include <tuple>
#include <vector>

#include "gdn_testing.h"

namespace deltatrain::gdn::testing {
namespace {

// Row sizes of the token-major and state tensors, for slicing.
struct Rows {
  std::int64_t qk, v, gate, state;
  explicit Rows(const Layout& l) : qk(l.H * l.K), v(l.HV * l.V), gate(l.HV), state(l.HV * l.K * l.V) {}
};

// Tokens [begin, end) of a B == 1 sample, as its own sample of one sequence starting from `h0`.
Sample tokens_of(const Sample& s, std::int64_t begin, std::int64_t end, std::vector<double> h0) {
  const Rows r(s.layout);
  Sample part = s;
  part.layout = Layout{1, end - begin, s.layout.H, s.layout.HV, s.layout.K, s.layout.V, {}};
  part.q = rows(s.q, r.qk, begin, end);
  part.k = rows(s.k, r.qk, begin, end);
  part.v = rows(s.v, r.v, begin, end);
  part.g = rows(s.g, r.gate, begin, end);
  part.beta = rows(s.beta, r.gate, begin, end);
  part.h0 = std::move(h0);
  return part;
}

using BackendAndDtype = std::tuple<std::string, DType>;
std::string name_of(const ::testing::TestParamInfo<BackendAndDtype>& info) {
  return std::get<0>(info.param) + "_" + dtype_name(std::get<1>(info.param));
}
const auto kBackendsAndDtypes =
    ::testing::Combine(::testing::Values("reference", "cpu"), ::testing::Values(DType::f32, DType::f64));

class PackedEqualsSeparate : public SeededTest, public ::testing::WithParamInterface<BackendAndDtype> {};

TEST_P(PackedEqualsSeparate, ForwardAndBackward) {
  const auto& [backend, io] = GetParam();
  const Sample sample = random_sample(packed({0, 65, 3, 0, 129}, 2, 4, 64, 64), io, io, true, true, rng_);
  const Cotangents cot = random_cotangents(sample, true, rng_);
  const RunOptions options{backend, false, true, 0};
  const ForwardResult whole = run_forward(sample, options);
  const BackwardResult grads = run_backward(sample, cot, options);

  const Rows r(sample.layout);
  const std::vector<std::int64_t>& cu = sample.layout.cu_seqlens;
  for (std::size_t n = 0; n + 1 < cu.size(); ++n) {
    SCOPED_TRACE("sequence " + std::to_string(n) + " of length " + std::to_string(cu[n + 1] - cu[n]));
    const Sample alone = tokens_of(sample, cu[n], cu[n + 1], rows(sample.h0, r.state, n, n + 1));
    const Cotangents alone_cot{rows(cot.d_o, r.v, cu[n], cu[n + 1]), rows(cot.dht, r.state, n, n + 1)};
    const ForwardResult f = run_forward(alone, options);
    const BackwardResult b = run_backward(alone, alone_cot, options);
    const double tol = tolerance(io);
    EXPECT_TRUE(close("o", f.o.values(), rows(whole.o.values(), r.v, cu[n], cu[n + 1]), tol));
    EXPECT_TRUE(close("final_state", f.ht.values(), rows(whole.ht.values(), r.state, n, n + 1), tol));
    EXPECT_TRUE(close("dq", b.dq.values(), rows(grads.dq.values(), r.qk, cu[n], cu[n + 1]), tol));
    EXPECT_TRUE(close("dk", b.dk.values(), rows(grads.dk.values(), r.qk, cu[n], cu[n + 1]), tol));
    EXPECT_TRUE(close("dv", b.dv.values(), rows(grads.dv.values(), r.v, cu[n], cu[n + 1]), tol));
    EXPECT_TRUE(close("dg", b.dg.values(), rows(grads.dg.values(), r.gate, cu[n], cu[n + 1]), tol));
    EXPECT_TRUE(close("dbeta", b.dbeta.values(), rows(grads.dbeta.values(), r.gate, cu[n], cu[n + 1]), tol));
    EXPECT_TRUE(close("dh0", b.dh0.values(), rows(grads.dh0.values(), r.state, n, n + 1), tol));
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, PackedEqualsSeparate, kBackendsAndDtypes, name_of);

class SplitWithCarriedState : public SeededTest, public ::testing::WithParamInterface<BackendAndDtype> {};

TEST_P(SplitWithCarriedState, EqualsTheWholeSequence) {
  const auto& [backend, io] = GetParam();
  constexpr std::int64_t kLength = 150, kCut = 70;  // neither part fills whole chunks
  const Sample sample = random_sample(Layout{1, kLength, 2, 4, 64, 64, {}}, io, io, true, true, rng_);
  const Cotangents cot = random_cotangents(sample, true, rng_);
  const RunOptions options{backend, false, true, 0};
  const Rows r(sample.layout);

  const Sample first = tokens_of(sample, 0, kCut, sample.h0);
  const ForwardResult f1 = run_forward(first, options);
  const Sample second = tokens_of(sample, kCut, kLength, f1.ht.values());
  const ForwardResult f2 = run_forward(second, options);
  const ForwardResult whole = run_forward(sample, options);
  std::vector<double> o = f1.o.values();
  append(o, f2.o.values());
  const double tol = tolerance(io);
  EXPECT_TRUE(close("o", o, whole.o.values(), tol));
  EXPECT_TRUE(close("final_state", f2.ht.values(), whole.ht.values(), tol));

  // Backward runs the parts in reverse: the second part's dh0 is the first part's dht.
  const BackwardResult b2 = run_backward(second, {rows(cot.d_o, r.v, kCut, kLength), cot.dht}, options);
  const BackwardResult b1 = run_backward(first, {rows(cot.d_o, r.v, 0, kCut), b2.dh0.values()}, options);
  const BackwardResult all = run_backward(sample, cot, options);
  for (const auto& [name, one, two, expected] :
       {std::tuple{"dq", &b1.dq, &b2.dq, &all.dq}, {"dk", &b1.dk, &b2.dk, &all.dk}, {"dv", &b1.dv, &b2.dv, &all.dv},
        {"dg", &b1.dg, &b2.dg, &all.dg}, {"dbeta", &b1.dbeta, &b2.dbeta, &all.dbeta}}) {
    std::vector<double> joined = one->values();
    append(joined, two->values());
    EXPECT_TRUE(close(name, joined, expected->values(), tol));
  }
  EXPECT_TRUE(close("dh0", b1.dh0.values(), all.dh0.values(), tol));
}

INSTANTIATE_TEST_SUITE_P(Backends, SplitWithCarriedState, kBackendsAndDtypes, name_of);

class RecurrentSteps : public SeededTest, public ::testing::WithParamInterface<BackendAndDtype> {};

// Decoding: at each step every unfinished sequence takes 1, 2 or 3 more tokens (finished ones take none,
// an empty packed sequence), with the states of the previous step as initial states.
TEST_P(RecurrentSteps, EqualTheChunkedForward) {
  const auto& [backend, io] = GetParam();
  const Sample sample = random_sample(packed({70, 0, 9, 66}, 1, 2, 64, 64), io, io, true, true, rng_);
  const Rows r(sample.layout);
  const std::vector<std::int64_t>& cu = sample.layout.cu_seqlens;
  const std::int64_t N = sample.layout.sequences();

  std::vector<double> o(sample.v.size()), states = sample.h0;
  std::vector<std::int64_t> done(N, 0);
  for (int step = 0;; ++step) {
    std::vector<std::int64_t> take(N);
    std::int64_t total = 0;
    for (std::int64_t n = 0; n < N; ++n) total += take[n] = std::min<std::int64_t>(1 + step % 3, cu[n + 1] - cu[n] - done[n]);
    if (total == 0) break;
    Sample part = sample;
    part.layout = packed(take, sample.layout.H, sample.layout.HV, sample.layout.K, sample.layout.V);
    part.q.clear(), part.k.clear(), part.v.clear(), part.g.clear(), part.beta.clear();
    for (std::int64_t n = 0; n < N; ++n) {
      const std::int64_t begin = cu[n] + done[n], end = begin + take[n];
      append(part.q, rows(sample.q, r.qk, begin, end));
      append(part.k, rows(sample.k, r.qk, begin, end));
      append(part.v, rows(sample.v, r.v, begin, end));
      append(part.g, rows(sample.g, r.gate, begin, end));
      append(part.beta, rows(sample.beta, r.gate, begin, end));
    }
    part.h0 = states;
    const ForwardResult stepped = run_forward(part, {backend, true, true, 0});
    states = stepped.ht.values();
    const std::vector<double> step_o = stepped.o.values();
    for (std::int64_t n = 0, row = 0; n < N; row += take[n], ++n) {
      std::copy(step_o.begin() + row * r.v, step_o.begin() + (row + take[n]) * r.v, o.begin() + (cu[n] + done[n]) * r.v);
      done[n] += take[n];
    }
  }
  const ForwardResult chunked = run_forward(sample, {backend, false, true, 0});
  EXPECT_TRUE(close("o", o, chunked.o.values(), tolerance(io)));
  EXPECT_TRUE(close("final_state", states, chunked.ht.values(), tolerance(io)));
}

INSTANTIATE_TEST_SUITE_P(Backends, RecurrentSteps, kBackendsAndDtypes, name_of);

class GroupedValueHeads : public SeededTest, public ::testing::WithParamInterface<BackendAndDtype> {};

// HV = 4 H: value head j reads q/k head j / 4, as if q and k were repeat_interleave'd to HV heads; the
// gradients of the shared q/k heads are the sums over their groups.
TEST_P(GroupedValueHeads, EqualRepeatingQueryAndKeyHeads) {
  const auto& [backend, io] = GetParam();
  constexpr std::int64_t kGroup = 4;
  const Sample gva = random_sample(packed({40, 70}, 2, 2 * kGroup, 64, 64), io, io, true, true, rng_);
  const Cotangents cot = random_cotangents(gva, true, rng_);
  const Layout& l = gva.layout;
  Sample repeated = gva;
  repeated.layout.H = l.HV;
  repeated.q.clear(), repeated.k.clear();
  for (std::int64_t t = 0; t < l.T; ++t) {
    for (std::int64_t j = 0; j < l.HV; ++j) {
      const std::int64_t from = (t * l.H + j / kGroup) * l.K;
      repeated.q.insert(repeated.q.end(), gva.q.begin() + from, gva.q.begin() + from + l.K);
      repeated.k.insert(repeated.k.end(), gva.k.begin() + from, gva.k.begin() + from + l.K);
    }
  }
  const RunOptions options{backend, false, true, 0};
  const double tol = tolerance(io);
  const ForwardResult a = run_forward(gva, options), b = run_forward(repeated, options);
  EXPECT_TRUE(close("o", a.o.values(), b.o.values(), tol));
  EXPECT_TRUE(close("final_state", a.ht.values(), b.ht.values(), tol));

  const BackwardResult ga = run_backward(gva, cot, options), gb = run_backward(repeated, cot, options);
  for (const auto& [name, grouped, each] : {std::tuple{"dq", &ga.dq, &gb.dq}, {"dk", &ga.dk, &gb.dk}}) {
    const std::vector<double> per_head = each->values();
    std::vector<double> summed(grouped->values().size(), 0.0);
    for (std::int64_t t = 0; t < l.T; ++t) {
      for (std::int64_t j = 0; j < l.HV; ++j) {
        for (std::int64_t i = 0; i < l.K; ++i) summed[(t * l.H + j / kGroup) * l.K + i] += per_head[(t * l.HV + j) * l.K + i];
      }
    }
    EXPECT_TRUE(close(name, grouped->values(), summed, tol));
  }
  EXPECT_TRUE(close("dv", ga.dv.values(), gb.dv.values(), tol));
  EXPECT_TRUE(close("dg", ga.dg.values(), gb.dg.values(), tol));
  EXPECT_TRUE(close("dbeta", ga.dbeta.values(), gb.dbeta.values(), tol));
  EXPECT_TRUE(close("dh0", ga.dh0.values(), gb.dh0.values(), tol));
}

INSTANTIATE_TEST_SUITE_P(Backends, GroupedValueHeads, kBackendsAndDtypes, name_of);

class CpuDeterminism : public SeededTest, public ::testing::WithParamInterface<DType> {};

TEST_P(CpuDeterminism, BitwiseAcrossThreadCounts) {
  const DType io = GetParam();
  const DType gate = io == DType::f64 ? DType::f64 : DType::f32;
  const Sample sample = random_sample(packed({100, 0, 37, 64, 129}, 2, 4, 64, 64), io, gate, true, true, rng_);
  const Cotangents cot = random_cotangents(sample, true, rng_);
  const auto run_all = [&](int threads) {
    const ForwardResult f = run_forward(sample, {"cpu", false, true, threads});
    const ForwardResult s = run_forward(sample, {"cpu", true, true, threads});
    const BackwardResult b = run_backward(sample, cot, {"cpu", false, true, threads});
    return std::vector<std::vector<std::uint8_t>>{f.o.bytes(), f.ht.bytes(), s.o.bytes(),     s.ht.bytes(),
                                                  b.dq.bytes(), b.dk.bytes(), b.dv.bytes(),    b.dg.bytes(),
                                                  b.dbeta.bytes(), b.dh0.bytes()};
  };
  const char* names[] = {"o", "final_state", "recurrent o", "recurrent final_state", "dq", "dk", "dv", "dg",
                         "dbeta", "dh0"};
  const auto one = run_all(1);
  for (int threads : {2, 3}) {
    const auto many = run_all(threads);
    for (std::size_t i = 0; i < one.size(); ++i) {
      EXPECT_TRUE(one[i] == many[i]) << names[i] << " differs between 1 and " << threads << " threads";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CpuDeterminism, ::testing::Values(DType::f32, DType::bf16, DType::f64),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace deltatrain::gdn::testing
