// The cpu backend: the chunked (WY / UT-transform) algorithm of docs/gdn-algorithm.md §3, chunk 64.
//
// Within a chunk of L tokens entering with state S (K x V), with gamma the chunk-local cumulative
// log-decay, E_i = exp(gamma_i), D_i = exp(gamma_last - gamma_i), Gamma_ij = exp(gamma_i - gamma_j) (i >= j;
// formed from the gates between j and i, never as a difference, see Chunk::load):
//   A     = strict_lower(diag(beta) (K K^T .* Gamma))
//   Delta = (I + A)^-1 diag(beta) (V - diag(E) K S)          pseudo-values, by blocked substitution
//   O     = scale (diag(E) Q S + (lower(Q K^T) .* Gamma) Delta)
//   S'    = E_last S + K^T diag(D) Delta
// The backward differentiates exactly these expressions, chunk by chunk in reverse, replaying the forward
// from the saved chunk-entry states; (I + A)^-T is applied by back substitution, never formed.
//
// Threads take (sequence, head) pairs; each pair is computed by one thread in a fixed order, so results
// are bitwise identical whatever the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "cpu/small_gemm.h"
#include "deltatrain/gdn/registry.h"
#include "host/host_backend.h"
#include "host/host_tensors.h"
#include "host/l2norm.h"
#include "host/parallel.h"

namespace deltatrain::gdn {
namespace {

using cpu::gemm_nn;
using cpu::gemm_tn;
using cpu::Matrix;
using cpu::matrix;
using cpu::solve_unit_lower;
using cpu::solve_unit_lower_transposed;
using cpu::transpose;
using host::BackwardArrays;
using host::ForwardArrays;
using host::InputArrays;

constexpr std::int64_t kChunk = 64;
// The backward keeps the forward intermediates of up to this many bytes of chunks per thread from its
// replay pass, so that the reverse pass need not recompute them; longer sequences recompute the rest.
constexpr std::int64_t kReplayCacheBytes = std::int64_t{64} << 20;

int thread_count(const Problem& p) { return p.cpu_threads > 0 ? p.cpu_threads : omp_get_max_threads(); }

// One chunk of one (sequence, value head) pair: its inputs and every forward intermediate.
template <class T>
class Chunk {
 public:
  Chunk(const Problem& p, const InputArrays<T>& a)
      : p_(p), a_(a), K(p.K), V(p.V),
        q(kChunk * K), k(kChunk * K), k_t(K * kChunk), v(kChunk * V), beta(kChunk), gate(kChunk), E(kChunk), D(kChunk),
        decay(kChunk * kChunk), kk(kChunk * kChunk), A(kChunk * kChunk), qk(kChunk * kChunk), P(kChunk * kChunk),
        ks(kChunk * V), qs(kChunk * V), rhs(kChunk * V), delta(kChunk * V) {}

