// The copies that let calls of any head dim up to 256 run the kernels compiled for K = 64, 128, 256 and V a
// multiple of 64 (kernel_key_dim in launch.h): inputs zero-padded into the workspace, outputs cropped back.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "deltatrain/core/error.h"
#include "launch.h"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kCopyWarps = kCopyThreads / 32;

// One warp per row of dst: src's element where both have one, else 0.
template <class Word>
__global__ void __launch_bounds__(kCopyThreads) copy_padded_kernel(const Word* src, Word* dst, MatrixBatch from,
                                                                    MatrixBatch to) {
  const std::int64_t rows = from.rows < to.rows ? from.rows : to.rows;
  const std::int64_t cols = from.cols < to.cols ? from.cols : to.cols;
  const std::int64_t dst_rows = to.blocks * to.rows;
  const int lane = threadIdx.x % 32;
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kCopyWarps + threadIdx.x / 32; row < dst_rows;
       row += static_cast<std::int64_t>(gridDim.x) * kCopyWarps) {
    const std::int64_t block = row / to.rows, r = row % to.rows;
    const Word* in = src + (block * from.rows + r) * from.cols;
    Word* out = dst + row * to.cols;
    for (std::int64_t c = lane; c < to.cols; c += 32) out[c] = r < rows && c < cols ? in[c] : Word(0);
  }
}

}  // namespace

void copy_padded(const void* src, MatrixBatch from, void* dst, MatrixBatch to, std::size_t element_bytes,
                 cudaStream_t stream) {
  const std::int64_t dst_rows = to.blocks * to.rows;
  if (dst_rows == 0 || to.cols == 0) return;
  // Enough CTAs to fill any GPU several times over; each warp then strides through the rest.
  const auto grid = static_cast<unsigned>(std::min<std::int64_t>((dst_rows + kCopyWarps - 1) / kCopyWarps, 1 << 16));
  if (element_bytes == 2) {
    copy_padded_kernel<<<grid, kCopyThreads, 0, stream>>>(static_cast<const std::uint16_t*>(src),
                                                          static_cast<std::uint16_t*>(dst), from, to);
  } else {
    copy_padded_kernel<<<grid, kCopyThreads, 0, stream>>>(static_cast<const std::uint32_t*>(src),
                                                          static_cast<std::uint32_t*>(dst), from, to);
  }
  if (const cudaError_t status = cudaGetLastError(); status != cudaSuccess) {
    throw Failure(std::string("CUDA launch of gdn copy_padded_kernel failed: ") + cudaGetErrorString(status) + " (" +
                  cudaGetErrorName(status) + ")");
  }
}

}  // namespace deltatrain::gdn::cuda
