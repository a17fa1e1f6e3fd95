#include "kernel_sequence.h"

#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"

namespace deltatrain::gdn::cuda {
namespace {

// An instantiated chain of kernel nodes; nodes are updated in place before each launch.
struct CachedGraph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::array<cudaGraphNode_t, KernelSequence::kMaxKernels> nodes{};
};
static_assert(KernelSequence::kMaxKernels <= 32, "a kernel's dependencies are a 32-bit mask");

cudaKernelNodeParams node_params(const void* function, dim3 grid, dim3 block, int smem, void** args) {
  cudaKernelNodeParams params{};
  params.func = const_cast<void*>(function);
  params.gridDim = grid;
  params.blockDim = block;
  params.sharedMemBytes = static_cast<unsigned>(smem);
  params.kernelParams = args;
  return params;
}

}  // namespace

int KernelSequence::add(const void* function, const char* name, dim3 grid, dim3 block, int smem, int after) {
  if (count_ == kMaxKernels) throw Failure("a GDN operation recorded more than " + std::to_string(kMaxKernels) + " kernels");
  if (after == kPrevious) after = count_ - 1;
  if (after < -1 || after >= count_) throw Failure(std::string("GDN kernel ") + name + " set to run after a kernel not yet recorded");
  kernels_[count_] = Kernel{function, name, grid, block, smem, after < 0 ? 0u : 1u << after};
  return count_++;
}

void KernelSequence::join(int kernel, int earlier) {
  if (kernel < 0 || kernel >= count_ || earlier < 0 || earlier >= kernel) {
    throw Failure("a GDN kernel may only wait for one recorded before it");
  }
  kernels_[kernel].after |= 1u << earlier;
}

void KernelSequence::run(const Params& p, cudaStream_t stream) const {
  if (count_ == 0) return;
  Params copy = p;
  void* args[] = {&copy};
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  if (count_ == 1 || capture != cudaStreamCaptureStatusNone) {
    for (int i = 0; i < count_; ++i) {
      const Kernel& k = kernels_[i];
      if (const cudaError_t status = cudaLaunchKernel(k.function, k.grid, k.block, args, k.smem, stream);
          status != cudaSuccess) {
        throw Failure(std::string("CUDA launch of ") + k.name + " failed: " + cudaGetErrorString(status) + " (" +
                      cudaGetErrorName(status) + ")");
      }
    }
    return;
  }

  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  // Never destroyed: freeing at exit would race the CUDA runtime's own teardown.
  static auto* mutex = new std::mutex;
  using Shape = std::array<std::pair<const void*, std::uint32_t>, kMaxKernels>;  // kernels and their dependencies
  static auto* cache = new std::map<std::tuple<int, cudaStream_t, Shape>, CachedGraph>;
  Shape shape{};
  for (int i = 0; i < count_; ++i) shape[i] = {kernels_[i].function, kernels_[i].after};
  std::lock_guard<std::mutex> lock(*mutex);
  CachedGraph& cached = (*cache)[{device, stream, shape}];
  bool updated = cached.exec != nullptr;
  for (int i = 0; updated && i < count_; ++i) {
    const Kernel& k = kernels_[i];
    const cudaKernelNodeParams params = node_params(k.function, k.grid, k.block, k.smem, args);
    updated = cudaGraphExecKernelNodeSetParams(cached.exec, cached.nodes[i], &params) == cudaSuccess;
  }
  if (!updated) {
    cudaGetLastError();  // a refused update is answered by rebuilding, not reported
    if (cached.exec != nullptr) cuda_check(cudaGraphExecDestroy(cached.exec), "cudaGraphExecDestroy");
    if (cached.graph != nullptr) cuda_check(cudaGraphDestroy(cached.graph), "cudaGraphDestroy");
    cached = CachedGraph{};
    cuda_check(cudaGraphCreate(&cached.graph, 0), "cudaGraphCreate");
    for (int i = 0; i < count_; ++i) {
      const Kernel& k = kernels_[i];
      const cudaKernelNodeParams params = node_params(k.function, k.grid, k.block, k.smem, args);
      std::array<cudaGraphNode_t, kMaxKernels> dependencies{};
      std::size_t count = 0;
      for (int j = 0; j < i; ++j) {
        if (k.after & (1u << j)) dependencies[count++] = cached.nodes[j];
      }
      cuda_check(cudaGraphAddKernelNode(&cached.nodes[i], cached.graph, dependencies.data(), count, &params),
                 (std::string("cudaGraphAddKernelNode (") + k.name + ")").c_str());
    }
    cuda_check(cudaGraphInstantiate(&cached.exec, cached.graph, 0), "cudaGraphInstantiate (GDN kernels)");
  }
  cuda_check(cudaGraphLaunch(cached.exec, stream), "cudaGraphLaunch (GDN kernels)");
}

}  // namespace deltatrain::gdn::cuda
