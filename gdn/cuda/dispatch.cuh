// Host-side helpers of the kernel launchers: one template instance per (io dtype, head dim), the recording of a
// launch that raises the dynamic shared-memory limit once per device, and the fused backwards' choice of kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <string>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/tensor.h"
#include "kernel_sequence.h"
#include "params.h"

namespace deltatrain::gdn::cuda {

// What a device-dependent query answered on each device (0: not asked yet, 1: true, 2: false); a caller
// keeps one as a static.
using DeviceMemo = std::array<std::atomic<int>, 64>;

// compute() for the calling thread's device the first time it is asked there (and returns normally), the
// remembered answer afterwards; devices past the memo's size are asked every time.
template <class F>
bool once_per_device(DeviceMemo& memo, F&& compute) {
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  const bool tracked = device >= 0 && device < static_cast<int>(memo.size());
  if (tracked) {
    if (const int known = memo[device].load(std::memory_order_acquire); known != 0) return known == 1;
  }
  const bool answer = compute();
  if (tracked) memo[device].store(answer ? 1 : 2, std::memory_order_release);
  return answer;
}

// Appends kKernel<<<grid, block, smem>>>(Params) to `kernels` after kernel `after` (KernelSequence::add) and
// returns its index, or records nothing for an empty grid and returns -1; a kernel over 48 KiB of shared
// memory gets its limit raised the first time it is recorded on a device.
template <auto kKernel>
int launch(const char* name, dim3 grid, dim3 block, int smem, KernelSequence& kernels,
           int after = KernelSequence::kPrevious) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return -1;
  if (smem > 48 * 1024) {
    static DeviceMemo raised{};  // for this kernel
    once_per_device(raised, [&] {
      if (const cudaError_t status = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
          status != cudaSuccess) {
        throw Failure(std::string("cudaFuncSetAttribute(") + name + ", " + std::to_string(smem) +
                      " bytes of shared memory) failed: " + cudaGetErrorString(status));
      }
      // An SM runs CTAs of one shared-memory carveout at a time: the largest, for every such kernel, lets CTAs of
      // two launches that run side by side (a pass and its segment maps) share an SM instead of waiting for it to drain.
      if (const cudaError_t status =
              cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
          status != cudaSuccess) {
        throw Failure(std::string("cudaFuncSetAttribute(") + name + ", the largest shared-memory carveout) failed: " +
                      cudaGetErrorString(status));
      }
      return true;
    });
  }
  return kernels.add(reinterpret_cast<const void*>(kKernel), name, grid, block, smem, after);
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

// Launches the one of a fused backward's kernels that finishes dq and dk as the call's plan says (input_grads_of):
// per value head, in the CTA, or in a cluster pair (its own kernel, with the cluster's dimensions).
template <auto kPerValueHead, auto kThisCta, auto kClusterPair>
void launch_by_input_grads(const Params& p, const char* name, const char* pair_name, dim3 grid, dim3 block, int smem,
                           KernelSequence& kernels) {
  switch (input_grads_of(p)) {
    case InputGrads::per_value_head:
      launch<kPerValueHead>(name, grid, block, smem, kernels);
      break;
    case InputGrads::this_cta:
      launch<kThisCta>(name, grid, block, smem, kernels);
      break;
    case InputGrads::cluster_pair:
      launch<kClusterPair>(pair_name, grid, block, smem, kernels);
  }
}

}  // namespace deltatrain::gdn::cuda
