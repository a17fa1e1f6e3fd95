// The reference backend: the gated delta rule token by token, accumulated in fp64, with an exact
// reverse-mode backward. It is the oracle every other backend is tested against: clarity over speed.
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "deltatrain/gdn/registry.h"
#include "host/host_backend.h"
#include "host/host_tensors.h"
#include "host/l2norm.h"
#include "host/parallel.h"

namespace deltatrain::gdn {
namespace {

using State = std::vector<double>;  // K x V, row-major

// The backward replays the forward from a saved state every kReplaySegment tokens, so that memory
// stays O(T / kReplaySegment) states instead of one state per token.
constexpr std::int64_t kReplaySegment = 64;

using Arrays = host::InputArrays<double>;

// One (sequence, value head) pair: its normalised q/k rows and the step of the recurrence.
class Pair {
 public:
  Pair(const Problem& p, const Arrays& a, std::int64_t n, std::int64_t j)
      : p_(p), a_(a), j_(j), qk_head_(j / p.group()), begin_(p.offsets[n]), length_(p.offsets[n + 1] - p.offsets[n]),
        q_(length_ * p.K), k_(length_ * p.K) {
    for (std::int64_t t = 0; t < length_; ++t) {
      const double* qrow = &a.q[qk_offset(t)];
      const double* krow = &a.k[qk_offset(t)];
      if (p.l2norm) {
        host::l2_normalize(qrow, &q_[t * p.K], p.K);
        host::l2_normalize(krow, &k_[t * p.K], p.K);
      } else {
        std::copy(qrow, qrow + p.K, &q_[t * p.K]);
        std::copy(krow, krow + p.K, &k_[t * p.K]);
      }
    }
  }

  std::int64_t length() const { return length_; }
  std::int64_t begin() const { return begin_; }
  std::int64_t qk_offset(std::int64_t t) const { return ((begin_ + t) * p_.H + qk_head_) * p_.K; }
  std::int64_t v_offset(std::int64_t t) const { return ((begin_ + t) * p_.HV + j_) * p_.V; }
  std::int64_t gate_offset(std::int64_t t) const { return (begin_ + t) * p_.HV + j_; }
  const double* q(std::int64_t t) const { return &q_[t * p_.K]; }
  const double* k(std::int64_t t) const { return &k_[t * p_.K]; }

  // h <- exp(g) h;  v' = beta (v - h^T k);  h <- h + k v'^T;  o = scale h^T q (when o is given).
  void step(State& h, std::int64_t t, double* o) const {
    const std::int64_t K = p_.K, V = p_.V;
    const double decay = std::exp(a_.g[gate_offset(t)]);
    const double beta = a_.beta[gate_offset(t)];
    const double* kt = k(t);
    const double* vt = &a_.v[v_offset(t)];
    for (double& x : h) x *= decay;
    std::vector<double> correction(V, 0.0);
    for (std::int64_t i = 0; i < K; ++i)
      for (std::int64_t c = 0; c < V; ++c) correction[c] += h[i * V + c] * kt[i];
    for (std::int64_t c = 0; c < V; ++c) correction[c] = beta * (vt[c] - correction[c]);
    for (std::int64_t i = 0; i < K; ++i)
      for (std::int64_t c = 0; c < V; ++c) h[i * V + c] += kt[i] * correction[c];
    if (o == nullptr) return;
    const double* qt = q(t);
    for (std::int64_t c = 0; c < V; ++c) {
      double sum = 0.0;
      for (std::int64_t i = 0; i < K; ++i) sum += h[i * V + c] * qt[i];
      o[c] = p_.scale * sum;
    }
  }

