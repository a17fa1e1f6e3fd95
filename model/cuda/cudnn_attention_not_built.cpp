// CudnnAttention in a build without cuDNN or its frontend (cmake/Dependencies.cmake says which was missing):
// plan_attention never picks it, and constructing it says why it is absent.
#include "cudnn_attention.h"

#include "deltatrain/core/error.h"

namespace deltatrain::model::cuda {

struct CudnnAttention::Graphs {};

bool CudnnAttention::built() { return false; }

CudnnAttention::CudnnAttention(AttentionBackward) {
  throw Unavailable("cuDNN's fused attention", "this build has no cuDNN (it is configured without cudnn.h, the cuDNN "
                                               "library or cudnn-frontend's headers)");
}

CudnnAttention::~CudnnAttention() = default;

void CudnnAttention::forward(Workspace&, Matrix, Matrix, Matrix, Matrix, Matrix, AttentionShape,
                             std::span<const std::int32_t>, Sequences, cudaStream_t) {}

void CudnnAttention::backward(Workspace&, Matrix, Matrix, Matrix, Matrix, Matrix, Matrix, Matrix, Matrix, Matrix,
                              AttentionShape, std::span<const std::int32_t>, Sequences, cudaStream_t) {}

}  // namespace deltatrain::model::cuda
