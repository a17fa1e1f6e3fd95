// One step of the hybrid GDN model, forward and backward, read top to bottom. Every kernel is an Ops call
// (ops.h) or the gdn operator; this file decides only what is computed, in which order, and what is kept.
//
// Per layer (x the residual stream [T, hidden]):
//   h = rmsnorm(x);  x += mixer(h);  h = rmsnorm(x);  x += down(silu(gate(h)) * up(h))  (the add in the product)
// GDN mixer:        qkv = conv1d_silu(in_proj_qkv h);  z = in_proj_z h;  g, beta = gates(in_proj_a h, in_proj_b h)
//                   o = gdn(q, k, v, g, beta) with the in-kernel L2 norm;  out_proj(gated_rmsnorm(o, z))
// attention mixer:  [q | gate] = q_proj h per head;  q = rope(q_norm q);  k = rope(k_norm(k_proj h));  v = v_proj h
//                   o_proj(attention(q, k, v) * sigmoid(gate))
// Then the final norm, and the loss over chunks of tokens: logits = h lm_head^T, cross-entropy.
// Projections of one input (in_proj_qkv/z/b/a, gate_proj/up_proj; in decode also q/k/v_proj) run as one GEMM over
// their stacked weights.
//
// Inference (prefill and decode) runs the same layer functions with an InferenceStep saying which cache slots
// the sequences live in: prefill computes exactly the training forward and also writes each sequence's final
// GDN state, conv history and keys/values into its slot; decode swaps the three operations that mix tokens
// for their one-token forms over the slots (conv1d_silu_step, taken with the gates as gdn_inputs_step; gdn
// recurrent_forward from the slot's state; rope at the slot's position, taken with the q/k norms and the cache
// stores as attention_inputs_step, and cached_attention), everything else unchanged but the q/k/v product's layout.
//
// On a GPU, decode's kernels (the layers and the logits' product: hundreds of launches, which at a small batch take
// longer than the work) are recorded once per batch size into a CUDA graph and replayed; a step then uploads its
// index arrays into the same device buffers and launches the graph. decode_step says when a replay is valid.
#include "deltatrain/model/model.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <string>

#include "deltatrain/core/bfloat16.h"
#include "deltatrain/core/error.h"
#include "deltatrain/gdn/gdn.h"
#include "deltatrain/model/inference.h"
#include "arena.h"
#include "ops.h"
#include "tensors.h"

namespace deltatrain::model {
namespace {

std::string layer_prefix(int layer) { return "model.layers." + std::to_string(layer) + "."; }

// Projections of one input whose outputs sit side by side in one activation: one GEMM over their stacked
// weights when those lie so in memory (stacked_rows; ParamStore keeps them in this order), else one product per
// part into its columns. Fewer, larger products: at decode's few rows each product costs about a launch.
struct Projections {
  std::vector<TensorView> parts;
  TensorView stacked;  // null data when the parts are not adjacent
  Projections() = default;
  Projections(std::initializer_list<TensorView> p) : parts(p), stacked(stacked_rows(p)) {}
};

// The GDN input projections' columns of a [T, conv_dim + HV dv + 2 HV] matrix (their outputs, or the gradients
// of those), in Projections' order: qkv, z, b, a.
struct InProjColumns {
  TensorView qkv, z, b, a;
};
InProjColumns in_proj_columns(const TensorView& m, const Config& c) {
  const std::int64_t C = c.linear_conv_dim(), vd = c.linear_value_dim(), HV = c.linear_num_value_heads;
  return {col_slice(m, 0, C), col_slice(m, C, C + vd), col_slice(m, C + vd, C + vd + HV),
          col_slice(m, C + vd + HV, C + vd + 2 * HV)};
}

// The parameters of one layer, or their gradients: the same names resolve into either.
struct GdnWeights {
  Projections in_proj;  // in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
  TensorView conv1d, a_log, dt_bias, norm, out_proj;
};
struct AttentionWeights {
  TensorView q_proj, k_proj, v_proj, o_proj, q_norm, k_norm;
  Projections qkv;  // q_proj, k_proj, v_proj: decode's one product
};
struct LayerWeights {
  LayerKind kind = LayerKind::linear_attention;
  TensorView input_norm, post_norm, down_proj;
  Projections gate_up;  // mlp.gate_proj, mlp.up_proj
  GdnWeights gdn;
  AttentionWeights attention;
};
struct Weights {
  TensorView embedding, final_norm, lm_head;
  std::vector<LayerWeights> layers;
};

// Everything a layer's backward reads, kept from its forward (or recomputed from its input).
struct GdnActivations {
  TensorView in_proj;            // the input projections' outputs side by side [T, conv_dim + HV * dv + 2 HV]
  TensorView qkv;                // in_proj's first columns, before the convolution [T, conv_dim]
  TensorView q, k, v;            // conv1d + SiLU's output, its column blocks apart as the gdn operator takes them
  TensorView z, b, a;            // in_proj's next columns [T, HV * dv], [T, HV] x 2
  TensorView g, beta;            // [T, HV] x 2
  TensorView core;               // the gdn operator's output [T, HV * dv]
  TensorView norm_rstd, normed;  // gated RMSNorm [T * HV], its output [T, HV * dv]
  // What the gdn operator's chunked forward keeps for its backward (gdn::ForwardOutputs::saved), where a backward
  // reads this layer and the backend keeps anything.
  std::optional<TensorView> saved;
};
struct AttentionActivations {
  TensorView qg;                  // q_proj output: per head [query | gate] [T, Hq * 2 * hd]
  TensorView k_raw, v;            // [T, Hkv * hd]
  TensorView q_rstd, k_rstd;      // [T * Hq], [T * Hkv]
  TensorView q, k;                // normed and rotated [T, Hq * hd], [T, Hkv * hd]
  TensorView o, lse;              // attention output [T, Hq * hd], [Hq, T]
  TensorView gated;               // o * sigmoid(gate) [T, Hq * hd]
};
struct LayerActivations {
  TensorView input_rstd, input_normed;  // [T], [T, hidden]
  TensorView mid;                       // residual stream after the mixer [T, hidden]
  TensorView post_rstd, post_normed;
  TensorView mlp_gate_up;               // [T, 2 * intermediate]: gate_proj's output, then up_proj's
  TensorView mlp_gate, mlp_up, mlp_act;  // [T, intermediate]: mlp_gate_up's halves, swiglu's output
  GdnActivations gdn;
  AttentionActivations attention;
};

// What one inference step reads and writes besides the batch: the slot of each of its N sequences and the cache
// rows its keys, values and conv history go to, as index arrays (host values, and on a GPU device copies).
struct InferenceStep {
  bool decode = false;  // else prefill
  InferenceState* state = nullptr;
  std::vector<std::int32_t> slots, sequence_index;  // [N]; 0 .. N - 1
  std::vector<std::int32_t> kv_dst, kv_src;         // cache rows (slot * max_length + position) <- batch rows
  std::vector<std::int32_t> conv_dst, conv_src;     // prefill: conv history rows (slot * (W - 1) + j) <- batch rows
  std::vector<std::int32_t> short_slots;            // prefill: slots whose prompt is shorter than W - 1
  std::vector<std::int32_t> last_rows;              // prefill: each sequence's last batch row
  std::vector<std::int32_t> positions, lengths;     // decode: each new token's position; lengths after it
  IndexArray slot_ids, sequence_ids, kv_dst_ids, kv_src_ids, conv_dst_ids, conv_src_ids, last_row_ids, position_ids,
      length_ids;
};

}  // namespace

struct Model::Impl {
  Config config;
  ModelOptions options;
  std::unique_ptr<Ops> ops;
  Weights params, grads;
  bool has_grads = false;
  // Dtypes by role: everything in options.dtype on the CPU; bfloat16 activations with float32 statistics
  // (norm rstd, softmax lse, gates) on a GPU.
  DType act_dtype = DType::f32, stat_dtype = DType::f32;

  // The batch of the last forward, on the host and (on a GPU) on the device.
  std::vector<std::int32_t> tokens, cu_seqlens, targets;
  std::vector<double> weights, logprobs;
  const TokenObjective* objective = nullptr;  // the batch's, for the forward's loss
  IndexArray token_ids, sequences, target_ids;
  // [T] on the device: float64 on the CPU; float32 on a GPU, but logprob_values float64 when batch-invariant (the
  // rollout sampler's formula, Ops::cross_entropy)
  TensorView weight_values, logprob_values;
  std::int64_t T = 0;
  bool trained = false;  // the last forward kept what backward() needs

