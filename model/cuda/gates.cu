// The GDN gates g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), per token and value head (common.cuh's
// gates_forward_at), and their backward; dA_log and ddt_bias go through column_sums (deterministic).
#include "common.cuh"

namespace deltatrain::model::cuda {
namespace {

struct Gates {
  Matrix a, dg;  // [T, HV]: a bfloat16, dg float32
  const bf16 *a_log, *dt_bias;
  __device__ float x(Index t, Index j) const { return gate_input(a, dt_bias, t, j); }
  __device__ float decay(Index j) const { return gate_decay(a_log, j); }
  __device__ float dg_at(Index t, Index j) const { return row_of<const float>(dg, t)[j]; }
};

__global__ void gates_forward_kernel(GatesForward gates) {
  start_after_previous_grid();
  const Index index = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (index < gates.a.rows * gates.a.cols) gates_forward_at(gates, index);
}

__global__ void gates_backward_kernel(Matrix da, Matrix db, Matrix dbeta, Matrix b, Gates gates) {
  const Index H = b.cols, index = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (index >= b.rows * H) return;
  const Index t = index / H, j = index % H;
  row_of<bf16>(da, t)[j] = to_bf16(-gates.dg_at(t, j) * gates.decay(j) * softplus_grad(gates.x(t, j)));
  const float s = sigmoid(to_float(row_of<const bf16>(b, t)[j]));
  row_of<bf16>(db, t)[j] = to_bf16(row_of<const float>(dbeta, t)[j] * s * (1.f - s));
}

struct ALogGrad {  // dg/dA_log = g
  Gates gates;
  __device__ float operator()(Index t, Index j) const {
    return -gates.dg_at(t, j) * gates.decay(j) * softplus(gates.x(t, j));
  }
};

struct DtBiasGrad {  // da before its rounding to bfloat16
  Gates gates;
  __device__ float operator()(Index t, Index j) const {
    return -gates.dg_at(t, j) * gates.decay(j) * softplus_grad(gates.x(t, j));
  }
};

}  // namespace

void gdn_gates_forward(const GatesForward& gates, cudaStream_t stream) {
  const Index n = gates.a.rows * gates.a.cols;
  if (n == 0) return;
  launch_after_previous("gdn_gates_forward", gates_forward_kernel, grid_for(n, 256), 256, 0, stream, gates);
}

void gdn_gates_backward(Matrix da, Matrix db, float* da_log, float* ddt_bias, Matrix dg, Matrix dbeta, Matrix a,
                        Matrix b, const void* a_log, const void* dt_bias, Workspace& workspace,
                        cudaStream_t stream) {
  const Index n = a.rows * a.cols;
  if (n == 0) return;
  const Gates gates{a, dg, static_cast<const bf16*>(a_log), static_cast<const bf16*>(dt_bias)};
  gates_backward_kernel<<<grid_for(n, 256), 256, 0, stream>>>(da, db, dbeta, b, gates);
  check_launch("gdn_gates_backward");
  column_sums("gdn_gates_backward (dA_log)", ALogGrad{gates}, a.rows, a.cols, da_log, workspace, stream);
  column_sums("gdn_gates_backward (ddt_bias)", DtBiasGrad{gates}, a.rows, a.cols, ddt_bias, workspace, stream);
}

}  // namespace deltatrain::model::cuda
