// The `cuda` GDN backend: availability with exact reasons, and each operation as a fixed sequence of
// kernel launches on the caller's stream (no host synchronisation, scratch from the cached workspace).
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"
#include "deltatrain/gdn/registry.h"
#include "launch.h"
#include "layout.h"
#include "params.h"
#include "plan.h"
#include "workspace.h"

namespace deltatrain::gdn {
namespace {

using cuda::Params;
using cuda::Region;
using cuda::WorkspaceLayout;

constexpr int kMinimumRuntimeMajor = 12;

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

// The calling thread's device's SM count (queried once at start-up, see cuda_info).
int current_multiprocessors() {
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  for (const GpuInfo& gpu : cuda_info().gpus) {
    if (gpu.index == device) return gpu.multiprocessors;
  }
  return 0;
}

// The plan of `kernel`'s operation `op` from its shape (in the kernels' head dims) and the calling thread's device.
cuda::ExecutionPlan execution_plan(const Problem& kernel, Operation op, std::int64_t chunks) {
  if (op == Operation::recurrent) return {};
  static const char* const wgmma_setting = std::getenv("DELTATRAIN_CUDA_WGMMA");  // read once
  static const char* const fused_setting = std::getenv("DELTATRAIN_CUDA_FUSED_BACKWARD");
  static const char* const role_split_setting = std::getenv("DELTATRAIN_CUDA_ROLE_SPLIT_BACKWARD");
  cuda::PlanInputs in;
  in.op = op;
  in.io = kernel.io_dtype;
  in.sequences = kernel.N;
  in.value_heads = kernel.HV;
  in.group = kernel.group();
  in.K = kernel.K;
  in.V = kernel.V;
  in.chunks = chunks;
  in.multiprocessors = current_multiprocessors();
  in.wgmma_allowed = switch_setting("DELTATRAIN_CUDA_WGMMA", wgmma_setting);
  in.wgmma_device = in.wgmma_allowed && cuda::wgmma_device_ready();
  in.fused_backward_setting = optional_switch_setting("DELTATRAIN_CUDA_FUSED_BACKWARD", fused_setting);
  in.role_split_requested =
      optional_switch_setting("DELTATRAIN_CUDA_ROLE_SPLIT_BACKWARD", role_split_setting).value_or(false);
  return cuda::plan_execution(in);
}

// The call in the head dims the kernels are compiled for, where its own are others (none otherwise).
std::optional<Problem> padded_problem(const Problem& p) {
  const std::int64_t K = cuda::kernel_key_dim(p.K), V = cuda::kernel_value_dim(p.V);
  if (K == p.K && V == p.V) return std::nullopt;
  Problem padded = p;
  padded.K = K;
  padded.V = V;
  return padded;
}

// Where a call's chunk_forward and chunk_backward keep what the backward's prepare writes, in the caller's saved
// buffer (ForwardOutputs::saved), from the call's two plans on the calling thread's device.
cuda::SavedLayout saved_layout(const Problem& kernel, std::int64_t chunks) {
  return cuda::plan_saved(kernel, chunks, execution_plan(kernel, Operation::chunk_forward, chunks),
                          execution_plan(kernel, Operation::chunk_backward, chunks));
}

// One call's launch context: device, stream, workspace and the kernels' parameter block, in the kernels' head
// dims: a call of other head dims has its inputs padded into the workspace here, and crop() copies its
// outputs back.
struct Call {
  CudaDeviceGuard device;
  cudaStream_t stream;
  std::optional<Problem> padded_copy;  // padded_problem
  const Problem& kernel;               // the call as the kernels run it: the caller's, or padded_copy
  bool padded;
  WorkspaceLayout layout;
  char* base = nullptr;
  cuda::SavedLayout saved;     // empty without a saved buffer
  char* saved_base = nullptr;  // the caller's saved buffer
  Params params;

  void* region(const Region& r) const { return r.bytes == 0 ? nullptr : base + r.offset; }
  // A region the saved buffer holds, else the workspace's.
  void* region(const Region& r, const Region& kept) const {
    return kept.bytes == 0 ? region(r) : saved_base + kept.offset;
  }

