// The cpu backend's chunk products at the shapes one chunk uses (Google Benchmark).
// Reports GFLOP/s per shape; compare with `deltatrain bench gdn`'s sgemm line for the machine's ceiling.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "cpu/small_gemm.h"

namespace {

using deltatrain::gdn::cpu::gemm_nn;
using deltatrain::gdn::cpu::gemm_tn;
using deltatrain::gdn::cpu::matrix;

template <class T, bool TransposeA>
void chunk_product(benchmark::State& state) {
  const std::int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<double> normal;
  std::vector<T> a(M * K), b(K * N), c(M * N);
  for (T& x : a) x = static_cast<T>(normal(rng));
  for (T& x : b) x = static_cast<T>(normal(rng));
  for (auto _ : state) {
    if constexpr (TransposeA) {
      gemm_tn<T>(matrix(c.data(), M, N), matrix(a.data(), K, M), matrix(b.data(), K, N));
    } else {
      gemm_nn<T>(matrix(c.data(), M, N), matrix(a.data(), M, K), matrix(b.data(), K, N));
    }
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * M * N * K * state.iterations(), benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}

// (M, N, K): K S and Q S (64 x 128 x 128), P Delta (64 x 128 x 64), K^T (D Delta) (128 x 128 x 64), head dim 256.
void chunk_shapes(benchmark::internal::Benchmark* b) {
  b->Args({64, 128, 128})->Args({64, 128, 64})->Args({128, 128, 64})->Args({64, 256, 256})->Args({64, 64, 128});
}

BENCHMARK(chunk_product<float, false>)->Apply(chunk_shapes);
BENCHMARK(chunk_product<float, true>)->Apply(chunk_shapes);
BENCHMARK(chunk_product<double, false>)->Apply(chunk_shapes);

}  // namespace
