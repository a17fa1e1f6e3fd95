// Memory for the model's activations and temporaries, on the model's device: chunks allocated once and
// handed out by a bump pointer. reset() rewinds without freeing, so a step that allocates what the last
// one did (the same batch size) allocates nothing new (a cudaMalloc would synchronise the device).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <vector>

#include "deltatrain/core/allocator.h"
#include "deltatrain/core/device_memory.h"
#include "deltatrain/core/tensor.h"

namespace deltatrain::model {

class Arena {
 public:
  // Chunks from `allocator` when given (a memory saver's tag), else plain device memory.
  explicit Arena(Device device, Allocator* allocator = nullptr) : device_(device), allocator_(allocator) {}
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // A contiguous tensor, 256-byte aligned, uninitialised; valid until reset() or the arena's end.
  TensorView allocate(DType dtype, std::initializer_list<std::int64_t> shape);
  void reset();
  std::size_t reserved_bytes() const;  // held on the device
  std::size_t peak_bytes() const { return peak_; }  // most in use at once since construction
  // Counts the chunks, which live as long as the arena and are only ever added: while it is unchanged, the same
  // sequence of allocations after reset() lands at the same addresses (what a recorded CUDA graph relies on).
  std::size_t generation() const { return chunks_.size(); }

 private:
  struct Chunk {
    void* data = nullptr;
    std::size_t bytes = 0;
  };
  Device device_;
  Allocator* allocator_;
  std::vector<Chunk> chunks_;
  std::size_t chunk_ = 0, offset_ = 0;  // where the next allocation goes
  std::size_t in_use_ = 0, peak_ = 0;
};

// Work recorded once from a stream and replayed with one launch (a CUDA graph): a replay runs the recorded kernels
// with the arguments they were given, addresses included, on what device memory holds at launch time.
class StreamGraph {
 public:
  StreamGraph() = default;  // empty: nothing to launch
  // Records what `work` enqueues on `stream` (it runs nothing) and instantiates it. The capture is thread-local
  // (cudaStreamCaptureModeThreadLocal): meanwhile this thread must not synchronise the host with the device or
  // allocate device memory, and other threads' work stays out of the graph. InvalidArgument naming `stream` for the
  // legacy default stream (nullptr), which cannot be captured; Failure naming the CUDA call; what `work` throws ends
  // the capture and passes through.
  StreamGraph(Device device, void* stream, const std::function<void()>& work);
  ~StreamGraph();
  StreamGraph(StreamGraph&& other) noexcept;
  StreamGraph& operator=(StreamGraph&& other) noexcept;
  StreamGraph(const StreamGraph&) = delete;
  StreamGraph& operator=(const StreamGraph&) = delete;

  explicit operator bool() const { return exec_ != nullptr; }
  void launch(void* stream) const;  // a non-empty graph, on `stream` after its queued work, not waited for

 private:
  void* exec_ = nullptr;  // the cudaGraphExec_t
};

// A CUDA stream of its own on a GPU (none on the CPU), created blocking: work on it is ordered after the legacy
// default stream's and before that stream's later work, as where no stream is named (the trainer, torch's
// default stream), while it can be captured as a StreamGraph, which the legacy stream cannot. The destructor waits
// for the stream's work.
class DeviceStream {
 public:
  explicit DeviceStream(Device device);
  ~DeviceStream();
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;

  void* get() const { return stream_; }  // the cudaStream_t; null on the CPU

 private:
  Device device_;
  void* stream_ = nullptr;
};

}  // namespace deltatrain::model
