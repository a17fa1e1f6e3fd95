// Elementwise ops over equally shaped bfloat16 matrices, computed in float32.
#include "common.cuh"

namespace deltatrain::model::cuda {
namespace {

struct SigmoidGate {  // in: x, gate; out: x * sigmoid(gate)
  __device__ void operator()(const float (&in)[2], float (&out)[1]) const { out[0] = in[0] * sigmoid(in[1]); }
};

struct SigmoidGateBackward {  // in: dout, x, gate; out: dx, dgate
  __device__ void operator()(const float (&in)[3], float (&out)[2]) const {
    const float s = sigmoid(in[2]);
    out[0] = in[0] * s;
    out[1] = in[0] * in[1] * s * (1.f - s);
  }
};

struct Swiglu {  // in: gate, up; out: silu(gate) * up
  __device__ void operator()(const float (&in)[2], float (&out)[1]) const { out[0] = silu(in[0]) * in[1]; }
};

struct SwigluBackward {  // in: dout, gate, up; out: dgate, dup
  __device__ void operator()(const float (&in)[3], float (&out)[2]) const {
    out[0] = in[0] * in[2] * silu_grad(in[1]);
    out[1] = in[0] * silu(in[1]);
  }
};

struct Add {  // in: y, x; out: y + x
  __device__ void operator()(const float (&in)[2], float (&out)[1]) const { out[0] = in[0] + in[1]; }
};

}  // namespace

void sigmoid_gate_forward(Matrix out, Matrix x, Matrix gate, cudaStream_t stream) {
  elementwise<2, 1>("sigmoid_gate_forward", {x, gate}, {out}, SigmoidGate{}, stream);
}

void sigmoid_gate_backward(Matrix dx, Matrix dgate, Matrix dout, Matrix x, Matrix gate, cudaStream_t stream) {
  elementwise<3, 2>("sigmoid_gate_backward", {dout, x, gate}, {dx, dgate}, SigmoidGateBackward{}, stream);
}

void swiglu_forward(Matrix out, Matrix gate, Matrix up, cudaStream_t stream) {
  elementwise<2, 1>("swiglu_forward", {gate, up}, {out}, Swiglu{}, stream);
}

void swiglu_backward(Matrix dgate, Matrix dup, Matrix dout, Matrix gate, Matrix up, cudaStream_t stream) {
  elementwise<3, 2>("swiglu_backward", {dout, gate, up}, {dgate, dup}, SwigluBackward{}, stream);
}

void add(Matrix y, Matrix x, cudaStream_t stream) { elementwise<2, 1>("add", {y, x}, {y}, Add{}, stream); }

}  // namespace deltatrain::model::cuda
