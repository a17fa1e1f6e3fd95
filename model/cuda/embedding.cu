// Embedding lookup and its deterministic backward.
//
// The backward sums, for each distinct token, the gradient rows of the positions holding it, in position
// order: the positions are sorted by token on the device (CUB's radix sort is stable, so equal tokens keep
// their position order), and one block per run of equal tokens adds the run's rows in order to its table
// row. No atomics and no host work: the order is fixed by the tokens alone, and the call can be captured.
// A token that fills most of the batch makes one long run (one block does it); batches of text have none.
#include <cub/device/device_radix_sort.cuh>

#include "common.cuh"

namespace deltatrain::model::cuda {
namespace {

template <bool Vectorized>
__global__ void embedding_forward_kernel(Matrix out, const std::int32_t* tokens, Matrix table) {
  start_after_previous_grid();
  const Index chunks = (out.cols + kVector - 1) / kVector;
  const Index index = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (index >= out.rows * chunks) return;
  const Index r = index / chunks, c0 = index % chunks * kVector;
  const bf16* src = row_of<bf16>(table, tokens[r]) + c0;
  bf16* dst = row_of<bf16>(out, r) + c0;
  if constexpr (Vectorized) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else {
    for (int k = 0; k < kVector && c0 + k < out.cols; ++k) dst[k] = src[k];
  }
}

__global__ void iota_kernel(std::int32_t* values, Index n) {
  const Index i = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (i < n) values[i] = static_cast<std::int32_t>(i);
}

// Block i handles the run of equal sorted tokens that starts at i (the others return at once).
__global__ void embedding_backward_kernel(Matrix dtable, const std::uint32_t* sorted_tokens,
                                          const std::int32_t* sorted_positions, Matrix dout) {
  const Index i = blockIdx.x, n = dout.rows;
  const std::uint32_t token = sorted_tokens[i];
  if (i > 0 && sorted_tokens[i - 1] == token) return;
  float* dst = row_of<float>(dtable, token);
  for (Index c = threadIdx.x; c < dout.cols; c += blockDim.x) {
    float sum = 0.f;
    for (Index j = i; j < n && sorted_tokens[j] == token; ++j)
      sum += to_float(row_of<const bf16>(dout, sorted_positions[j])[c]);
    dst[c] += sum;
  }
}

}  // namespace

void embedding_forward(Matrix out, const std::int32_t* tokens, Matrix table, cudaStream_t stream) {
  if (out.rows == 0 || out.cols == 0) return;
  constexpr int threads = 256;
  const unsigned blocks = grid_for(out.rows * ((out.cols + kVector - 1) / kVector), threads);
  const bool vectorized = vectorizable(out) && vectorizable(table);
  launch_after_previous("embedding_forward",
                        vectorized ? embedding_forward_kernel<true> : embedding_forward_kernel<false>, blocks, threads,
                        0, stream, out, tokens, table);
}

void embedding_backward(Matrix dtable, const std::int32_t* tokens, Matrix dout, Workspace& workspace,
                        cudaStream_t stream) {
  const Index n = dout.rows;
  if (n == 0 || dout.cols == 0) return;
  int bits = 1;  // the token ids' significant bits: the sort's passes
  while (bits < 31 && (Index{1} << bits) < dtable.rows) ++bits;
  // Token ids are validated non-negative, so their bits read as unsigned keep their order.
  const auto* keys = reinterpret_cast<const std::uint32_t*>(tokens);
  std::size_t sort_bytes = 0;
  cuda_check(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys, static_cast<std::uint32_t*>(nullptr),
                                                 static_cast<const std::int32_t*>(nullptr),
                                                 static_cast<std::int32_t*>(nullptr), static_cast<int>(n), 0, bits,
                                                 stream),
             "cub::DeviceRadixSort::SortPairs");
  Carver plan;
  plan.add<std::uint32_t>(n);
  plan.add<std::int32_t>(n);
  plan.add<std::int32_t>(n);
  plan.add<std::byte>(static_cast<Index>(sort_bytes));
  Carver carve(workspace.reserve(plan.bytes()));
  auto* sorted_tokens = carve.take<std::uint32_t>(n);
  auto* positions = carve.take<std::int32_t>(n);
  auto* sorted_positions = carve.take<std::int32_t>(n);
  auto* sort_scratch = carve.take<std::byte>(static_cast<Index>(sort_bytes));

  iota_kernel<<<grid_for(n, 256), 256, 0, stream>>>(positions, n);
  check_launch("embedding_backward (positions)");
  cuda_check(cub::DeviceRadixSort::SortPairs(sort_scratch, sort_bytes, keys, sorted_tokens, positions,
                                                 sorted_positions, static_cast<int>(n), 0, bits, stream),
             "cub::DeviceRadixSort::SortPairs");
  embedding_backward_kernel<<<static_cast<unsigned>(n), 128, 0, stream>>>(dtable, sorted_tokens, sorted_positions,
                                                                          dout);
  check_launch("embedding_backward");
}

}  // namespace deltatrain::model::cuda