  Arena memory{options.device, options.memory};     // activations kept from the forward, rewound each forward
  Arena scratch{options.device, options.memory};    // temporaries of one layer's backward, rewound for each layer
  // The one layer's activations being computed when they are not kept (with recompute, or outside training).
  Arena recomputed{options.device, options.memory};
  std::vector<TensorView> layer_inputs;  // residual stream entering each layer, and after the last [L + 1]
  std::vector<LayerActivations> acts;    // one per layer in a training forward (none with recompute)
  LayerActivations recompute_acts;
  bool backward_reads_layers = false;    // the forward is a training one: allocate_layer keeps what backward reads
  // The bytes of each GDN layer's saved buffer in this training forward: the same for every layer (one shape), so
  // asked of the operator once, by the first layer allocated; unset until then.
  std::optional<std::size_t> gdn_saved_bytes;
  TensorView final_rstd, final_normed;   // final norm
  TensorView d_final;                    // the loss's gradient w.r.t. final_normed, formed in forward
  InferenceStep inference;               // inference.state is null outside prefill and decode
  Arena staged_logits{options.device, options.memory};  // prefill and decode into host doubles: the device logits
  // Decode's CUDA graphs (decode_uses_cuda_graphs), one per batch size: the bindings of the step that last ran at
  // that size, and the graph recorded from a step with exactly those bindings (empty until a second step has them).
  struct DecodeGraph {
    std::vector<std::uintptr_t> bindings;
    StreamGraph graph;
  };
  std::map<std::int64_t, DecodeGraph> decode_graphs;

  Impl(const Config& c, const ModelOptions& o) : config(c), options(o) {}

  TensorView act(std::initializer_list<std::int64_t> shape) { return memory.allocate(act_dtype, shape); }
  TensorView stat(std::initializer_list<std::int64_t> shape) { return memory.allocate(stat_dtype, shape); }
  TensorView temp(std::initializer_list<std::int64_t> shape) { return scratch.allocate(act_dtype, shape); }
  TensorView temp_stat(std::initializer_list<std::int64_t> shape) { return scratch.allocate(stat_dtype, shape); }

  void load_batch(const Batch& batch, bool for_loss);
  // Each array's values as the kernels take them: the host vector itself on the CPU, plus (on a GPU) a device copy in
  // `memory` (rewound by load_batch), all the arrays' in one allocation filled by one copy. The vectors must stay
  // unchanged until the step ends.
  using IndexUpload = std::pair<IndexArray*, const std::vector<std::int32_t>*>;
  void upload_index_arrays(std::span<const IndexUpload> arrays);
  std::vector<std::int32_t> index_staging;  // upload_index_arrays' host image of that allocation
  // Inference: the batch's tokens and offsets with the step's index arrays.
  void upload_inference();
  // Model::decode's work; device_tokens (not null): the tokens on the device, which replace `tokens` there.
  void decode(std::span<const std::int32_t> tokens, const std::int32_t* device_tokens,
              std::span<const std::int32_t> slots, InferenceState& state, const TensorView& logits);
  void check_state(const InferenceState& state, std::span<const std::int32_t> slots, std::int64_t rows) const;
  void check_logits(const TensorView& logits, std::int64_t rows) const;
  TensorView stage_logits(std::int64_t rows, std::span<const double> out);
  void run_layers();
  bool graphs_enabled() const {
    return options.cuda_graphs && options.device.type != DeviceType::cpu && options.stream != nullptr;
  }
  std::vector<std::uintptr_t> decode_bindings(const TensorView& logits) const;
  void decode_step(const TensorView& logits);
  void logits_to_host(const TensorView& logits, std::span<double> out);
  void allocate(bool training);
  void allocate_layer(LayerActivations& a, LayerKind kind, Arena& arena);
  LayerActivations& activations(int layer);
  void layer_forward(int layer);
  void layer_backward(int layer, const TensorView& dx);
  // state: the layer's inference state during prefill and decode, else null.
  void gdn_forward(const GdnWeights& w, GdnActivations& a, const TensorView& h, const TensorView& out,
                   const LayerState* state);
  void gdn_core(GdnActivations& a, const LayerState* state);
  void gdn_backward(const GdnWeights& w, const GdnWeights& dw, GdnActivations& a, const TensorView& h,
                    const TensorView& dout, const TensorView& dh);
  void attention_forward(const AttentionWeights& w, AttentionActivations& a, const TensorView& h,
                         const TensorView& out, const LayerState* state);
  void attention_backward(const AttentionWeights& w, const AttentionWeights& dw, AttentionActivations& a,
                          const TensorView& h, const TensorView& dout, const TensorView& dh);
  // Prefill: the step's keys and values (normed and rotated) into their slots' cache rows (decode stores them in
  // attention_inputs_step).
  void store_keys_values(const AttentionActivations& a, const LayerState& state) {
    const TensorView& cache = state.k_cache;
    const std::int64_t rows = cache.shape[0] * cache.shape[1], cols = cache.shape[2];
    ops->copy_rows(as_matrix(state.k_cache, rows, cols), inference.kv_dst_ids, a.k, inference.kv_src_ids);
    ops->copy_rows(as_matrix(state.v_cache, rows, cols), inference.kv_dst_ids, a.v, inference.kv_src_ids);
  }
  double loss(bool want_grad);

  // y = x w^T;  the backward: dx (+)= dy w, dw += dy^T x.
  void linear(const TensorView& y, const TensorView& x, const TensorView& w) { ops->linear(y, x, w, nullptr); }
  void linear_backward(const TensorView& dx, const TensorView& dw, const TensorView& dy, const TensorView& x,
                       const TensorView& w, bool accumulate_dx) {
    ops->gemm(false, false, 1, dy, w, accumulate_dx ? 1 : 0, dx);
    ops->gemm(true, false, 1, dy, x, 1, dw);
  }
  // The same for projections: y's columns are the parts' outputs in order, as are dy's their gradients.
  void linear(const TensorView& y, const TensorView& x, const Projections& w) {
    if (w.stacked.data != nullptr) return linear(y, x, w.stacked);
    std::int64_t column = 0;
    for (const TensorView& part : w.parts) {
      linear(col_slice(y, column, column + part.shape[0]), x, part);
      column += part.shape[0];
    }
  }
  void linear_backward(const TensorView& dx, const Projections& dw, const TensorView& dy, const TensorView& x,
                       const Projections& w, bool accumulate_dx) {
    if (w.stacked.data != nullptr && dw.stacked.data != nullptr)
      return linear_backward(dx, dw.stacked, dy, x, w.stacked, accumulate_dx);
    std::int64_t column = 0;
    for (std::size_t i = 0; i < w.parts.size(); ++i) {
      const std::int64_t rows = w.parts[i].shape[0];
      linear_backward(dx, dw.parts[i], col_slice(dy, column, column + rows), x, w.parts[i], accumulate_dx || i > 0);
      column += rows;
    }
  }

