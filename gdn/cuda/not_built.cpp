// Built when the project is configured without nvcc: the cuda backend still appears in the registry,
// so that `deltatrain info` and backends() say why it cannot be used.
#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"
#include "deltatrain/gdn/gdn.h"
#include "deltatrain/gdn/registry.h"

namespace deltatrain::gdn {
namespace {

class CudaNotBuilt final : public Backend {
 public:
  std::string name() const override { return "cuda"; }
  int priority() const override { return 30; }
  Availability available() const override { return Availability::no(cuda_info().unavailable_reason); }
  Availability supports(const Problem&) const override { return available(); }
  void forward(const Problem&, const Inputs&, const ForwardOutputs&) const override { fail(); }
  void backward(const Problem&, const Inputs&, const BackwardInputs&, const Gradients&) const override { fail(); }
  void recurrent(const Problem&, const Inputs&, const ForwardOutputs&) const override { fail(); }

 private:
  [[noreturn]] void fail() const { throw Unavailable("GDN backend 'cuda'", available().reason); }
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaNotBuilt>(); }

const void* cuda_scratch_address(int, void*) { return nullptr; }  // no cuda backend, no scratch

}  // namespace deltatrain::gdn