  // Gathers tokens [first, first + length) of value head j and computes everything that does not
  // depend on the state.
  void load(std::int64_t first, std::int64_t length, std::int64_t j) {
    L = length;
    const std::int64_t qk_head = j / p_.group();
    for (std::int64_t i = 0; i < L; ++i) {
      const std::int64_t token = first + i;
      const T* qrow = &a_.q[(token * p_.H + qk_head) * K];
      const T* krow = &a_.k[(token * p_.H + qk_head) * K];
      if (p_.l2norm) {
        host::l2_normalize(qrow, &q[i * K], K);
        host::l2_normalize(krow, &k[i * K], K);
      } else {
        std::copy_n(qrow, K, &q[i * K]);
        std::copy_n(krow, K, &k[i * K]);
      }
      std::copy_n(&a_.v[(token * p_.HV + j) * V], V, &v[i * V]);
      beta[i] = a_.beta[token * p_.HV + j];
      gate[i] = a_.g[token * p_.HV + j];
    }
    // Gamma_ic = exp(g_{c+1} + ... + g_i) sums the gates between c and i for each pair instead of taking
    // the difference gamma_i - gamma_c of cumulative sums: after a gate of -inf (a full reset of the
    // state) that difference is -inf - (-inf) = NaN, and after strong decay (g = -1e4) it loses the small
    // gates that follow in the rounding of the large sums. The direct sum is -inf exactly when the state
    // was reset between c and i (Gamma_ic = 0) and otherwise as exact as the gates it adds.
    for (std::int64_t c = 0; c < L; ++c) {
      T between = 0;
      for (std::int64_t i = 0; i < L; ++i) {
        if (i > c) between += gate[i];
        decay[i * L + c] = i < c ? T(0) : i == c ? T(1) : std::exp(between);
      }
    }
    T cumulative = 0;
    for (std::int64_t i = 0; i < L; ++i) {
      cumulative += gate[i];
      E[i] = std::exp(cumulative);
      D[i] = decay[(L - 1) * L + i];
    }
    E_last = L > 0 ? E[L - 1] : T(1);
    transpose<T>(mat(k, L, K), k_t.data());
    gemm_nn<T>(mat(kk, L, L), mat(k, L, K), mat(k_t, K, L));
    gemm_nn<T>(mat(qk, L, L), mat(q, L, K), mat(k_t, K, L));
    for (std::int64_t i = 0; i < L; ++i) {
      for (std::int64_t c = 0; c < L; ++c) {
        A[i * L + c] = c < i ? beta[i] * kk[i * L + c] * decay[i * L + c] : T(0);
        P[i * L + c] = qk[i * L + c] * decay[i * L + c];  // decay is zero above the diagonal
      }
    }
  }

  // The state-dependent part: K S, Q S, the right-hand side and Delta.
  void solve(const T* state) {
    const Matrix<const T> S{state, K, V, V};
    gemm_nn<T>(mat(ks, L, V), mat(k, L, K), S);
    gemm_nn<T>(mat(qs, L, V), mat(q, L, K), S);
    for (std::int64_t i = 0; i < L; ++i)
      for (std::int64_t c = 0; c < V; ++c) rhs[i * V + c] = beta[i] * (v[i * V + c] - E[i] * ks[i * V + c]);
    // (I + A) Delta = rhs, A strictly lower.
    std::copy_n(rhs.begin(), L * V, delta.begin());
    solve_unit_lower<T>(mat(A, L, L), mat(delta, L, V));
  }

  // O = scale (diag(E) Q S + P Delta), into `out` (L x V).
  void output(T* out) {
    gemm_nn<T>(mat(out, L, V), mat(P, L, L), mat(delta, L, V));
    for (std::int64_t i = 0; i < L; ++i)
      for (std::int64_t c = 0; c < V; ++c) out[i * V + c] = p_.scale * (out[i * V + c] + E[i] * qs[i * V + c]);
  }

  // S <- E_last S + K^T diag(D) Delta, using `scaled` (L x V) as scratch.
  void advance(T* state, T* scaled) {
    for (std::int64_t i = 0; i < L; ++i)
      for (std::int64_t c = 0; c < V; ++c) scaled[i * V + c] = D[i] * delta[i * V + c];
    gemm_tn<T>(Matrix<T>{state, K, V, V}, mat(k, L, K), mat(scaled, L, V), T(1), E_last);
  }

  template <class U>
  static Matrix<U> mat(std::vector<U>& buffer, std::int64_t rows, std::int64_t cols) {
    return matrix(buffer.data(), rows, cols);
  }
  static Matrix<T> mat(T* data, std::int64_t rows, std::int64_t cols) { return matrix(data, rows, cols); }