  gdn::Inputs gdn_inputs(const GdnActivations& a) const;
  gdn::Options gdn_options() const;
};

namespace {

Weights resolve_weights(const Config& config, const TensorLookup& lookup) {
  Weights w;
  w.embedding = lookup("model.embed_tokens.weight");
  w.final_norm = lookup("model.norm.weight");
  w.lm_head = config.tie_word_embeddings ? w.embedding : lookup("lm_head.weight");
  for (int i = 0; i < config.num_hidden_layers(); ++i) {
    const std::string p = layer_prefix(i);
    LayerWeights l;
    l.kind = config.layer_types[i];
    l.input_norm = lookup(p + "input_layernorm.weight");
    l.post_norm = lookup(p + "post_attention_layernorm.weight");
    l.gate_up = {lookup(p + "mlp.gate_proj.weight"), lookup(p + "mlp.up_proj.weight")};
    l.down_proj = lookup(p + "mlp.down_proj.weight");
    if (l.kind == LayerKind::linear_attention) {
      const std::string a = p + "linear_attn.";
      l.gdn = {{lookup(a + "in_proj_qkv.weight"), lookup(a + "in_proj_z.weight"), lookup(a + "in_proj_b.weight"),
                lookup(a + "in_proj_a.weight")},
               lookup(a + "conv1d.weight"),
               lookup(a + "A_log"),
               lookup(a + "dt_bias"),
               lookup(a + "norm.weight"),
               lookup(a + "out_proj.weight")};
      // HF's conv1d.weight [C, 1, W] is used as the matrix [C, W].
      l.gdn.conv1d = as_matrix(l.gdn.conv1d, config.linear_conv_dim(), config.linear_conv_kernel_dim);
    } else {
      const std::string a = p + "self_attn.";
      const TensorView q = lookup(a + "q_proj.weight"), k = lookup(a + "k_proj.weight");
      const TensorView v = lookup(a + "v_proj.weight");
      l.attention = {q, k, v, lookup(a + "o_proj.weight"), lookup(a + "q_norm.weight"), lookup(a + "k_norm.weight"),
                     {q, k, v}};
    }
    w.layers.push_back(l);
  }
  return w;
}

// Checks each bound tensor against the parameter list before any is used.
TensorLookup checked(const TensorLookup& lookup, const std::vector<ParamInfo>& infos, DType dtype, Device device,
                     const char* what) {
  for (const ParamInfo& info : infos) {
    const TensorView v = lookup(info.name);
    const std::string name = std::string(what) + " " + info.name;
    if (v.data == nullptr) throw InvalidArgument(name, "is not bound (null data)");
    bool same_shape = v.ndim == static_cast<int>(info.shape.size());
    for (int d = 0; same_shape && d < v.ndim; ++d) same_shape = v.shape[d] == info.shape[d];
    if (!same_shape) throw InvalidArgument(name, "has shape " + v.shape_string() + ", the config needs another");
    if (v.dtype != dtype) {
      throw InvalidArgument(name, std::string("has dtype ") + dtype_name(v.dtype) + ", the model computes in " +
                                      dtype_name(dtype));
    }
    if (!(v.device == device)) throw InvalidArgument(name, "lives on " + device_name(v.device) + ", not the model's device");
    if (!v.is_contiguous()) throw InvalidArgument(name, "must be contiguous");
  }
  return lookup;
}

}  // namespace

std::int64_t default_loss_chunk(const Device& device) { return device.type == DeviceType::cpu ? 1024 : 8192; }

DType gradient_dtype(const ModelOptions& options) {
  return options.device.type == DeviceType::cpu ? options.dtype : DType::f32;
}

Model::Model(const Config& config, const ModelOptions& options) : impl_(std::make_unique<Impl>(config, options)) {
  validate(config);
  if (options.loss_chunk < 0)
    throw InvalidArgument("loss_chunk", "must be at least 1 token, or 0 for the device's default, got " +
                                            std::to_string(options.loss_chunk));
  if (options.cpu_threads < 0) throw InvalidArgument("cpu_threads", "must be >= 0 (0: all available)");
  if (options.memory != nullptr && options.memory->device() != options.device) {
    throw InvalidArgument("memory", "allocates on " + device_name(options.memory->device()) + ", the model runs on " +
                                        device_name(options.device));
  }
  Impl& m = *impl_;
  if (options.device.type == DeviceType::cpu) {
    if (options.dtype != DType::f32 && options.dtype != DType::f64) {
      throw InvalidArgument("dtype", std::string("the CPU model computes in float32 or float64, got ") +
                                         dtype_name(options.dtype));
    }
    m.act_dtype = m.stat_dtype = options.dtype;
    m.ops = make_cpu_ops(options.cpu_threads, options.batch_invariant);
  } else {
    if (options.dtype != DType::bf16) {
      throw InvalidArgument("dtype", std::string("the GPU model computes in bfloat16, got ") + dtype_name(options.dtype));
    }
    m.act_dtype = DType::bf16;
    m.stat_dtype = DType::f32;
    m.ops = make_cuda_ops(options.device, options.stream, options.batch_invariant);
  }
}

Model::~Model() = default;

const Config& Model::config() const { return impl_->config; }
const ModelOptions& Model::options() const { return impl_->options; }

void Model::bind(const TensorLookup& params, const TensorLookup& grads) {
  Impl& m = *impl_;
  const std::vector<ParamInfo> infos = param_infos(m.config);
  Weights p = resolve_weights(m.config, checked(params, infos, m.options.dtype, m.options.device, "parameter"));
  Weights g;
  if (grads) g = resolve_weights(m.config, checked(grads, infos, gradient_dtype(m.options), m.options.device, "gradient"));
  m.params = std::move(p);
  m.grads = std::move(g);
  m.has_grads = static_cast<bool>(grads);
  m.trained = false;
  m.decode_graphs.clear();  // they hold the previous parameters' addresses
}

std::vector<std::int32_t> next_token_targets(std::span<const std::int32_t> tokens,
                                             std::span<const std::int32_t> cu_seqlens) {
  std::vector<std::int32_t> targets(tokens.size(), -1);
  for (std::size_t n = 0; n + 1 < cu_seqlens.size(); ++n) {
    for (std::int32_t t = cu_seqlens[n]; t + 1 < cu_seqlens[n + 1]; ++t) targets[t] = tokens[t + 1];
  }
  return targets;
}

void validate_batch(const Batch& batch, std::int64_t vocab_size) {
  const auto T = static_cast<std::int64_t>(batch.tokens.size());
  if (T == 0) throw InvalidArgument("tokens", "the batch is empty");
  if (T > INT32_MAX) throw InvalidArgument("tokens", "more than 2^31 - 1 tokens in one batch");
  for (std::int64_t t = 0; t < T; ++t) {
    if (batch.tokens[t] < 0 || batch.tokens[t] >= vocab_size) {
      throw InvalidArgument("tokens", "token " + std::to_string(t) + " is " + std::to_string(batch.tokens[t]) +
                                          ", outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
    }
  }
  const auto& cu = batch.cu_seqlens;
  if (cu.size() < 2) throw InvalidArgument("cu_seqlens", "needs at least 2 offsets (one sequence)");
  if (cu.front() != 0 || cu.back() != T) {
    throw InvalidArgument("cu_seqlens", "must start at 0 and end at the token count " + std::to_string(T) + ", got " +
                                            std::to_string(cu.front()) + " ... " + std::to_string(cu.back()));
  }
  for (std::size_t n = 0; n + 1 < cu.size(); ++n) {
    if (cu[n + 1] < cu[n]) throw InvalidArgument("cu_seqlens", "must be non-decreasing (offset " + std::to_string(n + 1) + ")");
  }
  if (!batch.targets.empty()) {
    if (static_cast<std::int64_t>(batch.targets.size()) != T) {
      throw InvalidArgument("targets", "needs one entry per token (" + std::to_string(T) + ")");
    }
    for (std::int64_t t = 0; t < T; ++t) {
      if (batch.targets[t] < -1 || batch.targets[t] >= vocab_size) {
        throw InvalidArgument("targets", "entry " + std::to_string(t) + " is " + std::to_string(batch.targets[t]) +
                                             ": a token id or -1 (no loss)");
      }
    }
  }
  if (!batch.weights.empty() && batch.objective != nullptr) {
    throw InvalidArgument("weights", "must be empty when the batch has an objective (it replaces the weighted NLL)");
  }
  if (batch.objective != nullptr && !*batch.objective) throw InvalidArgument("objective", "is an empty function");
  if (!batch.weights.empty()) {
    if (static_cast<std::int64_t>(batch.weights.size()) != T) {
      throw InvalidArgument("weights", "needs one entry per token (" + std::to_string(T) + ")");
    }
    for (std::int64_t t = 0; t < T; ++t) {
      if (!std::isfinite(batch.weights[t])) throw InvalidArgument("weights", "entry " + std::to_string(t) + " is not finite");
    }
  }
}

// A decode step's host time between the previous step's tokens and this step's graph is all exposed (the GPU waits
// for it), and its eleven small copies were most of its API calls; each array starts 64-byte aligned.
void Model::Impl::upload_index_arrays(std::span<const IndexUpload> arrays) {
  if (options.device.type == DeviceType::cpu) {
    for (const auto& [array, host] : arrays) *array = IndexArray(*host);
    return;
  }
  const auto padded = [](std::size_t n) { return (n + 15) / 16 * 16; };  // int32s: 64 bytes
  std::size_t total = 0;
  for (const auto& [array, host] : arrays) total += padded(host->size());
  index_staging.assign(total, 0);
  const TensorView block = memory.allocate(DType::i32, {static_cast<std::int64_t>(std::max<std::size_t>(total, 1))});
  std::size_t offset = 0;
  for (const auto& [array, host] : arrays) {
    std::copy(host->begin(), host->end(), index_staging.begin() + static_cast<std::ptrdiff_t>(offset));
    *array = IndexArray(*host, block.ptr<std::int32_t>() + offset);
    offset += padded(host->size());
  }
  // From pageable memory the driver stages the bytes before returning, so index_staging may change after.
  copy_bytes(block.data, index_staging.data(), total * sizeof(std::int32_t), options.device, options.stream);
}

// The batch on the host (validation, CPU kernels, the GDN operator's schedule) and, on a GPU, on the device; with
// `for_loss` also its targets, weights and room for the log-probabilities (an inference step has no loss: its
// tokens and offsets are all a decode step uploads besides the step's own index arrays).
void Model::Impl::load_batch(const Batch& batch, bool for_loss) {
  tokens.assign(batch.tokens.begin(), batch.tokens.end());
  cu_seqlens.assign(batch.cu_seqlens.begin(), batch.cu_seqlens.end());
  T = static_cast<std::int64_t>(tokens.size());
  memory.reset();
  if (!for_loss) {  // an inference step: upload_inference uploads the tokens and offsets with its own arrays
    objective = nullptr;
    target_ids = {};
    weight_values = logprob_values = {};
    return;
  }
  targets = batch.targets.empty() ? next_token_targets(batch.tokens, batch.cu_seqlens)
                                  : std::vector<std::int32_t>(batch.targets.begin(), batch.targets.end());
  if (batch.weights.empty()) {
    const auto counted = std::count_if(targets.begin(), targets.end(), [](std::int32_t t) { return t >= 0; });
    weights.assign(targets.size(), counted > 0 ? 1.0 / double(counted) : 0.0);
  } else {
    weights.assign(batch.weights.begin(), batch.weights.end());
  }
  logprobs.assign(targets.size(), 0.0);
  objective = batch.objective;
  const IndexUpload arrays[] = {{&token_ids, &tokens}, {&sequences, &cu_seqlens}, {&target_ids, &targets}};
  upload_index_arrays(arrays);
  const Device device = options.device;
  if (device.type == DeviceType::cpu) {
    weight_values = TensorView::contiguous(weights.data(), DType::f64, {T});
    logprob_values = TensorView::contiguous(logprobs.data(), DType::f64, {T});
    return;
  }
  // The copies are asynchronous: the float32 weights must outlive them, so they live in the arena's
  // host-visible sibling, logprobs' host vector (converted back after the loss).
  std::vector<float> weights32(weights.begin(), weights.end());
  weight_values = memory.allocate(DType::f32, {T});
  copy_bytes(weight_values.data, weights32.data(), weights32.size() * sizeof(float), device, options.stream);
  deltatrain::synchronize(device, options.stream);  // weights32 is a local
  logprob_values = memory.allocate(options.batch_invariant ? DType::f64 : DType::f32, {T});
}

void Model::Impl::allocate_layer(LayerActivations& a, LayerKind kind, Arena& arena) {
  const Config& c = config;
  auto act = [&](std::initializer_list<std::int64_t> shape) { return arena.allocate(act_dtype, shape); };
  auto stat = [&](std::initializer_list<std::int64_t> shape) { return arena.allocate(stat_dtype, shape); };
  a.input_rstd = stat({T});
  a.input_normed = act({T, c.hidden_size});
  a.mid = act({T, c.hidden_size});
  a.post_rstd = stat({T});
  a.post_normed = act({T, c.hidden_size});
  a.mlp_gate_up = act({T, 2 * c.intermediate_size});
  a.mlp_gate = col_slice(a.mlp_gate_up, 0, c.intermediate_size);  // gate_proj's columns, then up_proj's
  a.mlp_up = col_slice(a.mlp_gate_up, c.intermediate_size, 2 * c.intermediate_size);
  a.mlp_act = act({T, c.intermediate_size});
  if (kind == LayerKind::linear_attention) {
    const std::int64_t HV = c.linear_num_value_heads;
    GdnActivations& g = a.gdn;
    g.in_proj = act({T, c.linear_in_proj_dim()});
    const InProjColumns columns = in_proj_columns(g.in_proj, c);
    g.qkv = columns.qkv;
    g.z = columns.z;
    g.b = columns.b;
    g.a = columns.a;
    g.q = act({T, c.linear_key_dim()});
    g.k = act({T, c.linear_key_dim()});
    g.v = act({T, c.linear_value_dim()});
    g.g = stat({T, HV});
    g.beta = stat({T, HV});
    g.core = act({T, c.linear_value_dim()});
    g.norm_rstd = stat({T * HV});
    g.normed = act({T, c.linear_value_dim()});
    g.saved.reset();
    // The chunked forward fills it (batch-invariant mode runs the recurrent one, which keeps nothing).
    if (backward_reads_layers && !options.batch_invariant) {
      if (!gdn_saved_bytes) gdn_saved_bytes = gdn::forward_saved_bytes(gdn_inputs(g), gdn_options());
      if (*gdn_saved_bytes > 0) g.saved = arena.allocate(DType::u8, {static_cast<std::int64_t>(*gdn_saved_bytes)});
    }
  } else {
    const std::int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
    AttentionActivations& t = a.attention;
    t.qg = act({T, Hq * 2 * hd});
    t.k_raw = act({T, Hkv * hd});
    t.v = act({T, Hkv * hd});
    t.q_rstd = stat({T * Hq});
    t.k_rstd = stat({T * Hkv});
    t.q = act({T, Hq * hd});
    t.k = act({T, Hkv * hd});
    t.o = act({T, Hq * hd});
    t.lse = stat({Hq, T});
    t.gated = act({T, Hq * hd});
  }
}

// A training forward keeps what its backward reads: every layer's input and, without recompute, every layer's
// activations. Any other forward (prefill, decode, logits, a loss alone) reads neither past the layer: one set of
// activations serves each layer in turn, as recompute's does, and two residual-stream buffers take turns as a
// layer's input and output (a layer reads its input only before it writes its output).
void Model::Impl::allocate(bool training) {
  const int L = config.num_hidden_layers();
  backward_reads_layers = training;
  gdn_saved_bytes.reset();
  layer_inputs.clear();
  if (training) {
    for (int l = 0; l <= L; ++l) layer_inputs.push_back(act({T, config.hidden_size}));
  } else {
    const TensorView streams[2] = {act({T, config.hidden_size}), act({T, config.hidden_size})};
    for (int l = 0; l <= L; ++l) layer_inputs.push_back(streams[l % 2]);
  }
  acts.assign(training && !options.recompute ? L : 0, LayerActivations{});
  for (int l = 0; l < static_cast<int>(acts.size()); ++l) allocate_layer(acts[l], config.layer_types[l], memory);
  final_rstd = stat({T});
  final_normed = act({T, config.hidden_size});
  d_final = training ? act({T, config.hidden_size}) : TensorView{};
}

// A layer's activations: kept from a training forward, or one set reused by each layer in turn.
LayerActivations& Model::Impl::activations(int layer) {
  if (!acts.empty()) return acts[layer];
  recomputed.reset();
  allocate_layer(recompute_acts, config.layer_types[layer], recomputed);
  return recompute_acts;
}

gdn::Inputs Model::Impl::gdn_inputs(const GdnActivations& a) const {
  const Config& c = config;
  const std::int64_t H = c.linear_num_key_heads, HV = c.linear_num_value_heads, N = std::ssize(cu_seqlens);
  const TensorView cu_host = TensorView::contiguous(const_cast<std::int32_t*>(cu_seqlens.data()), DType::i32, {N});
  const bool on_gpu = options.device.type != DeviceType::cpu;
  const TensorView cu = on_gpu ? TensorView::contiguous(const_cast<std::int32_t*>(sequences.device), DType::i32, {N},
                                                        options.device)
                               : cu_host;
  return gdn::Inputs{reshaped(a.q, {1, T, H, c.linear_key_head_dim}),
                     reshaped(a.k, {1, T, H, c.linear_key_head_dim}),
                     reshaped(a.v, {1, T, HV, c.linear_value_head_dim}),
                     reshaped(a.g, {1, T, HV}),
                     reshaped(a.beta, {1, T, HV}),
                     std::nullopt,
                     cu,
                     on_gpu ? std::optional<TensorView>(cu_host) : std::nullopt};
}

gdn::Options Model::Impl::gdn_options() const {
  gdn::Options o;
  o.use_qk_l2norm_in_kernel = true;
  o.cpu_threads = options.cpu_threads;
  o.stream = options.stream;
  return o;
}

void Model::Impl::gdn_forward(const GdnWeights& w, GdnActivations& a, const TensorView& h, const TensorView& out,
                              const LayerState* state) {
  const Config& c = config;
  linear(a.in_proj, h, w.in_proj);
  const ColumnParts conv_out{a.q, a.k, a.v};
  const GdnGates gates{a.g, a.beta, a.a, a.b, w.a_log, w.dt_bias};
  if (state && inference.decode) {
    ops->gdn_inputs_step(conv_out, a.qkv, w.conv1d, state->conv_state, inference.slot_ids, gates);
  } else {
    ops->conv1d_silu_forward(conv_out, a.qkv, w.conv1d, sequences);
    ops->gdn_gates_forward(gates.g, gates.beta, gates.a, gates.b, gates.a_log, gates.dt_bias);
  }
  if (state && !inference.decode) {
    // The prompt's last W - 1 inputs become the slot's conv history, zeros before a short prompt's start.
    const std::int64_t history = c.linear_conv_kernel_dim - 1;
    const TensorView rows = as_matrix(state->conv_state, state->conv_state.shape[0] * history, c.linear_conv_dim());
    for (const std::int32_t slot : inference.short_slots) ops->fill_zero(row_slice(rows, slot * history, (slot + 1) * history));
    ops->copy_rows(rows, inference.conv_dst_ids, a.qkv, inference.conv_src_ids);
  }
  gdn_core(a, state);
  ops->gated_rmsnorm_forward(a.normed, a.norm_rstd, a.core, a.z, w.norm, c.rms_norm_eps);
  linear(out, a.normed, w.out_proj);
}

// The gdn operator: chunked in training and prefill (which keeps each sequence's final state in its slot),
// token by token from the slots' states in decode; token by token everywhere when batch-invariant (the chunked
// form's sums depend on where a token falls in its chunk). Decode updates each slot's state where it lies (the
// operator's state_indices: no copies); prefill starts from empty states and scatters its final states, which the
// chunked kernels write as contiguous [N, HV, K, V], into the slots.
void Model::Impl::gdn_core(GdnActivations& a, const LayerState* state) {
  const Config& c = config;
  const std::int64_t HV = c.linear_num_value_heads, dv = c.linear_value_head_dim;
  const TensorView core = reshaped(a.core, {1, T, HV, dv});
  const auto forward = options.batch_invariant ? gdn::recurrent_forward : gdn::chunk_forward;
  if (!state) {
    forward(gdn_inputs(a), {core, std::nullopt, a.saved}, gdn_options());
    return;
  }
  const std::int64_t N = std::ssize(inference.slots), K = c.linear_key_head_dim, per_slot = HV * K * dv;
  gdn::Inputs inputs = gdn_inputs(a);
  if (inference.decode) {
    const IndexArray& slots = inference.slot_ids;
    const TensorView slots_host = TensorView::contiguous(const_cast<std::int32_t*>(slots.host.data()), DType::i32, {N});
    const bool on_gpu = options.device.type != DeviceType::cpu;
    inputs.initial_state = state->gdn_state;
    inputs.state_indices =
        on_gpu ? TensorView::contiguous(const_cast<std::int32_t*>(slots.device), DType::i32, {N}, options.device)
               : slots_host;
    if (on_gpu) inputs.state_indices_host = slots_host;
    gdn::recurrent_forward(inputs, {core, state->gdn_state}, gdn_options());
    return;
  }
  scratch.reset();
  const TensorView final_state = temp_stat({N, HV, K, dv});
  forward(inputs, {core, final_state}, gdn_options());
  const TensorView slot_rows = as_matrix(state->gdn_state, state->gdn_state.shape[0], per_slot);
  ops->copy_rows(slot_rows, inference.slot_ids, as_matrix(final_state, N, per_slot), inference.sequence_ids);
}

void Model::Impl::gdn_backward(const GdnWeights& w, const GdnWeights& dw, GdnActivations& a, const TensorView& h,
                               const TensorView& dout, const TensorView& dh) {
  const Config& c = config;
  const std::int64_t H = c.linear_num_key_heads, HV = c.linear_num_value_heads, dk = c.linear_key_head_dim,
                     dv = c.linear_value_head_dim, kd = c.linear_key_dim(), vd = c.linear_value_dim();
  const TensorView d_normed = temp({T, vd});
  linear_backward(d_normed, dw.out_proj, dout, a.normed, w.out_proj, false);
  // The input projections' gradients side by side, as their outputs are (in_proj's columns).
  const TensorView d_in_proj = temp({T, c.linear_in_proj_dim()});
  const InProjColumns d = in_proj_columns(d_in_proj, c);
  const TensorView d_core = temp({T, vd});
  ops->gated_rmsnorm_backward(d_core, d.z, dw.norm, d_normed, a.core, a.z, a.norm_rstd, w.norm);
  const TensorView dq = temp({T, kd}), dk_ = temp({T, kd}), dv_ = temp({T, vd});
  const TensorView dg = temp_stat({T, HV}), dbeta = temp_stat({T, HV});
  gdn::chunk_backward(gdn_inputs(a), {reshaped(d_core, {1, T, HV, dv}), std::nullopt, a.saved},
                      {reshaped(dq, {1, T, H, dk}), reshaped(dk_, {1, T, H, dk}), reshaped(dv_, {1, T, HV, dv}),
                       reshaped(dg, {1, T, HV}), reshaped(dbeta, {1, T, HV}), std::nullopt},
                      gdn_options());
  ops->gdn_gates_backward(d.a, d.b, dw.a_log, dw.dt_bias, dg, dbeta, a.a, a.b, w.a_log, w.dt_bias);
  ops->conv1d_silu_backward(d.qkv, dw.conv1d, {dq, dk_, dv_}, a.qkv, w.conv1d, sequences);
  linear_backward(dh, dw.in_proj, d_in_proj, h, w.in_proj, false);
}

void Model::Impl::attention_forward(const AttentionWeights& w, AttentionActivations& a, const TensorView& h,
                                    const TensorView& out, const LayerState* state) {
  const Config& c = config;
  const int Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
  const double scale = 1.0 / std::sqrt(double(hd));
  const bool decode = state && inference.decode;
  // Decode takes q (with its gate), k and v from one product, a launch where decode's few rows make each product
  // about one: its column blocks, which the inputs step takes as they lie, in the arena recomputed for each layer.
  // Not in batch-invariant mode, whose decode computes them as the training forward does (three products: a
  // product's summation order may follow its width), nor outside decode, whose norms see heads as rows.
  TensorView qg = a.qg, k_raw = a.k_raw, v = a.v;
  if (decode && !options.batch_invariant) {
    const std::int64_t qg_cols = std::int64_t{Hq} * 2 * hd, kv_cols = std::int64_t{Hkv} * hd;
    const TensorView qkv = recomputed.allocate(act_dtype, {T, qg_cols + 2 * kv_cols});
    linear(qkv, h, w.qkv);
    qg = col_slice(qkv, 0, qg_cols);
    k_raw = col_slice(qkv, qg_cols, qg_cols + kv_cols);
    v = col_slice(qkv, qg_cols + kv_cols, qg_cols + 2 * kv_cols);
  } else {
    linear(qg, h, w.q_proj);
    linear(k_raw, h, w.k_proj);
    linear(v, h, w.v_proj);
  }
  TensorView gate;  // the attention output's gate, as [T * Hq, hd] rows
  if (decode) {
    // The new token's query and key normed and rotated at its position, its key and value into its slot's cache,
    // the gates copied out, and its query reads the whole cache.
    gate = recomputed.allocate(act_dtype, {T, std::int64_t{Hq} * hd});
    const AttentionInputs inputs{.qg = qg,
                                 .k_raw = k_raw,
                                 .v = v,
                                 .q_norm = w.q_norm,
                                 .k_norm = w.k_norm,
                                 .q = a.q,
                                 .k = a.k,
                                 .gate = gate,
                                 .q_rstd = a.q_rstd,
                                 .k_rstd = a.k_rstd,
                                 .q_heads = Hq,
                                 .kv_heads = Hkv,
                                 .head_dim = hd,
                                 .rotary_dim = c.rotary_dim(),
                                 .theta = c.rope_theta,
                                 .eps = c.rms_norm_eps};
    ops->attention_inputs_step(inputs, inference.position_ids, state->k_cache, state->v_cache, inference.kv_dst_ids,
                               inference.kv_src_ids);
    ops->cached_attention(a.o, a.q, state->k_cache, state->v_cache, Hq, Hkv, hd, scale, sequences,
                          inference.slot_ids, inference.length_ids);
    gate = as_matrix(gate, T * Hq, hd);
  } else {
    ops->rmsnorm_forward(as_matrix(a.q, T * Hq, hd), a.q_rstd, interleaved_half(a.qg, Hq, hd, 0), w.q_norm,
                         c.rms_norm_eps, true);
    ops->rmsnorm_forward(as_matrix(a.k, T * Hkv, hd), a.k_rstd, as_matrix(a.k_raw, T * Hkv, hd), w.k_norm,
                         c.rms_norm_eps, true);
    ops->rope(a.q, Hq, hd, c.rotary_dim(), c.rope_theta, sequences, false);
    ops->rope(a.k, Hkv, hd, c.rotary_dim(), c.rope_theta, sequences, false);
    ops->attention_forward(a.o, a.lse, a.q, a.k, a.v, Hq, Hkv, hd, scale, sequences);
    if (state) store_keys_values(a, *state);
    gate = interleaved_half(a.qg, Hq, hd, 1);
  }
  ops->sigmoid_gate_forward(as_matrix(a.gated, T * Hq, hd), as_matrix(a.o, T * Hq, hd), gate);
  linear(out, a.gated, w.o_proj);
}

void Model::Impl::attention_backward(const AttentionWeights& w, const AttentionWeights& dw, AttentionActivations& a,
                                     const TensorView& h, const TensorView& dout, const TensorView& dh) {
  const Config& c = config;
  const int Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
  const TensorView d_gated = temp({T, Hq * hd});
  linear_backward(d_gated, dw.o_proj, dout, a.gated, w.o_proj, false);
  const TensorView d_o = temp({T, Hq * hd}), d_qg = temp({T, Hq * 2 * hd});
  ops->sigmoid_gate_backward(as_matrix(d_o, T * Hq, hd), interleaved_half(d_qg, Hq, hd, 1),
                             as_matrix(d_gated, T * Hq, hd), as_matrix(a.o, T * Hq, hd),
                             interleaved_half(a.qg, Hq, hd, 1));
  const TensorView dq = temp({T, Hq * hd}), dk = temp({T, Hkv * hd}), dv = temp({T, Hkv * hd});
  ops->attention_backward(dq, dk, dv, d_o, a.q, a.k, a.v, a.o, a.lse, Hq, Hkv, hd, 1.0 / std::sqrt(double(hd)),
                          sequences);
  ops->rope(dq, Hq, hd, c.rotary_dim(), c.rope_theta, sequences, true);
  ops->rope(dk, Hkv, hd, c.rotary_dim(), c.rope_theta, sequences, true);
  // The norms' backward reads their raw inputs: q inside qg, and k_raw, both kept.
  ops->rmsnorm_backward(interleaved_half(d_qg, Hq, hd, 0), dw.q_norm, as_matrix(dq, T * Hq, hd),
                        interleaved_half(a.qg, Hq, hd, 0), a.q_rstd, w.q_norm, true, false);
  const TensorView dk_raw = temp({T, Hkv * hd});
  ops->rmsnorm_backward(as_matrix(dk_raw, T * Hkv, hd), dw.k_norm, as_matrix(dk, T * Hkv, hd),
                        as_matrix(a.k_raw, T * Hkv, hd), a.k_rstd, w.k_norm, true, false);
  linear_backward(dh, dw.q_proj, d_qg, h, w.q_proj, false);
  linear_backward(dh, dw.k_proj, dk_raw, h, w.k_proj, true);
  linear_backward(dh, dw.v_proj, dv, h, w.v_proj, true);
}

void Model::Impl::layer_forward(int layer) {
  const LayerWeights& w = params.layers[layer];
  LayerActivations& a = activations(layer);
  const TensorView& x = layer_inputs[layer];
  const double eps = config.rms_norm_eps;
  const LayerState* state = inference.state ? &inference.state->layer(layer) : nullptr;
  ops->rmsnorm_forward(a.input_normed, a.input_rstd, x, w.input_norm, eps, true);
  if (w.kind == LayerKind::linear_attention) gdn_forward(w.gdn, a.gdn, a.input_normed, a.mid, state);
  else attention_forward(w.attention, a.attention, a.input_normed, a.mid, state);
  ops->add_rmsnorm_forward(a.post_normed, a.post_rstd, a.mid, x, w.post_norm, eps, true);
  linear(a.mlp_gate_up, a.post_normed, w.gate_up);
  ops->swiglu_forward(a.mlp_act, a.mlp_gate, a.mlp_up);
  const TensorView& out = layer_inputs[layer + 1];
  ops->linear(out, a.mlp_act, w.down_proj, &a.mid);  // out = down(act) + mid
}

// dx holds d loss / d (layer output) and leaves holding d loss / d (layer input).
void Model::Impl::layer_backward(int layer, const TensorView& dx) {
  // With recompute the forward runs again (rewriting layer_inputs[layer + 1] with the same values, which
  // the backward of layer + 1 has already used).
  if (options.recompute) layer_forward(layer);
  const LayerWeights& w = params.layers[layer];
  const LayerWeights& dw = grads.layers[layer];
  LayerActivations& a = options.recompute ? recompute_acts : acts[layer];
  const Config& c = config;
  scratch.reset();
  // MLP: dx is also the gradient of the residual it was added to.
  const TensorView d_act = temp({T, c.intermediate_size});
  linear_backward(d_act, dw.down_proj, dx, a.mlp_act, w.down_proj, false);
  const std::int64_t I = c.intermediate_size;
  const TensorView d_gate_up = temp({T, 2 * I});
  ops->swiglu_backward(col_slice(d_gate_up, 0, I), col_slice(d_gate_up, I, 2 * I), d_act, a.mlp_gate, a.mlp_up);
  const TensorView d_normed = temp({T, c.hidden_size});
  linear_backward(d_normed, dw.gate_up, d_gate_up, a.post_normed, w.gate_up, false);
  ops->rmsnorm_backward(dx, dw.post_norm, d_normed, a.mid, a.post_rstd, w.post_norm, true, true);
  // Mixer, whose output was added to the layer input.
  if (w.kind == LayerKind::linear_attention) {
    gdn_backward(w.gdn, dw.gdn, a.gdn, a.input_normed, dx, d_normed);
  } else {
    attention_backward(w.attention, dw.attention, a.attention, a.input_normed, dx, d_normed);
  }
  ops->rmsnorm_backward(dx, dw.input_norm, d_normed, layer_inputs[layer], a.input_rstd, w.input_norm, true, true);
}

// The loss over chunks of loss_chunk tokens; with want_grad, d_final and the lm_head's gradient are formed
// chunk by chunk too, so at most loss_chunk x vocab logits exist at once.
double Model::Impl::loss(bool want_grad) {
  const std::int64_t V = config.vocab_size;
  const std::int64_t chunk =
      std::min<std::int64_t>(options.loss_chunk > 0 ? options.loss_chunk : default_loss_chunk(options.device), T);
  scratch.reset();
  const TensorView logits = temp({chunk, V});
  const bool on_host = options.device.type == DeviceType::cpu;
  std::vector<float> staged;  // float32 values crossing to and from a GPU
  // logprobs[begin, end) from the device (on the CPU they are written there directly).
  auto fetch_logprobs = [&](std::int64_t begin, std::int64_t end) {
    if (on_host) return;
    const TensorView values = vector_slice(logprob_values, begin, end - begin);
    if (values.dtype == DType::f64) {
      copy_bytes(logprobs.data() + begin, values.data, (end - begin) * sizeof(double), options.device, options.stream);
      deltatrain::synchronize(options.device, options.stream);
      return;
    }
    staged.resize(static_cast<std::size_t>(end - begin));
    copy_bytes(staged.data(), values.data, staged.size() * sizeof(float), options.device, options.stream);
    deltatrain::synchronize(options.device, options.stream);
    std::copy(staged.begin(), staged.end(), logprobs.begin() + begin);
  };
  double total = 0;
  for (std::int64_t begin = 0; begin < T; begin += chunk) {
    const std::int64_t end = std::min(T, begin + chunk), rows = end - begin;
    const TensorView chunk_logits = row_slice(logits, 0, rows);
    const TensorView h = row_slice(final_normed, begin, end);
    const IndexArray chunk_targets = target_ids.slice(begin, rows);
    const TensorView chunk_weights = vector_slice(weight_values, begin, rows);
    const TensorView chunk_logprobs = vector_slice(logprob_values, begin, rows);
    linear(chunk_logits, h, params.lm_head);
    if (objective != nullptr) {
      // The objective's derivatives become this chunk's weights: d term / d logits = -weight * d nll / d logits.
      ops->cross_entropy(chunk_logits, chunk_targets, chunk_weights, chunk_logprobs, false);
      fetch_logprobs(begin, end);
      std::vector<double> terms(static_cast<std::size_t>(rows)), derivatives(static_cast<std::size_t>(rows));
      (*objective)(begin, std::span<const double>(logprobs).subspan(begin, rows), terms, derivatives);
      for (std::int64_t r = 0; r < rows; ++r) {
        if (!std::isfinite(terms[r]) || !std::isfinite(derivatives[r])) {
          throw InvalidArgument("objective", "gave a non-finite term or derivative at token " + std::to_string(begin + r));
        }
        total += terms[r];
        weights[begin + r] = -derivatives[r];
      }
      if (want_grad && !on_host) {
        staged.assign(weights.begin() + begin, weights.begin() + end);
        copy_bytes(chunk_weights.data, staged.data(), staged.size() * sizeof(float), options.device, options.stream);
        deltatrain::synchronize(options.device, options.stream);  // staged is reused by the next chunk
      }
      if (want_grad) ops->cross_entropy(chunk_logits, chunk_targets, chunk_weights, chunk_logprobs, true);
    } else {
      ops->cross_entropy(chunk_logits, chunk_targets, chunk_weights, chunk_logprobs, want_grad);
    }
    if (want_grad) linear_backward(row_slice(d_final, begin, end), grads.lm_head, chunk_logits, h, params.lm_head, false);
  }
  if (objective != nullptr) return total;
  fetch_logprobs(0, T);
  for (std::int64_t t = 0; t < T; ++t) total -= weights[t] * logprobs[t];
  return total;
}

// The embedding, every layer and the final norm over the loaded batch.
void Model::Impl::run_layers() {
  ops->embedding_forward(layer_inputs[0], token_ids, params.embedding);
  for (int l = 0; l < config.num_hidden_layers(); ++l) layer_forward(l);
  ops->rmsnorm_forward(final_normed, final_rstd, layer_inputs.back(), params.final_norm, config.rms_norm_eps, true);
}

double Model::forward(const Batch& batch, bool training) {
  Impl& m = *impl_;
  if (m.params.layers.empty()) throw StateError("Model::forward: bind() the parameters first");
  if (training && !m.has_grads) throw StateError("Model::forward: a training forward needs bound gradients");
  validate_batch(batch, m.config.vocab_size);
  m.trained = false;
  m.load_batch(batch, true);
  m.allocate(training);
  m.run_layers();
  const double loss = m.loss(training);
  m.trained = training;
  return loss;
}

void Model::backward() {
  Impl& m = *impl_;
  if (!m.trained) throw StateError("Model::backward: needs a training forward first (and runs once per forward)");
  m.trained = false;
  const TensorView dx = m.act({m.T, m.config.hidden_size});
  m.ops->rmsnorm_backward(dx, m.grads.final_norm, m.d_final, m.layer_inputs.back(), m.final_rstd,
                          m.params.final_norm, true, false);
  for (int l = m.config.num_hidden_layers() - 1; l >= 0; --l) m.layer_backward(l, dx);
  m.ops->embedding_backward(m.grads.embedding, m.token_ids, dx);
}

void Model::synchronize() const { deltatrain::synchronize(impl_->options.device, impl_->options.stream); }

std::span<const double> Model::token_logprobs() const { return impl_->logprobs; }

void Model::logits(const Batch& batch, const TensorView& out) {
  Impl& m = *impl_;
  const auto T = static_cast<std::int64_t>(batch.tokens.size());
  if (out.ndim != 2 || out.shape[0] != T || out.shape[1] != m.config.vocab_size || out.dtype != m.act_dtype ||
      !(out.device == m.options.device) || !out.is_contiguous()) {
    throw InvalidArgument("out", "must be a contiguous [" + std::to_string(T) + ", " +
                                     std::to_string(m.config.vocab_size) + "] " + dtype_name(m.act_dtype) +
                                     " tensor on the model's device, got " + out.shape_string() + " " +
                                     dtype_name(out.dtype));
  }
  forward(batch, false);
  m.linear(out, m.final_normed, m.params.lm_head);
  synchronize();
}

// The arguments every inference step shares: a state of this model, N distinct slots in it.
void Model::Impl::check_state(const InferenceState& state, std::span<const std::int32_t> slots,
                              std::int64_t rows) const {
  if (params.layers.empty()) throw StateError("Model: bind() the parameters before prefill or decode");
  const LayerState& first = state.layer(0);
  const TensorView& probe = config.layer_types[0] == LayerKind::linear_attention ? first.conv_state : first.k_cache;
  if (state.layers_.size() != static_cast<std::size_t>(config.num_hidden_layers()) || probe.dtype != act_dtype ||
      !(probe.device == options.device)) {
    throw InvalidArgument("state", "was not made for this model (its config and options)");
  }
  if (static_cast<std::int64_t>(slots.size()) != rows) {
    throw InvalidArgument("slots", "needs one slot per sequence (" + std::to_string(rows) + "), got " +
                                       std::to_string(slots.size()));
  }
  std::vector<bool> seen(state.slots(), false);
  for (const std::int32_t slot : slots) {
    if (slot < 0 || slot >= state.slots()) {
      throw InvalidArgument("slots", "slot " + std::to_string(slot) + " is outside [0, " +
                                         std::to_string(state.slots()) + ")");
    }
    if (seen[slot]) throw InvalidArgument("slots", "slot " + std::to_string(slot) + " appears twice");
    seen[slot] = true;
  }
}

void Model::Impl::check_logits(const TensorView& logits, std::int64_t rows) const {
  if (logits.ndim != 2 || logits.shape[0] != rows || logits.shape[1] != config.vocab_size ||
      logits.dtype != act_dtype || !(logits.device == options.device) || !logits.is_contiguous()) {
    throw InvalidArgument("logits", "must be a contiguous [" + std::to_string(rows) + ", " +
                                        std::to_string(config.vocab_size) + "] " + dtype_name(act_dtype) +
                                        " tensor on the model's device, got " + logits.shape_string() + " " +
                                        dtype_name(logits.dtype));
  }
}

// The device logits [rows, vocab] that prefill and decode into host doubles (`out`) compute before widening.
TensorView Model::Impl::stage_logits(std::int64_t rows, std::span<const double> out) {
  if (static_cast<std::int64_t>(out.size()) != rows * config.vocab_size) {
    throw InvalidArgument("logits", "must hold " + std::to_string(rows) + " x " + std::to_string(config.vocab_size) +
                                        " values, got " + std::to_string(out.size()));
  }
  staged_logits.reset();
  return staged_logits.allocate(act_dtype, {rows, config.vocab_size});
}

void Model::Impl::upload_inference() {
  InferenceStep& s = inference;
  s.sequence_index.resize(s.slots.size());
  std::iota(s.sequence_index.begin(), s.sequence_index.end(), 0);
  const IndexUpload arrays[] = {
      {&token_ids, &tokens},          {&sequences, &cu_seqlens},        {&s.slot_ids, &s.slots},
      {&s.sequence_ids, &s.sequence_index}, {&s.kv_dst_ids, &s.kv_dst}, {&s.kv_src_ids, &s.kv_src},
      {&s.conv_dst_ids, &s.conv_dst}, {&s.conv_src_ids, &s.conv_src},   {&s.last_row_ids, &s.last_rows},
      {&s.position_ids, &s.positions}, {&s.length_ids, &s.lengths}};
  upload_index_arrays(arrays);
}

// The device logits as float64 on the host.
void Model::Impl::logits_to_host(const TensorView& logits, std::span<double> out) {
  const auto n = static_cast<std::size_t>(logits.numel());
  if (options.device.type == DeviceType::cpu) {
    if (act_dtype == DType::f64) std::copy_n(logits.ptr<double>(), n, out.begin());
    else std::copy_n(logits.ptr<float>(), n, out.begin());
    return;
  }
  std::vector<std::uint16_t> bits(n);
  copy_bytes(bits.data(), logits.data, n * sizeof(std::uint16_t), options.device, options.stream);
  deltatrain::synchronize(options.device, options.stream);
  std::transform(bits.begin(), bits.end(), out.begin(), [](std::uint16_t b) { return double(bf16_to_float(b)); });
}

namespace {
// Ends an inference step however it leaves, so that no later training forward sees its state.
struct InferenceScope {
  InferenceStep& step;
  ~InferenceScope() { step.state = nullptr; }
};
}  // namespace

void Model::prefill(const Batch& prompts, std::span<const std::int32_t> slots, InferenceState& state,
                    std::span<double> logits) {
  Impl& m = *impl_;
  // An empty cu_seqlens is refused by the step itself.
  const TensorView device_logits = m.stage_logits(std::max<std::int64_t>(std::ssize(prompts.cu_seqlens) - 1, 0), logits);
  prefill(prompts, slots, state, device_logits);
  m.logits_to_host(device_logits, logits);
}

void Model::prefill(const Batch& prompts, std::span<const std::int32_t> slots, InferenceState& state,
                    const TensorView& logits) {
  Impl& m = *impl_;
  const Batch batch{prompts.tokens, prompts.cu_seqlens};
  validate_batch(batch, m.config.vocab_size);
  const std::int64_t N = std::ssize(prompts.cu_seqlens) - 1;
  m.check_state(state, slots, N);
  m.check_logits(logits, N);
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int64_t length = prompts.cu_seqlens[n + 1] - prompts.cu_seqlens[n];
    if (length < 1 || length > state.max_length()) {
      throw InvalidArgument("prompts", "sequence " + std::to_string(n) + " has " + std::to_string(length) +
                                           " tokens: a prompt needs 1 to max_length (" +
                                           std::to_string(state.max_length()) + ")");
    }
  }
  m.trained = false;
  m.load_batch(batch, false);
  InferenceStep& s = m.inference;
  s = InferenceStep{};
  s.slots.assign(slots.begin(), slots.end());
  const std::int64_t history = m.config.linear_conv_kernel_dim - 1, L = state.max_length();
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int32_t begin = prompts.cu_seqlens[n], length = prompts.cu_seqlens[n + 1] - begin, slot = slots[n];
    for (std::int32_t p = 0; p < length; ++p) {
      s.kv_dst.push_back(static_cast<std::int32_t>(slot * L + p));
      s.kv_src.push_back(begin + p);
    }
    if (length < history) s.short_slots.push_back(slot);
    for (std::int64_t j = 0; j < history; ++j) {
      const std::int64_t p = length - history + j;  // the input at row j of the history
      if (p < 0) continue;
      s.conv_dst.push_back(static_cast<std::int32_t>(slot * history + j));
      s.conv_src.push_back(static_cast<std::int32_t>(begin + p));
    }
    s.last_rows.push_back(begin + length - 1);
  }
  m.upload_inference();
  s.state = &state;
  const InferenceScope scope{s};
  m.allocate(false);
  m.run_layers();
  const TensorView last = m.act({N, m.config.hidden_size});
  m.ops->copy_rows(last, s.sequence_ids, m.final_normed, s.last_row_ids);
  m.linear(logits, last, m.params.lm_head);
  for (std::int64_t n = 0; n < N; ++n) state.lengths_[slots[n]] = prompts.cu_seqlens[n + 1] - prompts.cu_seqlens[n];
}

