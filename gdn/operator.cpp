// The operator's entry points: validate once, pick a backend, run.
#include "deltatrain/gdn/gdn.h"

#include "deltatrain/core/error.h"
#include "deltatrain/gdn/backend.h"
#include "deltatrain/gdn/registry.h"

namespace deltatrain::gdn {

void chunk_forward(const Inputs& inputs, const ForwardOutputs& outputs, const Options& options) {
  Problem problem = make_problem(inputs, options, Operation::chunk_forward);
  problem.has_final_state = outputs.final_state.has_value();
  check_forward_outputs(problem, outputs);
  const Backend& backend = Registry::instance().select(options.backend, problem);
  if (outputs.saved) check_saved(problem, *outputs.saved, backend.saved_bytes(problem));
  backend.forward(problem, inputs, outputs);
}

void chunk_backward(const Inputs& inputs, const BackwardInputs& grads_in, const Gradients& grads_out,
                    const Options& options) {
  Problem problem = make_problem(inputs, options, Operation::chunk_backward);
  problem.has_final_state = grads_in.dht.has_value();
  check_backward_tensors(problem, inputs, grads_in, grads_out);
  const Backend& backend = Registry::instance().select(options.backend, problem);
  if (grads_in.saved) check_saved(problem, *grads_in.saved, backend.saved_bytes(problem));
  backend.backward(problem, inputs, grads_in, grads_out);
}

void recurrent_forward(const Inputs& inputs, const ForwardOutputs& outputs, const Options& options) {
  Problem problem = make_problem(inputs, options, Operation::recurrent);
  problem.has_final_state = outputs.final_state.has_value();
  if (outputs.saved) throw InvalidArgument("saved", "only chunk_forward fills it; the recurrent step keeps nothing");
  check_forward_outputs(problem, outputs);
  Registry::instance().select(options.backend, problem).recurrent(problem, inputs, outputs);
}

std::size_t forward_saved_bytes(const Inputs& inputs, const Options& options) {
  const Problem problem = make_problem(inputs, options, Operation::chunk_forward);
  return Registry::instance().select(options.backend, problem).saved_bytes(problem);
}

std::string resolve_backend(const Inputs& inputs, const Options& options, bool backward) {
  const Problem problem = make_problem(inputs, options, backward ? Operation::chunk_backward : Operation::chunk_forward);
  return Registry::instance().select(options.backend, problem).name();
}

}  // namespace deltatrain::gdn
