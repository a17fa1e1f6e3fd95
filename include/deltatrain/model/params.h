// The model's parameters: names (HF's state-dict names), shapes, what each is, and how it starts.
// The list is the one source of truth for the optimizer's flat layout, checkpoints and `model info`.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "deltatrain/core/tensor.h"
#include "deltatrain/model/config.h"

namespace deltatrain::model {

// What a parameter is, for `model info`'s breakdown and for initialisation.
enum class ParamKind : std::uint8_t {
  embedding,   // model.embed_tokens.weight
  lm_head,     // lm_head.weight (absent when tied)
  norm,        // RMSNorm weights (zero-centred: 1 + w), zeros at init
  gated_norm,  // the GDN output norm's weight (w, not 1 + w), ones at init
  gdn_linear,  // GDN projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj)
  gdn_conv,    // the GDN causal conv1d weight [C, 1, W]
  gdn_decay,   // A_log (log U(0.01, 16) at init) and dt_bias (ones)
  attention,   // q_proj (query and gate), k_proj, v_proj, o_proj
  mlp,         // gate_proj, up_proj, down_proj
};
const char* param_kind_name(ParamKind kind);

struct ParamInfo {
  std::string name;  // HF's name, e.g. "model.layers.0.linear_attn.in_proj_qkv.weight"
  std::vector<std::int64_t> shape;
  ParamKind kind = ParamKind::mlp;
  std::int64_t numel() const;
};

// Every parameter of `config`, in the model's order (embedding, layers in order, final norm, lm_head).
// With tied embeddings lm_head.weight is not listed: the embedding serves both.
std::vector<ParamInfo> param_infos(const Config& config);
std::int64_t param_count(const Config& config);

// Deterministic initialisation from `seed` (HF's scheme): normal(0, initializer_range) for linear, conv and
// embedding weights, zeros for RMSNorm, ones for the gated norm and dt_bias, log U(0.01, 16) for A_log.
// Writes host memory `data` of `info`'s numel elements in `dtype` (f32, f64 or bf16). Each parameter draws
// from its own stream (seed, parameter name), so one parameter's values do not depend on the others.
void init_param(const ParamInfo& info, double initializer_range, std::uint64_t seed, DType dtype, void* data);

// Name -> view lookups that the model binds to (the optimizer's flat buffers, or a ParamStore).
using TensorLookup = std::function<TensorView(std::string_view name)>;

// Host-owned parameters and gradients, one contiguous buffer each: for tests, the CLI and Python, where no
// optimizer owns them. dtype f32 or f64 (both buffers in it), or bf16 (parameters in bf16, gradients in f32);
// InvalidArgument otherwise.
class ParamStore {
 public:
  ParamStore(const Config& config, DType dtype);
  const std::vector<ParamInfo>& infos() const { return infos_; }
  DType dtype() const { return dtype_; }  // of the parameters
  DType grad_dtype() const;               // of the gradients: f32 for bf16 parameters
  TensorView param(std::string_view name) const;  // InvalidArgument for an unknown name
  TensorView grad(std::string_view name) const;
  TensorLookup params() const;
  TensorLookup grads() const;
  void init(double initializer_range, std::uint64_t seed);
  void zero_grads();
  // The whole buffers (numel() elements each), for checks and copies.
  TensorView param_buffer() const;
  TensorView grad_buffer() const;
  std::int64_t numel() const { return numel_; }

 private:
  TensorView view(std::vector<std::byte>& storage, DType dtype, std::string_view name) const;
  std::vector<ParamInfo> infos_;
  std::vector<std::int64_t> offsets_;                     // of infos_[i], in elements
  std::map<std::string, std::size_t, std::less<>> index_;  // name -> i
  DType dtype_;
  std::int64_t numel_ = 0;
  mutable std::vector<std::byte> params_, grads_;
};

// A ParamStore's parameters mirrored on a GPU (same layout, one allocation each for parameters and
// gradients), for a GPU model that no optimizer owns: tests, benchmarks, Python. upload() copies the host
// store's parameters; download_grads() copies the gradients back.
class DeviceParams {
 public:
  DeviceParams(const ParamStore& host, Device device);
  ~DeviceParams();
  DeviceParams(const DeviceParams&) = delete;
  DeviceParams& operator=(const DeviceParams&) = delete;

  TensorLookup params() const;
  TensorLookup grads() const;
  void upload(const ParamStore& host, void* stream = nullptr);
  void download_grads(const ParamStore& host, void* stream = nullptr) const;  // waits for the copy
  void zero_grads(void* stream = nullptr);

 private:
  TensorView translate(const TensorView& host_view, const TensorView& host_buffer, void* device_base) const;
  const ParamStore& host_;
  Device device_;
  void* params_ = nullptr;
  void* grads_ = nullptr;
};

}  // namespace deltatrain::model