void Model::decode(std::span<const std::int32_t> tokens, std::span<const std::int32_t> slots, InferenceState& state,
                   std::span<double> logits) {
  Impl& m = *impl_;
  const TensorView device_logits = m.stage_logits(std::ssize(tokens), logits);
  decode(tokens, slots, state, device_logits);
  m.logits_to_host(device_logits, logits);
}

void Model::decode(const std::int32_t* device_tokens, std::span<const std::int32_t> slots, InferenceState& state,
                   const TensorView& logits) {
  if (impl_->options.device.type == DeviceType::cpu) {
    throw InvalidArgument("device_tokens", "are for a model on a GPU; this one is on the CPU");
  }
  if (device_tokens == nullptr) throw InvalidArgument("device_tokens", "must not be null");
  // Token 0 in the host's copy (checked, uploaded), replaced on the device before the step's kernels read it.
  const std::vector<std::int32_t> placeholder(slots.size(), 0);
  impl_->decode(placeholder, device_tokens, slots, state, logits);
}

void Model::decode(std::span<const std::int32_t> tokens, std::span<const std::int32_t> slots, InferenceState& state,
                   const TensorView& logits) {
  impl_->decode(tokens, nullptr, slots, state, logits);
}

void Model::Impl::decode(std::span<const std::int32_t> tokens, const std::int32_t* device_tokens,
                         std::span<const std::int32_t> slots, InferenceState& state, const TensorView& logits) {
  Impl& m = *this;
  const auto N = std::ssize(tokens);
  std::vector<std::int32_t> cu(N + 1);
  std::iota(cu.begin(), cu.end(), 0);
  validate_batch({tokens, cu}, m.config.vocab_size);
  m.check_state(state, slots, N);
  m.check_logits(logits, N);
  for (const std::int32_t slot : slots) {
    if (state.length(slot) < 1 || state.length(slot) >= state.max_length()) {
      throw InvalidArgument("slots", "slot " + std::to_string(slot) + " holds " + std::to_string(state.length(slot)) +
                                         " positions: decode needs a prefilled slot with room for one more (max_length " +
                                         std::to_string(state.max_length()) + ")");
    }
  }
  m.trained = false;
  m.load_batch({tokens, cu}, false);
  InferenceStep& s = m.inference;
  s = InferenceStep{};
  s.decode = true;
  s.slots.assign(slots.begin(), slots.end());
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int32_t position = state.length(slots[n]);
    s.positions.push_back(position);
    s.lengths.push_back(position + 1);
    s.kv_dst.push_back(static_cast<std::int32_t>(slots[n] * state.max_length() + position));
    s.kv_src.push_back(static_cast<std::int32_t>(n));
  }
  m.upload_inference();
  if (device_tokens != nullptr) {
    copy_bytes(const_cast<std::int32_t*>(m.token_ids.device), device_tokens, N * sizeof(std::int32_t),
                   m.options.device, m.options.stream);
  }
  s.state = &state;
  const InferenceScope scope{s};
  m.allocate(false);
  m.decode_step(logits);
  for (const std::int32_t slot : slots) ++state.lengths_[slot];
}