  // The caller's [tokens, heads, width] tensor as rows, at the call's width and at the kernels'.
  static cuda::MatrixBatch rows(const Problem& p, std::int64_t heads, std::int64_t width) {
    return {1, p.tokens() * heads, width};
  }
  // A [N, HV, K, V] state, or a pool [S, HV, K, V] with state_indices.
  static cuda::MatrixBatch states(const Problem& p) { return {p.state_rows * p.HV, p.K, p.V}; }

  // `data` as the kernels read it: the caller's tensor, or its copy padded into `copy`.
  const void* input(const void* data, const cuda::MatrixBatch& from, const cuda::MatrixBatch& to,
                    std::size_t element_bytes, const Region& copy) const {
    if (!padded) return data;
    void* padded_copy = region(copy);
    cuda::copy_padded(data, from, padded_copy, to, element_bytes, stream);
    return padded_copy;
  }
  // Where the kernels write an output: the caller's tensor, or the region it is cropped from.
  void* output(void* data, const Region& copy) const { return padded ? region(copy) : data; }
  // The kernels read rows of q, k, v, o and do as 16-byte vectors; the padded copies are aligned.
  void expect_vector_rows(const char* name, const void* data) const {
    if (!padded) expect_aligned(name, data);
  }
  // Copies an output the kernels wrote into `copy` to the caller's tensor, cropped (after kernels.run).
  void crop(const void* written, const cuda::MatrixBatch& from, void* data, const cuda::MatrixBatch& to,
            std::size_t element_bytes) const {
    if (padded) cuda::copy_padded(written, from, data, to, element_bytes, stream);
  }

