#include "kernel_sequence.h"

#include <map>
#include <mutex>
#include <string>
#include <tuple>

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

void KernelSequence::add(const void* function, const char* name, dim3 grid, dim3 block, int smem) {
  if (count_ == kMaxKernels) throw Failure("a GDN operation recorded more than " + std::to_string(kMaxKernels) + " kernels");
  kernels_[count_++] = Kernel{function, name, grid, block, smem};
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
  static auto* cache = new std::map<std::tuple<int, cudaStream_t, std::array<const void*, kMaxKernels>>, CachedGraph>;
  std::array<const void*, kMaxKernels> functions{};
  for (int i = 0; i < count_; ++i) functions[i] = kernels_[i].function;
  std::lock_guard<std::mutex> lock(*mutex);
  CachedGraph& cached = (*cache)[{device, stream, functions}];
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
      const cudaGraphNode_t* previous = i == 0 ? nullptr : &cached.nodes[i - 1];
      cuda_check(cudaGraphAddKernelNode(&cached.nodes[i], cached.graph, previous, i == 0 ? 0 : 1, &params),
                 (std::string("cudaGraphAddKernelNode (") + k.name + ")").c_str());
    }
    cuda_check(cudaGraphInstantiate(&cached.exec, cached.graph, 0), "cudaGraphInstantiate (GDN kernels)");
  }
  cuda_check(cudaGraphLaunch(cached.exec, stream), "cudaGraphLaunch (GDN kernels)");
}

}  // namespace deltatrain::gdn::cuda
