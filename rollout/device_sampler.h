// The GPU side of BatchSampler: the CUDA kernels of rollout/cuda/, or (a build without CUDA) a stub that says
// why there are none.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "deltatrain/core/tensor.h"
#include "deltatrain/rollout/sampling.h"

namespace deltatrain::rollout {

class DeviceSampler {
 public:
  virtual ~DeviceSampler() = default;
  virtual Device device() const = 0;
  // Queues the sampling of logits [N, V] (contiguous bfloat16 on device()) with rows [N], both checked by
  // BatchSampler, on `stream` (a cudaStream_t) after the work queued there; the N token ids also go to `tokens`
  // (int32 on the device) when it is not null. Two batches may be in flight; InvalidArgument naming "launch" for a
  // third.
  virtual void launch(const TensorView& logits, std::span<const RowSampling> rows, void* stream,
                      std::int32_t* tokens) = 0;
  // The oldest batch in flight: waits for its samples, writes them to out (room for its rows), returns its row count.
  // InvalidArgument naming "collect" when none is in flight.
  virtual std::int64_t collect(std::span<Sample> out) = 0;
};

// Unavailable naming the device when this build has no CUDA.
std::unique_ptr<DeviceSampler> make_cuda_sampler(Device device);

// A batch whose rows are all greedy without the untempered log-probability needs only each row's largest value with
// its lowest id, which does not depend on the order the values are visited in, so the GPU spreads a row over
// several blocks: this many, so that the batch's blocks fill the GPU twice over, none with fewer than
// kGreedyMinValues values (one block a row leaves most SMs idle at decode's batch sizes: bench/NOTES.md, Rollout).
constexpr std::int64_t kGreedyMinValues = 4096;
int greedy_parts(std::int64_t rows, std::int64_t vocab, int multiprocessors);

}  // namespace deltatrain::rollout