 private:
  const Problem& p_;
  const Arrays& a_;
  std::int64_t j_, qk_head_, begin_, length_;
  std::vector<double> q_, k_;
};

State initial_state(const Problem& p, const Arrays& a, std::int64_t n, std::int64_t j) {
  State h(p.K * p.V);
  a.initial_state(p, n, j, h.data());
  return h;
}

// What one (sequence, head) pair allocates, for the message when memory runs out.
std::string workspace(const Problem& p) {
  return std::string("the reference backend's float64 workspace for one (sequence, head) pair of the ") +
         operation_name(p.op) + " (a K x V state of " +
         host::format_bytes(static_cast<double>(p.K * p.V) * sizeof(double)) + ", its normalised q and k rows" +
         (p.op == Operation::chunk_backward ? ", a state every 64 tokens" : "") + "; K = " + std::to_string(p.K) +
         ", V = " + std::to_string(p.V) + ")";
}

void run_forward(const Problem& p, const Inputs& in, const ForwardOutputs& out) {
  const Arrays a(in);
  host::ForwardArrays<double> outputs(out);
  host::ParallelFailure failure(workspace(p));

#pragma omp parallel for schedule(dynamic)
  for (std::int64_t pair = 0; pair < p.N * p.HV; ++pair) {
    failure.guard([&] {
      const std::int64_t n = pair / p.HV, j = pair % p.HV;
      const Pair seq(p, a, n, j);
      State h = initial_state(p, a, n, j);
      for (std::int64_t t = 0; t < seq.length(); ++t) seq.step(h, t, &outputs.o[seq.v_offset(t)]);
      outputs.store_final_state(p, n, j, h.data());
    });
  }
  failure.rethrow();
  outputs.commit();
}

void run_backward(const Problem& p, const Inputs& in, const BackwardInputs& gi, const Gradients& go) {
  const Arrays a(in);
  host::BackwardArrays<double> grads(gi, go);
  const auto& d_o = grads.d_o;
  auto &dv = grads.dv, &dg = grads.dg, &dbeta = grads.dbeta;
  const std::int64_t K = p.K, V = p.V;
  host::ParallelFailure failure(workspace(p));

  // One task per (sequence, q/k head): it owns the q/k gradients summed over its group of value heads.
#pragma omp parallel for schedule(dynamic)
  for (std::int64_t task = 0; task < p.N * p.H; ++task) {
    failure.guard([&] {
      const std::int64_t n = task / p.H, qk_head = task % p.H;
      const std::int64_t length = p.offsets[n + 1] - p.offsets[n];
      std::vector<double> dq_hat(length * K, 0.0), dk_hat(length * K, 0.0);

      for (std::int64_t j = qk_head * p.group(); j < (qk_head + 1) * p.group(); ++j) {
        const Pair seq(p, a, n, j);
        // Saved states at the start of each replay segment.
        std::vector<State> saved;
        State h = initial_state(p, a, n, j);
        for (std::int64_t t = 0; t < length; ++t) {
          if (t % kReplaySegment == 0) saved.push_back(h);
          seq.step(h, t, nullptr);
        }
        State dh(K * V);
        grads.final_state_gradient(p, n, j, dh.data());

        for (std::int64_t segment = static_cast<std::int64_t>(saved.size()) - 1; segment >= 0; --segment) {
          const std::int64_t first = segment * kReplaySegment;
          const std::int64_t last = std::min(length, first + kReplaySegment);
          std::vector<State> states{saved[segment]};  // states[i] is the state before token first + i
          for (std::int64_t t = first; t < last; ++t) {
            states.push_back(states.back());
            seq.step(states.back(), t, nullptr);
          }
          for (std::int64_t t = last - 1; t >= first; --t) {
            const State& h_prev = states[t - first];
            const State& h_t = states[t - first + 1];
            const double decay = std::exp(a.g[seq.gate_offset(t)]);
            const double beta = a.beta[seq.gate_offset(t)];
            const double* qt = seq.q(t);
            const double* kt = seq.k(t);
            const double* vt = &a.v[seq.v_offset(t)];
            const double* dot = &d_o[seq.v_offset(t)];
            // Recompute this token's intermediates: h1 = decay h_prev, u = h1^T k, v' = beta (v - u).
            State h1(h_prev);
            for (double& x : h1) x *= decay;
            std::vector<double> u(V, 0.0), v_new(V);
            for (std::int64_t i = 0; i < K; ++i)
              for (std::int64_t c = 0; c < V; ++c) u[c] += h1[i * V + c] * kt[i];
            for (std::int64_t c = 0; c < V; ++c) v_new[c] = beta * (vt[c] - u[c]);

            // o = scale h_t^T q
            for (std::int64_t i = 0; i < K; ++i) {
              double sum = 0.0;
              for (std::int64_t c = 0; c < V; ++c) {
                sum += h_t[i * V + c] * dot[c];
                dh[i * V + c] += p.scale * qt[i] * dot[c];
              }
              dq_hat[t * K + i] += p.scale * sum;
            }
            // h_t = h1 + k v'^T
            std::vector<double> d_vnew(V, 0.0);
            for (std::int64_t i = 0; i < K; ++i) {
              double sum = 0.0;
              for (std::int64_t c = 0; c < V; ++c) {
                sum += dh[i * V + c] * v_new[c];
                d_vnew[c] += dh[i * V + c] * kt[i];
              }
              dk_hat[t * K + i] += sum;
            }
            // v' = beta (v - u)
            double d_beta = 0.0;
            std::vector<double> du(V);
            for (std::int64_t c = 0; c < V; ++c) {
              d_beta += d_vnew[c] * (vt[c] - u[c]);
              dv[seq.v_offset(t) + c] = beta * d_vnew[c];
              du[c] = -beta * d_vnew[c];
            }
            dbeta[seq.gate_offset(t)] = d_beta;
            // u = h1^T k: dh1 = dh + k du^T, dk += h1 du
            for (std::int64_t i = 0; i < K; ++i) {
              double sum = 0.0;
              for (std::int64_t c = 0; c < V; ++c) {
                sum += h1[i * V + c] * du[c];
                dh[i * V + c] += kt[i] * du[c];
              }
              dk_hat[t * K + i] += sum;
            }
            // h1 = exp(g) h_prev: dg = sum(dh1 * h1), dh_prev = exp(g) dh1
            double d_gate = 0.0;
            for (std::int64_t e = 0; e < K * V; ++e) {
              d_gate += dh[e] * h1[e];
              dh[e] *= decay;
            }
            dg[seq.gate_offset(t)] = d_gate;
          }
        }
        grads.store_initial_state_gradient(p, n, j, dh.data());
      }

      host::store_qk_gradients(p, n, qk_head, a, dq_hat.data(), dk_hat.data(), grads);  // once per q/k head
    });
  }
  failure.rethrow();
  grads.commit();
}

class ReferenceBackend final : public host::HostBackend {
 public:
  std::string name() const override { return "reference"; }
  int priority() const override { return 10; }
  std::vector<std::pair<std::string, std::string>> details() const override {
    return {{"algorithm", "token-by-token recurrence in float64, exact reverse-mode backward"}};
  }
  void forward(const Problem& p, const Inputs& in, const ForwardOutputs& out) const override {
    run_forward(p, in, out);
  }
  void recurrent(const Problem& p, const Inputs& in, const ForwardOutputs& out) const override {
    run_forward(p, in, out);
  }
  void backward(const Problem& p, const Inputs& in, const BackwardInputs& gi, const Gradients& go) const override {
    run_backward(p, in, gi, go);
  }
};

}  // namespace

std::unique_ptr<Backend> make_reference_backend() { return std::make_unique<ReferenceBackend>(); }

}  // namespace deltatrain::gdn