  // saved: the caller's saved buffer (checked against saved_bytes), or none.
  Call(const Problem& p, const Inputs& in, const std::optional<TensorView>& saved_buffer = std::nullopt)
      : device(p.device.index), stream(static_cast<cudaStream_t>(p.stream)), padded_copy(padded_problem(p)),
        kernel(padded_copy ? *padded_copy : p), padded(padded_copy.has_value()) {
    const bool upload = p.varlen && in.cu_seqlens->device.type == DeviceType::cpu;
    const std::int64_t chunks = count_chunks(p);
    const cuda::ExecutionPlan plan = execution_plan(kernel, p.op, chunks);
    if (saved_buffer && saved_buffer->numel() > 0) {
      saved = saved_layout(kernel, chunks);
      saved_base = static_cast<char*>(saved_buffer->data);
    }
    layout = cuda::plan_workspace(kernel, padded, chunks, upload, plan, saved);
    base = static_cast<char*>(cuda::workspace(p.device.index, stream, layout.bytes));

    Params& k = params;
    k.tokens = static_cast<int>(p.tokens());
    k.T = static_cast<int>(p.T);
    k.H = static_cast<int>(p.H);
    k.HV = static_cast<int>(p.HV);
    k.K = static_cast<int>(kernel.K);
    k.V = static_cast<int>(kernel.V);
    k.group = static_cast<int>(p.group());
    k.sequences = static_cast<int>(p.N);
    k.chunks = static_cast<int>(chunks);
    k.wgmma = plan.wgmma;
    k.segments = plan.segments;
    k.warpgroups = plan.warpgroups;
    k.paired = plan.paired;
    k.maps_apart = plan.maps_apart;
    k.warp_pairs = plan.warp_pairs;
    k.fused_backward = plan.fused_backward;
    k.fused_input_grads = plan.fused_input_grads;
    k.role_split = plan.role_split;
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
    expect_vector_rows("q", in.q.data);
    expect_vector_rows("k", in.k.data);
    expect_vector_rows("v", in.v.data);
    const std::size_t io = dtype_size(p.io_dtype);
    const WorkspaceLayout::Padded& copy = layout.padded;
    k.q = input(in.q.data, rows(p, p.H, p.K), rows(kernel, p.H, kernel.K), io, copy.q);
    k.k = input(in.k.data, rows(p, p.H, p.K), rows(kernel, p.H, kernel.K), io, copy.k);
    k.v = input(in.v.data, rows(p, p.HV, p.V), rows(kernel, p.HV, kernel.V), io, copy.v);
    k.g = in.g.data;
    k.beta = in.beta.data;
    k.g_float = p.gate_dtype == DType::f32;
    k.beta_float = p.beta_dtype == DType::f32;
    if (in.initial_state) {
      k.h0 = static_cast<const float*>(
          input(in.initial_state->data, states(p), states(kernel), sizeof(float), copy.h0));
    }
    if (in.state_indices) k.state_indices = in.state_indices->ptr<const int>();

    // With a saved buffer the forward's start_kernel and prepare write these there, and the backward reads them from
    // it.
    k.chunk_table = static_cast<cuda::ChunkInfo*>(region(layout.chunk_table, saved.chunk_table));
    k.sequence_chunks = static_cast<int*>(region(layout.sequence_chunks, saved.sequence_chunks));
    k.q_normed = region(layout.q_normed, saved.q_normed);
    k.k_normed = region(layout.k_normed, saved.k_normed);
    k.q_rstd = static_cast<float*>(region(layout.q_rstd, saved.q_rstd));
    k.k_rstd = static_cast<float*>(region(layout.k_rstd, saved.k_rstd));
    k.gamma = static_cast<float2*>(region(layout.gamma, saved.gamma));
    k.gate_in = static_cast<float*>(region(layout.gate_in, saved.gate_in));
    k.gate_out = static_cast<float*>(region(layout.gate_out, saved.gate_out));
    k.w = region(layout.w, saved.w);
    k.u = region(layout.u, saved.u);
    k.p = region(layout.p, saved.p);
    k.t = region(layout.t, saved.t);
    k.beta_by_head = static_cast<float*>(region(layout.beta_by_head, saved.beta_by_head));
    k.states = region(layout.states);
    k.delta = region(layout.delta);
    k.dstates = region(layout.dstates);
    k.ddelta = region(layout.ddelta);
    k.dw = region(layout.dw);
    k.dq_head = static_cast<float*>(region(layout.dq_head));
    k.dk_head = static_cast<float*>(region(layout.dk_head));
    k.dgamma_part = static_cast<float*>(region(layout.dgamma_part));
    // The forward-direction passes' segment ends and starts: the saved buffer's where the call keeps them (the
    // forward writes them, the backward's recompute reads them); the reverse passes' always the workspace's.
    k.segment_ends[0] = static_cast<float*>(region(layout.segment_ends, saved.segment_ends));
    k.segment_starts[0] = static_cast<float*>(region(layout.segment_starts, saved.segment_starts));
    k.segment_ends[1] = static_cast<float*>(region(layout.segment_ends));
    k.segment_starts[1] = static_cast<float*>(region(layout.segment_starts));
    k.recompute_starts_saved = p.op == Operation::chunk_backward && saved.segment_ends.bytes > 0;
    k.segment_maps = region(layout.segment_maps);
    k.chunk_log_norms = static_cast<float*>(region(layout.chunk_log_norms, saved.chunk_log_norms));
  }

  // The outputs of a forward or recurrent step: o and the final state.
  void forward_outputs(const Problem& p, const ForwardOutputs& out) {
    params.o = output(out.o.data, layout.padded.o);
    if (!out.final_state) return;
    params.ht = static_cast<float*>(output(out.final_state->data, layout.padded.ht));
    // The crop copies the whole pool back: its rows that no sequence writes must hold what the caller's did.
    if (padded && !p.state_indices.empty()) {
      cuda::copy_padded(out.final_state->data, states(p), params.ht, states(kernel), sizeof(float), stream);
    }
  }
  void crop_forward_outputs(const Problem& p, const ForwardOutputs& out) const {
    crop(params.o, rows(kernel, p.HV, kernel.V), out.o.data, rows(p, p.HV, p.V), dtype_size(p.io_dtype));
    if (out.final_state) crop(params.ht, states(kernel), out.final_state->data, states(p), sizeof(float));
  }