  const Problem& p_;
  const InputArrays<T>& a_;
  const std::int64_t K, V;
  std::int64_t L = 0;
  std::vector<T> q, k, k_t, v, beta, gate, E, D, decay, kk, A, qk, P, ks, qs, rhs, delta;
  T E_last = 1;
};

// What a call's OpenMP region allocates per thread, for the message when memory runs out.
std::string workspace(const Problem& p, const std::string& what) {
  return std::string("the cpu backend's per-thread workspace for the ") + operation_name(p.op) + " (" + what +
         "; K = " + std::to_string(p.K) + ", V = " + std::to_string(p.V) + ")";
}

template <class T>
std::string state_bytes(const Problem& p, std::int64_t states = 1) {
  return host::format_bytes(static_cast<double>(states) * static_cast<double>(p.K * p.V) * sizeof(T));
}

template <class T>
void forward(const Problem& p, const Inputs& in, const ForwardOutputs& out) {
  const InputArrays<T> a(in);
  ForwardArrays<T> outputs(out);
  const std::int64_t K = p.K, V = p.V;
  host::ParallelFailure failure(workspace(p, "a K x V state of " + state_bytes<T>(p) + " and 64-token chunk buffers"));

#pragma omp parallel num_threads(thread_count(p))
  {
    std::optional<Chunk<T>> chunk;
    std::vector<T> state, block, scaled;
    failure.guard([&] {
      state.resize(K * V);  // the largest first: a call too large for memory fails before touching any
      chunk.emplace(p, a);
      block.resize(kChunk * V);
      scaled.resize(kChunk * V);
    });
#pragma omp for schedule(dynamic)
    for (std::int64_t pair = 0; pair < p.N * p.HV; ++pair) {
      failure.guard([&] {
        const std::int64_t n = pair / p.HV, j = pair % p.HV;
        a.initial_state(p, n, j, state.data());
        for (std::int64_t first = p.offsets[n]; first < p.offsets[n + 1]; first += kChunk) {
          const std::int64_t length = std::min(kChunk, p.offsets[n + 1] - first);
          chunk->load(first, length, j);
          chunk->solve(state.data());
          chunk->output(block.data());
          for (std::int64_t i = 0; i < length; ++i) {
            std::copy_n(&block[i * V], V, &outputs.o[((first + i) * p.HV + j) * V]);
          }
          chunk->advance(state.data(), scaled.data());
        }
        outputs.store_final_state(p, n, j, state.data());
      });
    }
  }
  failure.rethrow();
  outputs.commit();
}

// Scratch of the backward for one chunk, allocated once per thread.
template <class T>
struct BackwardScratch {
  std::vector<T> state_t, d_state_t, delta_t, d_o, kds, d_delta, d_rhs, d_r, dP, dA, G, dM, dq, dk, tmp, d_gamma;
  BackwardScratch(std::int64_t K, std::int64_t V)
      : state_t(V * K), d_state_t(V * K), delta_t(V * kChunk), d_o(kChunk * V), kds(kChunk * V), d_delta(kChunk * V), d_rhs(kChunk * V), d_r(kChunk * V),
        dP(kChunk * kChunk), dA(kChunk * kChunk), G(kChunk * kChunk), dM(kChunk * kChunk), dq(kChunk * K),
        dk(kChunk * K), tmp(kChunk * std::max(K, V)), d_gamma(kChunk) {}
};

// Gradients of one chunk. On entry `d_state` is the gradient of the state leaving the chunk; on exit,
// of the state entering it. Writes dv, dg, dbeta of value head j and adds the q/k gradients (of the
// normalised rows) into dq_hat / dk_hat at row offset `row`.
template <class T>
void chunk_backward(const Problem& p, Chunk<T>& c, BackwardScratch<T>& s, const T* state, T* d_state,
                    std::int64_t first, std::int64_t j, T* dq_hat, T* dk_hat, BackwardArrays<T>& grads) {
  using Ch = Chunk<T>;
  const std::int64_t L = c.L, K = c.K, V = c.V;
  const T scale = static_cast<T>(p.scale);
  const Matrix<const T> S{state, K, V, V};
  const Matrix<const T> dS{d_state, K, V, V};
  for (std::int64_t i = 0; i < L; ++i) std::copy_n(&grads.d_o[((first + i) * p.HV + j) * V], V, &s.d_o[i * V]);
  transpose<T>(S, s.state_t.data());
  transpose<T>(dS, s.d_state_t.data());
  transpose<T>(Ch::mat(c.delta, L, V), s.delta_t.data());
  const Matrix<const T> S_t{s.state_t.data(), V, K, K};
  const Matrix<const T> dS_t{s.d_state_t.data(), V, K, K};

  // O = scale (diag(E) Q S + P Delta)  ->  dP = scale dO Delta^T (lower), dDelta = scale P^T dO
  gemm_nn<T>(Ch::mat(s.dP, L, L), Ch::mat(s.d_o, L, V), Ch::mat(s.delta_t, V, L), scale);
  for (std::int64_t i = 0; i < L; ++i)
    for (std::int64_t col = i + 1; col < L; ++col) s.dP[i * L + col] = 0;
  gemm_tn<T>(Ch::mat(s.d_delta, L, V), Ch::mat(c.P, L, L), Ch::mat(s.d_o, L, V), scale);
  // S' = E_last S + K^T diag(D) Delta  ->  dDelta += diag(D) K dS'
  gemm_nn<T>(Ch::mat(s.kds, L, V), Ch::mat(c.k, L, K), dS);
  std::fill_n(s.d_gamma.begin(), L, T(0));
  T d_gamma_last = 0;
  for (std::int64_t i = 0; i < L; ++i) {
    T dD = 0;
    for (std::int64_t e = 0; e < V; ++e) {
      s.d_delta[i * V + e] += c.D[i] * s.kds[i * V + e];
      dD += c.delta[i * V + e] * s.kds[i * V + e];
    }
    // D_last = 1 depends on gamma_last twice, with opposite signs: the terms cancel exactly, and adding
    // then subtracting them would bury the small true dgamma_last (strong decay) in rounding.
    if (i == L - 1) continue;
    s.d_gamma[i] -= dD * c.D[i];
    d_gamma_last += dD * c.D[i];
  }
  T dE_last = 0;
  for (std::int64_t e = 0; e < K * V; ++e) dE_last += state[e] * d_state[e];
  d_gamma_last += dE_last * c.E_last;

  // Delta = (I + A)^-1 rhs  ->  d_rhs = (I + A)^-T dDelta (back substitution), dA = -d_rhs Delta^T (strict lower)
  std::copy_n(s.d_delta.begin(), L * V, s.d_rhs.begin());
  solve_unit_lower_transposed<T>(Ch::mat(c.A, L, L), Ch::mat(s.d_rhs, L, V));
  gemm_nn<T>(Ch::mat(s.dA, L, L), Ch::mat(s.d_rhs, L, V), Ch::mat(s.delta_t, V, L), T(-1));

  // rhs = diag(beta) (V - diag(E) K S);  A = strict_lower(diag(beta) (K K^T .* Gamma));  P = lower(Q K^T) .* Gamma
  for (std::int64_t i = 0; i < L; ++i) {
    T d_beta = 0, dE = 0;
    for (std::int64_t e = 0; e < V; ++e) {
      const T d_rhs = s.d_rhs[i * V + e];
      d_beta += d_rhs * (c.v[i * V + e] - c.E[i] * c.ks[i * V + e]);
      s.d_r[i * V + e] = c.beta[i] * d_rhs;
      dE += scale * c.qs[i * V + e] * s.d_o[i * V + e] - s.d_r[i * V + e] * c.ks[i * V + e];
    }
    for (std::int64_t col = 0; col < L; ++col) {
      const T dA = col < i ? s.dA[i * L + col] : T(0);
      d_beta += dA * c.decay[i * L + col] * c.kk[i * L + col];
      s.G[i * L + col] = dA * c.beta[i] * c.decay[i * L + col];
      s.dM[i * L + col] = s.dP[i * L + col] * c.decay[i * L + col];
      // Every factor exp(gamma_i - gamma_col) x adds x to dgamma_i and subtracts it from dgamma_col.
      // Gamma_ii = 1 carries no decay; skipping it keeps the exact cancellation out of the rounding.
      if (col != i) {
        const T through_decay = dA * c.A[i * L + col] + s.dP[i * L + col] * c.P[i * L + col];
        s.d_gamma[i] += through_decay;
        s.d_gamma[col] -= through_decay;
      }
    }
    s.d_gamma[i] += dE * c.E[i];
    grads.dbeta[(first + i) * p.HV + j] = d_beta;
    std::copy_n(&s.d_r[i * V], V, &grads.dv[((first + i) * p.HV + j) * V]);
  }
  s.d_gamma[L - 1] += d_gamma_last;
  T suffix = 0;  // g enters gamma_i for every i >= its position: a reverse cumulative sum
  for (std::int64_t i = L - 1; i >= 0; --i) {
    suffix += s.d_gamma[i];
    grads.dg[(first + i) * p.HV + j] = suffix;
  }

  // dQ = scale diag(E) dO S^T + dM K
  gemm_nn<T>(Ch::mat(s.dq, L, K), Ch::mat(s.d_o, L, V), S_t);
  for (std::int64_t i = 0; i < L; ++i)
    for (std::int64_t e = 0; e < K; ++e) s.dq[i * K + e] *= scale * c.E[i];
  gemm_nn<T>(Ch::mat(s.dq, L, K), Ch::mat(s.dM, L, L), Ch::mat(c.k, L, K), T(1), T(1));
  // dK = diag(D) Delta dS'^T - diag(E) dR S^T + G K + G^T K + dM^T Q
  for (std::int64_t i = 0; i < L; ++i)
    for (std::int64_t e = 0; e < V; ++e) s.tmp[i * V + e] = c.D[i] * c.delta[i * V + e];
  gemm_nn<T>(Ch::mat(s.dk, L, K), Ch::mat(s.tmp, L, V), dS_t);
  for (std::int64_t i = 0; i < L; ++i)
    for (std::int64_t e = 0; e < V; ++e) s.tmp[i * V + e] = -c.E[i] * s.d_r[i * V + e];
  gemm_nn<T>(Ch::mat(s.dk, L, K), Ch::mat(s.tmp, L, V), S_t, T(1), T(1));
  gemm_nn<T>(Ch::mat(s.dk, L, K), Ch::mat(s.G, L, L), Ch::mat(c.k, L, K), T(1), T(1));
  gemm_tn<T>(Ch::mat(s.dk, L, K), Ch::mat(s.G, L, L), Ch::mat(c.k, L, K), T(1), T(1));
  gemm_tn<T>(Ch::mat(s.dk, L, K), Ch::mat(s.dM, L, L), Ch::mat(c.q, L, K), T(1), T(1));
  for (std::int64_t e = 0; e < L * K; ++e) {
    dq_hat[e] += s.dq[e];
    dk_hat[e] += s.dk[e];
  }

  // dS = E_last dS' + Q^T diag(scale E) dO - K^T diag(E) dR   (tmp still holds -diag(E) dR)
  gemm_tn<T>(Matrix<T>{d_state, K, V, V}, Ch::mat(c.k, L, K), Ch::mat(s.tmp, L, V), T(1), c.E_last);
  for (std::int64_t i = 0; i < L; ++i)
    for (std::int64_t e = 0; e < V; ++e) s.tmp[i * V + e] = scale * c.E[i] * s.d_o[i * V + e];
  gemm_tn<T>(Matrix<T>{d_state, K, V, V}, Ch::mat(c.q, L, K), Ch::mat(s.tmp, L, V), T(1), T(1));
}

template <class T>
void backward(const Problem& p, const Inputs& in, const BackwardInputs& gi, const Gradients& go) {
  const InputArrays<T> a(in);
  BackwardArrays<T> grads(gi, go);
  const std::int64_t K = p.K, V = p.V;
  const std::int64_t longest_chunks = (p.max_seqlen() + kChunk - 1) / kChunk;
  host::ParallelFailure failure(workspace(
      p, "a K x V state of " + state_bytes<T>(p) + ", 64-token chunk buffers, a replay cache of up to " +
             host::format_bytes(kReplayCacheBytes) + " and the states entering each chunk of the longest sequence, " +
             state_bytes<T>(p, longest_chunks + 1)));

#pragma omp parallel num_threads(thread_count(p))
  {
    std::optional<Chunk<T>> recomputed;
    std::vector<Chunk<T>> cache;
    const std::int64_t chunk_bytes = static_cast<std::int64_t>(sizeof(T)) * kChunk * (3 * K + 5 * V + 5 * kChunk);
    const std::int64_t cache_capacity = std::max<std::int64_t>(1, kReplayCacheBytes / chunk_bytes);
    std::optional<BackwardScratch<T>> scratch;
    std::vector<T> states, d_state, scaled, dq_hat, dk_hat;
    failure.guard([&] {
      d_state.resize(K * V);  // the largest first: a call too large for memory fails before touching any
      recomputed.emplace(p, a);
      scratch.emplace(K, V);
      scaled.resize(kChunk * V);
    });
    // One task per (sequence, q/k head): it sums the q/k gradients of its value-head group in order.
#pragma omp for schedule(dynamic)
    for (std::int64_t task = 0; task < p.N * p.H; ++task) {
      failure.guard([&] {
        const std::int64_t n = task / p.H, qk_head = task % p.H;
        const std::int64_t begin = p.offsets[n], length = p.offsets[n + 1] - begin;
        const std::int64_t chunks = (length + kChunk - 1) / kChunk;
        const std::int64_t cached = std::min(chunks, cache_capacity);
        while (static_cast<std::int64_t>(cache.size()) < cached) cache.emplace_back(p, a);
        dq_hat.assign(length * K, T(0));
        dk_hat.assign(length * K, T(0));
        states.resize((chunks + 1) * K * V);
        // Chunk c's intermediates: from the cache, or recomputed from its entry state.
        auto chunk_at = [&](std::int64_t c, std::int64_t j, bool replaying) -> Chunk<T>& {
          if (!replaying && c < cached) return cache[c];
          Chunk<T>& chunk = c < cached ? cache[c] : *recomputed;
          const std::int64_t first = begin + c * kChunk;
          chunk.load(first, std::min(kChunk, begin + length - first), j);
          chunk.solve(&states[c * K * V]);
          return chunk;
        };
        for (std::int64_t j = qk_head * p.group(); j < (qk_head + 1) * p.group(); ++j) {
          // Replay the forward, keeping the state that enters each chunk.
          a.initial_state(p, n, j, states.data());
          for (std::int64_t c = 0; c < chunks; ++c) {
            Chunk<T>& chunk = chunk_at(c, j, true);
            std::copy_n(&states[c * K * V], K * V, &states[(c + 1) * K * V]);
            chunk.advance(&states[(c + 1) * K * V], scaled.data());
          }
          grads.final_state_gradient(p, n, j, d_state.data());
          for (std::int64_t c = chunks - 1; c >= 0; --c) {
            const std::int64_t first = begin + c * kChunk;
            chunk_backward(p, chunk_at(c, j, false), *scratch, &states[c * K * V], d_state.data(), first, j,
                           &dq_hat[(first - begin) * K], &dk_hat[(first - begin) * K], grads);
          }
          grads.store_initial_state_gradient(p, n, j, d_state.data());
        }
        host::store_qk_gradients(p, n, qk_head, a, dq_hat.data(), dk_hat.data(), grads);
      });
    }
  }
  failure.rethrow();
  grads.commit();
}

// The rollout step: the recurrence token by token, vectorised along V.
template <class T>
void recurrent(const Problem& p, const Inputs& in, const ForwardOutputs& out) {
  const InputArrays<T> a(in);
  ForwardArrays<T> outputs(out);
  const std::int64_t K = p.K, V = p.V;
  host::ParallelFailure failure(workspace(p, "a K x V state of " + state_bytes<T>(p)));

#pragma omp parallel num_threads(thread_count(p))
  {
    std::vector<T> h, qn, kn, correction;
    failure.guard([&] {
      h.resize(K * V);
      qn.resize(K);
      kn.resize(K);
      correction.resize(V);
    });
#pragma omp for schedule(dynamic)
    for (std::int64_t pair = 0; pair < p.N * p.HV; ++pair) {
      failure.guard([&] {
        const std::int64_t n = pair / p.HV, j = pair % p.HV, qk_head = j / p.group();
        a.initial_state(p, n, j, h.data());
        for (std::int64_t token = p.offsets[n]; token < p.offsets[n + 1]; ++token) {
          const T* qrow = &a.q[(token * p.H + qk_head) * K];
          const T* krow = &a.k[(token * p.H + qk_head) * K];
          if (p.l2norm) {
            host::l2_normalize(qrow, qn.data(), K);
            host::l2_normalize(krow, kn.data(), K);
          } else {
            std::copy_n(qrow, K, qn.begin());
            std::copy_n(krow, K, kn.begin());
          }
          const T decay = std::exp(a.g[token * p.HV + j]);
          const T beta = a.beta[token * p.HV + j];
          const T* vrow = &a.v[(token * p.HV + j) * V];
          for (T& x : h) x *= decay;
          std::fill(correction.begin(), correction.end(), T(0));
          for (std::int64_t i = 0; i < K; ++i)
#pragma omp simd
            for (std::int64_t c = 0; c < V; ++c) correction[c] += h[i * V + c] * kn[i];
          for (std::int64_t c = 0; c < V; ++c) correction[c] = beta * (vrow[c] - correction[c]);
          T* orow = &outputs.o[(token * p.HV + j) * V];
          std::fill_n(orow, V, T(0));
          for (std::int64_t i = 0; i < K; ++i) {
            const T qi = static_cast<T>(p.scale) * qn[i];
#pragma omp simd
            for (std::int64_t c = 0; c < V; ++c) {
              h[i * V + c] += kn[i] * correction[c];
              orow[c] += h[i * V + c] * qi;
            }
          }
        }
        outputs.store_final_state(p, n, j, h.data());
      });
    }
  }
  failure.rethrow();
  outputs.commit();
}

class CpuBackend final : public host::HostBackend {
 public:
  std::string name() const override { return "cpu"; }
  int priority() const override { return 20; }
  std::vector<std::pair<std::string, std::string>> details() const override {
    return {{"algorithm", "chunked WY/UT transform, chunk 64, float32 (float64 for float64 inputs)"},
            {"threads", std::to_string(omp_get_max_threads()) + " (OpenMP)"}};
  }
  void forward(const Problem& p, const Inputs& in, const ForwardOutputs& out) const override {
    p.io_dtype == DType::f64 ? gdn::forward<double>(p, in, out) : gdn::forward<float>(p, in, out);
  }
  void backward(const Problem& p, const Inputs& in, const BackwardInputs& gi, const Gradients& go) const override {
    p.io_dtype == DType::f64 ? gdn::backward<double>(p, in, gi, go) : gdn::backward<float>(p, in, gi, go);
  }
  void recurrent(const Problem& p, const Inputs& in, const ForwardOutputs& out) const override {
    p.io_dtype == DType::f64 ? gdn::recurrent<double>(p, in, out) : gdn::recurrent<float>(p, in, out);
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace deltatrain::gdn
