#include "workspace.h"

#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"
#include "deltatrain/gdn/gdn.h"

namespace deltatrain::gdn::cuda {
namespace {

struct Buffer {
  void* data = nullptr;
  std::size_t bytes = 0;
};

}  // namespace

void* workspace(int device, cudaStream_t stream, std::size_t bytes) {
  // Never destroyed: freeing at exit would race the CUDA runtime's own teardown.
  static auto* mutex = new std::mutex;
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, Buffer>;
  std::lock_guard<std::mutex> lock(*mutex);
  Buffer& buffer = (*buffers)[{device, stream}];
  if (buffer.bytes >= bytes) return buffer.data;

  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) {
    throw StateError("the GDN cuda backend needs " + std::to_string(bytes) +
                     " bytes of workspace on this stream but holds " + std::to_string(buffer.bytes) +
                     ", and the stream is being captured; run the same call once before capturing it");
  }
  // Stream-ordered: the old buffer is released after the work already queued on this stream.
  if (buffer.data != nullptr) cuda_check(cudaFreeAsync(buffer.data, stream), "cudaFreeAsync (GDN workspace)");
  buffer = {};
  const std::size_t grown = bytes + bytes / 4;
  cuda_check(cudaMallocAsync(&buffer.data, grown, stream), "cudaMallocAsync (GDN workspace)");
  buffer.bytes = grown;
  return buffer.data;
}

}  // namespace deltatrain::gdn::cuda

namespace deltatrain::gdn {

const void* cuda_scratch_address(int device, void* stream) {
  return cuda::workspace(device, static_cast<cudaStream_t>(stream), 0);
}

}  // namespace deltatrain::gdn
