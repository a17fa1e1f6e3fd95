#include "arena.h"

#include <algorithm>
#include <string>
#include <utility>

#include "deltatrain/core/error.h"
#ifdef DELTATRAIN_WITH_CUDA
#include "deltatrain/core/cuda_check.h"
#endif

namespace deltatrain::model {
namespace {

constexpr std::size_t kAlignment = 256;        // cuBLASLt and vectorised kernels want aligned operands
// The smallest chunk: on a GPU large, so that a step makes few device allocations (a cudaMalloc synchronises
// the device); on the CPU small, so that a small model (tests, the CPU demos) does not hold 64 MiB per arena.
std::size_t min_chunk(Device device) { return device.type == DeviceType::cpu ? std::size_t{4} << 20 : std::size_t{64} << 20; }

std::size_t round_up(std::size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

}  // namespace

Arena::~Arena() {
  for (const Chunk& c : chunks_) {
    if (allocator_ != nullptr) {
      allocator_->deallocate(c.data);
    } else {
      device_free(c.data, device_);
    }
  }
}

TensorView Arena::allocate(DType dtype, std::initializer_list<std::int64_t> shape) {
  std::int64_t numel = 1;
  for (const std::int64_t extent : shape) numel *= extent;
  const std::size_t bytes = round_up(std::max<std::size_t>(1, static_cast<std::size_t>(numel) * dtype_size(dtype)));
  while (chunk_ < chunks_.size() && offset_ + bytes > chunks_[chunk_].bytes) {
    ++chunk_;
    offset_ = 0;
  }
  if (chunk_ == chunks_.size()) {
    const std::size_t last = chunks_.empty() ? 0 : chunks_.back().bytes;
    const std::size_t size = std::max({bytes, min_chunk(device_), 2 * last});
    void* data = allocator_ != nullptr ? allocator_->allocate(size, "model activations") : device_allocate(size, device_, "model activations");
    chunks_.push_back({data, size});
    offset_ = 0;
  }
  void* data = static_cast<std::byte*>(chunks_[chunk_].data) + offset_;
  offset_ += bytes;
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
  return TensorView::contiguous(data, dtype, shape, device_);
}

void Arena::reset() {
  chunk_ = 0;
  offset_ = 0;
  in_use_ = 0;
}

std::size_t Arena::reserved_bytes() const {
  std::size_t total = 0;
  for (const Chunk& c : chunks_) total += c.bytes;
  return total;
}

StreamGraph::StreamGraph(Device device, void* stream, const std::function<void()>& work) {
  if (stream == nullptr) throw InvalidArgument("stream", "is the legacy default stream, which CUDA cannot capture");
#ifdef DELTATRAIN_WITH_CUDA
  const CudaDeviceGuard guard(device.index);
  const auto s = static_cast<cudaStream_t>(stream);
  cuda_check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  cudaGraph_t graph = nullptr;
  try {
    work();
  } catch (...) {
    // The capture must end before the stream can run anything again; what it recorded is dropped.
    if (cudaStreamEndCapture(s, &graph) == cudaSuccess && graph != nullptr) cudaGraphDestroy(graph);
    throw;
  }
  cuda_check(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);  // the executable graph holds what it needs
  cuda_check(status, "cudaGraphInstantiate");
  exec_ = exec;
#else
  (void)work;
  throw Unavailable("a CUDA graph on " + device_name(device), "this build has no CUDA");
#endif
}

StreamGraph::~StreamGraph() {
#ifdef DELTATRAIN_WITH_CUDA
  // A launch still queued keeps its own reference: destroying the executable graph does not wait for it.
  if (exec_ != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
#endif
}

StreamGraph::StreamGraph(StreamGraph&& other) noexcept : exec_(std::exchange(other.exec_, nullptr)) {}

StreamGraph& StreamGraph::operator=(StreamGraph&& other) noexcept {
  if (this != &other) {
    StreamGraph old(std::move(*this));
    exec_ = std::exchange(other.exec_, nullptr);
  }
  return *this;
}

void StreamGraph::launch(void* stream) const {
#ifdef DELTATRAIN_WITH_CUDA
  cuda_check(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), static_cast<cudaStream_t>(stream)),
             "cudaGraphLaunch");
#else
  (void)stream;
#endif
}

DeviceStream::DeviceStream(Device device) : device_(device) {
  if (device.type == DeviceType::cpu) return;
#ifdef DELTATRAIN_WITH_CUDA
  const CudaDeviceGuard guard(device.index);
  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
  stream_ = stream;
#else
  throw Unavailable("a stream on " + device_name(device), "this build has no CUDA");
#endif
}

DeviceStream::~DeviceStream() {
#ifdef DELTATRAIN_WITH_CUDA
  if (stream_ == nullptr) return;
  const CudaDeviceGuard guard(device_.index);
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));  // a destructor reports nothing: best effort
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
#endif
}

}  // namespace deltatrain::model