bool Model::decode_uses_cuda_graphs() const { return impl_->graphs_enabled(); }

// Everything a recorded decode step's kernels hold besides the parameters (bind() drops the graphs): the logits, the
// state's tensors and extents (a state made after another may reuse its addresses), the GDN operator's scratch on
// the stream (which a larger call elsewhere reallocates) and the arenas' generations, which with the batch size fix
// every activation's and index array's address (the same allocations in the same order each step).
std::vector<std::uintptr_t> Model::Impl::decode_bindings(const TensorView& logits) const {
  const auto address = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  const InferenceState& state = *inference.state;
  std::vector<std::uintptr_t> bindings{address(logits.data),
                                       static_cast<std::uintptr_t>(state.slots()),
                                       static_cast<std::uintptr_t>(state.max_length()),
                                       memory.generation(),
                                       recomputed.generation()};
  if (options.device.type == DeviceType::cuda) {
    bindings.push_back(address(gdn::cuda_scratch_address(options.device.index, options.stream)));
  }
  for (int l = 0; l < config.num_hidden_layers(); ++l) {
    const LayerState& layer = state.layer(l);
    for (const TensorView* v : {&layer.gdn_state, &layer.conv_state, &layer.k_cache, &layer.v_cache})
      bindings.push_back(address(v->data));
  }
  return bindings;
}

// Decode's kernels, from the embedding to the logits, with the step's index arrays already uploaded. With graphs,
// a step replays the graph of its batch size when the bindings match those it was recorded with. Otherwise its
// kernels run one by one: a first step at new bindings allocates whatever it needs (arena chunks, workspaces, the
// products' algorithms, lazily loaded kernels), none of which a recording may do, and the next step at the same
// bindings records the graph and launches it (recording runs nothing). Both run the same calls, so the same bits.
void Model::Impl::decode_step(const TensorView& logits) {
  const auto kernels = [&] {
    run_layers();
    linear(logits, final_normed, params.lm_head);
  };
  if (!graphs_enabled()) {
    kernels();
    return;
  }
  DecodeGraph& entry = decode_graphs[T];
  if (entry.bindings == decode_bindings(logits)) {
    if (!entry.graph) {
      try {
        entry.graph = StreamGraph(options.device, options.stream, kernels);
      } catch (...) {
        decode_graphs.erase(T);  // the next step at this size starts over, one by one
        throw;
      }
    }
    entry.graph.launch(options.stream);
    return;
  }
  entry.graph = StreamGraph{};  // recorded with other addresses
  kernels();
  entry.bindings = decode_bindings(logits);
}

}  // namespace deltatrain::model
