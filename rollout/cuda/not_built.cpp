// A build without CUDA: sampling on a GPU says why it cannot run.
#include "deltatrain/core/error.h"
#include "device_sampler.h"

namespace deltatrain::rollout {

std::unique_ptr<DeviceSampler> make_cuda_sampler(Device device) {
  throw Unavailable("sampling on " + device_name(device), "this build of deltatrain has no CUDA");
}

}  // namespace deltatrain::rollout
