// A build without CUDA: the GPU model says why it cannot run.
#include "deltatrain/core/error.h"
#include "ops.h"

namespace deltatrain::model {

std::unique_ptr<Ops> make_cuda_ops(Device device, void*, bool) {
  throw Unavailable("the model on " + device_name(device), "this build of deltatrain has no CUDA");
}

}  // namespace deltatrain::model