  // The chunk schedule, the L2 norm and the WY/UT transform: the start of both chunked passes. A backward with a
  // saved buffer reads all three from it and launches nothing here.
  void prepare(const Problem& p, cuda::KernelSequence& kernels) const {
    if (p.op == Operation::chunk_backward && saved.bytes > 0) return;
    cuda::launch_start(params, p.io_dtype, /*normalise=*/params.l2norm, kernels);
    cuda::launch_prepare(params, p.io_dtype, kernels);
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
    if (p.K > 256) {
      return Availability::no("head dim K = " + std::to_string(p.K) + " is not supported (K <= 256, as fla)");
    }
    if (!cuda::have_kernels(p.io_dtype, static_cast<int>(cuda::kernel_key_dim(p.K)))) {
      return Availability::no("float32 inputs with head dim K = " + std::to_string(p.K) +
                              " need more shared memory than an SM has (float32 supports K <= 128; bfloat16 and "
                              "float16 support K <= 256)");
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

  std::size_t saved_bytes(const Problem& p) const override {
    const CudaDeviceGuard device(p.device.index);  // the plans read the device's SM count
    const std::optional<Problem> padded = padded_problem(p);
    return saved_layout(padded ? *padded : p, count_chunks(p)).bytes;
  }

  void forward(const Problem& p, const Inputs& in, const ForwardOutputs& out) const override {
    Call call(p, in, out.saved);
    call.expect_vector_rows("o", out.o.data);
    call.forward_outputs(p, out);
    cuda::KernelSequence kernels;
    call.prepare(p, kernels);
    cuda::launch_state_forward(call.params, p.io_dtype, false, kernels);
    kernels.run(call.params, call.stream);
    call.crop_forward_outputs(p, out);
  }

  void backward(const Problem& p, const Inputs& in, const BackwardInputs& grads_in,
                const Gradients& grads_out) const override {
    Call call(p, in, grads_in.saved);
    const Problem& kp = call.kernel;
    const WorkspaceLayout::Padded& copy = call.layout.padded;
    const std::size_t io = dtype_size(p.io_dtype);
    Params& k = call.params;
    call.expect_vector_rows("do", grads_in.d_o.data);
    k.d_o = call.input(grads_in.d_o.data, Call::rows(p, p.HV, p.V), Call::rows(kp, p.HV, kp.V), io, copy.d_o);
    if (grads_in.dht) {
      k.dht = static_cast<const float*>(
          call.input(grads_in.dht->data, Call::states(p), Call::states(kp), sizeof(float), copy.dht));
    }
    k.dq = call.output(grads_out.dq.data, copy.dq);
    k.dk = call.output(grads_out.dk.data, copy.dk);
    k.dv = call.output(grads_out.dv.data, copy.dv);
    k.dg = grads_out.dg.data;
    k.dbeta = grads_out.dbeta.data;
    if (grads_out.dh0) k.dh0 = static_cast<float*>(call.output(grads_out.dh0->data, copy.dh0));
    cuda::KernelSequence kernels;
    call.prepare(p, kernels);
    if (k.fused_backward) {
      cuda::launch_state_forward(k, p.io_dtype, true, kernels);
      cuda::launch_backward_segment_starts(k, p.io_dtype, kernels);
      if (k.role_split) {
        cuda::launch_role_split_backward(k, p.io_dtype, kernels);
      } else {
        cuda::launch_fused_backward(k, p.io_dtype, kernels);
      }
    } else {
      cuda::launch_backward_state_passes(k, p.io_dtype, kernels);
      cuda::launch_chunk_grad(k, p.io_dtype, kernels);
      cuda::launch_wy_grad(k, p.io_dtype, kernels);
    }
    cuda::launch_input_grads(k, p.io_dtype, kernels);
    kernels.run(k, call.stream);
    call.crop(k.dq, Call::rows(kp, p.H, kp.K), grads_out.dq.data, Call::rows(p, p.H, p.K), io);
    call.crop(k.dk, Call::rows(kp, p.H, kp.K), grads_out.dk.data, Call::rows(p, p.H, p.K), io);
    call.crop(k.dv, Call::rows(kp, p.HV, kp.V), grads_out.dv.data, Call::rows(p, p.HV, p.V), io);
    if (grads_out.dh0) call.crop(k.dh0, Call::states(kp), grads_out.dh0->data, Call::states(p), sizeof(float));
  }

  void recurrent(const Problem& p, const Inputs& in, const ForwardOutputs& out) const override {
    Call call(p, in);
    call.forward_outputs(p, out);
    cuda::KernelSequence kernels;
    cuda::launch_recurrent(call.params, p.io_dtype, kernels);
    kernels.run(call.params, call.stream);
    call.crop_forward_outputs(p, out);
  }
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(); }

}  // namespace deltatrain::gdn
