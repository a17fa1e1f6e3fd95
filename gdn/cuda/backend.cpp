// The `cuda` GDN backend: availability with exact reasons, and each operation as a fixed sequence of
// kernel launches on the caller's stream (no host synchronisation, scratch from the cached workspace).
#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"
#include "deltatrain/gdn/registry.h"
#include "launch.h"
#include "params.h"
#include "workspace.h"

namespace deltatrain::gdn {
namespace {

using cuda::Params;
using cuda::WorkspaceLayout;

constexpr int kMinimumRuntimeMajor = 12;

// Makes `device` current for the call and restores the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ == device) {
      previous_ = -1;
    } else {
      cuda_check(cudaSetDevice(device), "cudaSetDevice");
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

std::string gpu_name(const GpuInfo& gpu) {
  return "GPU " + std::to_string(gpu.index) + " (" + gpu.name + ", compute capability " + std::to_string(gpu.cc_major) +
         "." + std::to_string(gpu.cc_minor) + ")";
}

// Per visible GPU: whether this build's kernels run there, and if not, why. Queried once.
const std::vector<Availability>& device_verdicts() {
  static const std::vector<Availability> verdicts = [] {
    std::vector<Availability> result;
    for (const GpuInfo& gpu : cuda_info().gpus) {
      if (gpu.cc_major < 8) {
        result.push_back(Availability::no(gpu_name(gpu) + " is older than the compute capability 8.0 (Ampere) the "
                                                          "cuda backend needs for its tensor-core kernels"));
        continue;
      }
      int previous = 0;
      cudaGetDevice(&previous);
      cudaSetDevice(gpu.index);
      const cudaError_t image = cuda::probe_kernel_image();
      cudaSetDevice(previous);
      cudaGetLastError();
      result.push_back(image == cudaSuccess
                           ? Availability::yes()
                           : Availability::no("this build has no kernels for " + gpu_name(gpu) +
                                              " (it was compiled for sm_80 and sm_90a: " + cudaGetErrorString(image) +
                                              ")"));
    }
    return result;
  }();
  return verdicts;
}

std::int64_t count_chunks(const Problem& p) {
  std::int64_t chunks = 0;
  for (std::size_t n = 0; n + 1 < p.offsets.size(); ++n) {
    chunks += (p.offsets[n + 1] - p.offsets[n] + cuda::kChunk - 1) / cuda::kChunk;
  }
  return chunks;
}

void expect_aligned(const char* name, const void* data) {
  if (reinterpret_cast<std::uintptr_t>(data) % 16 != 0) {
    throw Unavailable("GDN backend 'cuda'", std::string("tensor ") + name +
                                               " must start at a 16-byte aligned address for the vector loads, but "
                                               "starts at " + std::to_string(reinterpret_cast<std::uintptr_t>(data)) +
                                               "; pass a fresh contiguous copy");
  }
}

// One call's launch context: device, stream, workspace and the kernels' parameter block.
struct Call {
  DeviceGuard device;
  cudaStream_t stream;
  Params params;

  Call(const Problem& p, const Inputs& in)
      : device(p.device.index), stream(static_cast<cudaStream_t>(p.stream)) {
    expect_aligned("q", in.q.data);
    expect_aligned("k", in.k.data);
    expect_aligned("v", in.v.data);
    const bool upload = p.varlen && in.cu_seqlens->device.type == DeviceType::cpu;
    const std::int64_t chunks = count_chunks(p);
    const cuda::PassSplit split = p.op == Operation::recurrent ? cuda::PassSplit{} : cuda::state_split(p, chunks);
    const WorkspaceLayout layout = cuda::plan_workspace(p, chunks, upload, split);
    char* base = static_cast<char*>(cuda::workspace(p.device.index, stream, layout.bytes));
    auto region = [&](const WorkspaceLayout::Region& r) -> void* { return r.bytes == 0 ? nullptr : base + r.offset; };

    Params& k = params;
    k.tokens = static_cast<int>(p.tokens());
    k.T = static_cast<int>(p.T);
    k.H = static_cast<int>(p.H);
    k.HV = static_cast<int>(p.HV);
    k.K = static_cast<int>(p.K);
    k.V = static_cast<int>(p.V);
    k.group = static_cast<int>(p.group());
    k.sequences = static_cast<int>(p.N);
    k.chunks = static_cast<int>(chunks);
    k.segments = split.segments;
    k.warpgroups = split.warpgroups;
    k.paired = split.paired;
    k.scale = static_cast<float>(p.scale);
    k.l2norm = p.l2norm;
    if (upload) {
      // A CPU cu_seqlens is uploaded from the validated host offsets (a small pageable copy); pass it on
      // the GPU, with cu_seqlens_host, for graph capture.
      void* offsets = region(layout.offsets);
      cuda_check(cudaMemcpyAsync(offsets, p.offsets.data(), p.offsets.size() * sizeof(std::int64_t),
                                 cudaMemcpyHostToDevice, stream),
                 "cudaMemcpyAsync (cu_seqlens)");
      k.cu_seqlens = offsets;
      k.cu_seqlens_int64 = true;
    } else if (p.varlen) {
      k.cu_seqlens = in.cu_seqlens->data;
      k.cu_seqlens_int64 = in.cu_seqlens->dtype == DType::i64;
    }
    k.q = in.q.data;
    k.k = in.k.data;
    k.v = in.v.data;
    k.g = in.g.data;
    k.beta = in.beta.data;
    k.g_float = p.gate_dtype == DType::f32;
    k.beta_float = p.beta_dtype == DType::f32;
    k.h0 = in.initial_state ? in.initial_state->ptr<const float>() : nullptr;

    k.chunk_table = static_cast<cuda::ChunkInfo*>(region(layout.chunk_table));
    k.sequence_chunks = static_cast<int*>(region(layout.sequence_chunks));
    k.q_normed = region(layout.q_normed);
    k.k_normed = region(layout.k_normed);
    k.q_rstd = static_cast<float*>(region(layout.q_rstd));
    k.k_rstd = static_cast<float*>(region(layout.k_rstd));
    k.gamma = static_cast<float*>(region(layout.gamma));
    k.gate_in = static_cast<float*>(region(layout.gate_in));
    k.gate_out = static_cast<float*>(region(layout.gate_out));
    k.w = region(layout.w);
    k.u = region(layout.u);
    k.p = region(layout.p);
    k.t = region(layout.t);
    k.t_beta = region(layout.t_beta);
    k.states = region(layout.states);
    k.delta = region(layout.delta);
    k.dstates = region(layout.dstates);
    k.ddelta = region(layout.ddelta);
    k.dw = region(layout.dw);
    k.dq_head = static_cast<float*>(region(layout.dq_head));
    k.dk_head = static_cast<float*>(region(layout.dk_head));
    k.dgamma_part = static_cast<float*>(region(layout.dgamma_part));
    k.segment_ends = static_cast<float*>(region(layout.segment_ends));
    k.segment_maps = region(layout.segment_maps);
    k.segment_starts = static_cast<float*>(region(layout.segment_starts));
  }

  // The chunk schedule, the L2 norm and the WY/UT transform: the start of both chunked passes.
  void prepare(DType io, cuda::KernelSequence& kernels) const {
    cuda::launch_start(params, io, kernels);
    cuda::launch_prepare(params, io, kernels);
  }
};

class CudaBackend final : public Backend {
 public:
  std::string name() const override { return "cuda"; }
  int priority() const override { return 30; }

  Availability available() const override {
    const CudaInfo& info = cuda_info();
    if (!info.usable()) return Availability::no(info.unavailable_reason);
    if (!info.runtime || info.runtime->major < kMinimumRuntimeMajor) {
      return Availability::no("the CUDA runtime " + (info.runtime ? info.runtime->str() : std::string("(unknown)")) +
                              " is older than the " + std::to_string(kMinimumRuntimeMajor) + ".0 this backend needs");
    }
    std::string reasons;
    for (const Availability& verdict : device_verdicts()) {
      if (verdict.ok) return verdict;
      reasons += (reasons.empty() ? "" : "; ") + verdict.reason;
    }
    return Availability::no(reasons.empty() ? "no CUDA GPU is visible" : reasons);
  }

  Availability supports(const Problem& p) const override {
    if (p.device.type != DeviceType::cuda) {
      return Availability::no("the tensors are on the CPU; the cuda backend needs them on an NVIDIA GPU");
    }
    const auto& verdicts = device_verdicts();
    if (p.device.index < 0 || p.device.index >= static_cast<int>(verdicts.size())) {
      return Availability::no("GPU " + std::to_string(p.device.index) + " is not visible to the CUDA runtime");
    }
    if (!verdicts[p.device.index].ok) return verdicts[p.device.index];
    if (p.io_dtype != DType::bf16 && p.io_dtype != DType::f16 && p.io_dtype != DType::f32) {
      return Availability::no(std::string("inputs of dtype ") + dtype_name(p.io_dtype) +
                              " are not supported (bfloat16, float16 or float32; float64 runs on the reference backend)");
    }
    if (p.K != 64 && p.K != 128 && p.K != 256) {
      return Availability::no("head dim K = " + std::to_string(p.K) + " is not supported (kernels exist for 64, 128, 256)");
    }
    if (p.V % 64 != 0) {
      return Availability::no("head dim V = " + std::to_string(p.V) + " is not supported (it must be a multiple of 64)");
    }
    if (!cuda::have_kernels(p.io_dtype, static_cast<int>(p.K))) {
      return Availability::no("float32 inputs with head dim K = " + std::to_string(p.K) +
                              " need more shared memory than an SM has (float32 supports K <= 128; bfloat16 and "
                              "float16 support K = 256)");
    }
    if (p.tokens() >= (std::int64_t{1} << 31)) {
      return Availability::no("B * T = " + std::to_string(p.tokens()) + " tokens exceed the 2^31 - 1 this backend indexes");
    }
    return Availability::yes();
  }

  std::vector<std::pair<std::string, std::string>> details() const override {
    std::vector<std::pair<std::string, std::string>> facts;
    const CudaInfo& info = cuda_info();
    if (info.runtime) facts.emplace_back("CUDA runtime", info.runtime->str());
    if (info.driver) facts.emplace_back("CUDA driver", info.driver->str());
    facts.emplace_back("kernels", "sm_80 (mma.sync), sm_90a");
    for (const GpuInfo& gpu : info.gpus) facts.emplace_back("GPU " + std::to_string(gpu.index), gpu_name(gpu));
    return facts;
  }

  void forward(const Problem& p, const Inputs& in, const ForwardOutputs& out) const override {
    Call call(p, in);
    expect_aligned("o", out.o.data);
    call.params.o = out.o.data;
    call.params.ht = out.final_state ? out.final_state->ptr<float>() : nullptr;
    cuda::KernelSequence kernels;
    call.prepare(p.io_dtype, kernels);
    cuda::launch_state_forward(call.params, p.io_dtype, false, kernels);
    kernels.run(call.params, call.stream);
  }

  void backward(const Problem& p, const Inputs& in, const BackwardInputs& grads_in,
                const Gradients& grads_out) const override {
    Call call(p, in);
    expect_aligned("do", grads_in.d_o.data);
    Params& k = call.params;
    k.d_o = grads_in.d_o.data;
    k.dht = grads_in.dht ? grads_in.dht->ptr<const float>() : nullptr;
    k.dq = grads_out.dq.data;
    k.dk = grads_out.dk.data;
    k.dv = grads_out.dv.data;
    k.dg = grads_out.dg.data;
    k.dbeta = grads_out.dbeta.data;
    k.dh0 = grads_out.dh0 ? grads_out.dh0->ptr<float>() : nullptr;
    cuda::KernelSequence kernels;
    call.prepare(p.io_dtype, kernels);
    cuda::launch_backward_state_passes(k, p.io_dtype, kernels);
    cuda::launch_chunk_grad(k, p.io_dtype, kernels);
    cuda::launch_wy_grad(k, p.io_dtype, kernels);
    cuda::launch_q_grad(k, p.io_dtype, kernels);
    kernels.run(k, call.stream);
  }

  void recurrent(const Problem& p, const Inputs& in, const ForwardOutputs& out) const override {
    Call call(p, in);
    call.params.o = out.o.data;
    call.params.ht = out.final_state ? out.final_state->ptr<float>() : nullptr;
    cuda::KernelSequence kernels;
    cuda::launch_recurrent(call.params, p.io_dtype, kernels);
    kernels.run(call.params, call.stream);
  }
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(); }

}  // namespace deltatrain::gdn
