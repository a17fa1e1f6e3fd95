// The backend interface and the validated problem description that backends receive.
// Backends never re-check user input: make_problem has done that once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "deltatrain/core/tensor.h"
#include "deltatrain/gdn/gdn.h"

namespace deltatrain::gdn {

enum class Operation { chunk_forward, chunk_backward, recurrent };
const char* operation_name(Operation op);

// A validated call: sizes, sequence boundaries and flags, with every tensor known to be consistent.
struct Problem {
  Operation op = Operation::chunk_forward;
  std::int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  std::int64_t N = 0;                 // sequences (B, or the packed count)
  std::vector<std::int64_t> offsets;  // N + 1 offsets into the B*T flattened tokens
  bool varlen = false;
  double scale = 1.0;
  bool l2norm = false;
  bool has_initial_state = false;
  bool has_final_state = false;  // forward: final_state requested; backward: dht given
  // The recurrent step with state_indices: each sequence's row of the state pools (host values, [N]); empty
  // otherwise, when sequence n's state is row n.
  std::vector<std::int32_t> state_indices;
  std::int64_t state_rows = 0;  // rows of initial_state and final_state: the pool's S, or N
  DType io_dtype = DType::f32;    // q, k, v, o
  DType gate_dtype = DType::f32;  // g
  DType beta_dtype = DType::f32;
  DType state_dtype = DType::f32;  // initial_state, final_state, dht, dh0
  Device device{};
  void* stream = nullptr;
  int cpu_threads = 0;

  std::int64_t tokens() const { return B * T; }
  std::int64_t group() const { return HV / H; }  // value heads per q/k head
  std::int64_t max_seqlen() const;
  std::int64_t state_row(std::int64_t n) const { return state_indices.empty() ? n : state_indices[n]; }
};

// Whether something can be done, and if not, why (one sentence a user can act on).
struct Availability {
  bool ok = true;
  std::string reason;
  static Availability yes() { return {}; }
  static Availability no(std::string why) { return {false, std::move(why)}; }
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // Expected speed rank for "auto": higher is tried first.
  virtual int priority() const = 0;
  // Whether this machine can run the backend at all (hardware, driver, runtime).
  virtual Availability available() const = 0;
  // Whether it can serve this particular call (device, dtype, head dims, operation).
  virtual Availability supports(const Problem& problem) const = 0;
  // Versions and hardware facts worth showing in `deltatrain info`.
  virtual std::vector<std::pair<std::string, std::string>> details() const { return {}; }

  // Bytes of what this backend's chunk_forward keeps in ForwardOutputs::saved for its chunk_backward on the same call
  // (either operation's problem gives the same answer); 0: it keeps nothing.
  virtual std::size_t saved_bytes(const Problem&) const { return 0; }

  virtual void forward(const Problem& problem, const Inputs& in, const ForwardOutputs& out) const = 0;
  virtual void backward(const Problem& problem, const Inputs& in, const BackwardInputs& grads_in,
                        const Gradients& grads_out) const = 0;
  virtual void recurrent(const Problem& problem, const Inputs& in, const ForwardOutputs& out) const = 0;
};

// Validation, exposed for backends' tests and for tools that size buffers before calling.
Problem make_problem(const Inputs& inputs, const Options& options, Operation op);
// Options::cpu_threads alone (InvalidArgument naming cpu_threads), which make_problem checks first: for a tool
// that refuses a bad thread count before work that comes ahead of its first call.
void check_cpu_threads(int cpu_threads);
void check_forward_outputs(const Problem& problem, const ForwardOutputs& outputs);
void check_backward_tensors(const Problem& problem, const Inputs& inputs, const BackwardInputs& grads_in,
                            const Gradients& grads_out);
// ForwardOutputs::saved or BackwardInputs::saved against the size the serving backend asks (Backend::saved_bytes).
void check_saved(const Problem& problem, const TensorView& saved, std::size_t bytes);

}  // namespace deltatrain::gdn
