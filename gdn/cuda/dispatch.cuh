// Host-side helpers of the kernel launchers: one template instance per (io dtype, head dim), the recording
// of a launch that raises the dynamic shared-memory limit once per device, and the current device's size.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <string>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"
#include "deltatrain/core/tensor.h"
#include "kernel_sequence.h"
#include "params.h"

namespace deltatrain::gdn::cuda {

// The calling thread's device's SM count (queried once at start-up, see cuda_info), which sizes grids.
inline int current_multiprocessors() {
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  for (const GpuInfo& gpu : cuda_info().gpus) {
    if (gpu.index == device) return gpu.multiprocessors;
  }
  return 0;
}

// Appends kKernel<<<grid, block, smem>>>(Params) to `kernels`; a kernel over 48 KiB of shared memory gets
// its limit raised the first time it is recorded on a device.
template <auto kKernel>
void launch(const char* name, dim3 grid, dim3 block, int smem, KernelSequence& kernels) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  if (smem > 48 * 1024) {
    static std::array<std::atomic<bool>, 64> raised{};  // per device, for this kernel
    int device = 0;
    cudaGetDevice(&device);
    const bool tracked = device >= 0 && device < static_cast<int>(raised.size());
    if (!tracked || !raised[device].load(std::memory_order_acquire)) {
      if (const cudaError_t status = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
          status != cudaSuccess) {
        throw Failure(std::string("cudaFuncSetAttribute(") + name + ", " + std::to_string(smem) +
                      " bytes of shared memory) failed: " + cudaGetErrorString(status));
      }
      if (tracked) raised[device].store(true, std::memory_order_release);
    }
  }
  kernels.add(reinterpret_cast<const void*>(kKernel), name, grid, block, smem);
}

// Calls f.template operator()<E, K>() for the io dtype and head dim of the call.
template <class F>
void dispatch(DType io, int K, F&& f) {
  auto by_dim = [&]<class E>() {
    switch (K) {
      case 64:
        f.template operator()<E, 64>();
        return;
      case 128:
        f.template operator()<E, 128>();
        return;
      case 256:
        if constexpr (sizeof(E) == 2) f.template operator()<E, 256>();
        return;
      default:
        return;
    }
  };
  switch (io) {
    case DType::bf16:
      by_dim.template operator()<__nv_bfloat16>();
      return;
    case DType::f16:
      by_dim.template operator()<__half>();
      return;
    case DType::f32:
      by_dim.template operator()<float>();
      return;
    default:
      return;
  }
}

}  // namespace deltatrain::gdn::cuda
