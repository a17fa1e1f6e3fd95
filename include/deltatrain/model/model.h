// The hybrid GDN language model: forward to the next-token loss, and the backward to every parameter.
//
//   model::Model m(config, {.device = {}, .dtype = DType::f32});
//   m.bind(store.params(), store.grads());          // or the optimizer's flat buffers
//   double loss = m.forward(batch);                  // sum over tokens of weight * -log p(target)
//   m.backward();                                    // accumulates into the bound gradients
//   m.prefill(prompts, slots, state, logits);        // rollout: prompts into cache slots (inference.h)
//   m.decode(tokens, slots, state, logits);          // one token per slot (logits: on the device, or host doubles);
//                                                    // on a GPU replayed from a CUDA graph per batch size
//
// The batch is packed: B = 1, the sequences one after another with cu_seqlens, as the GDN operator takes
// them. Nothing mixes tokens across sequences (convolution, GDN state, attention, RoPE positions).
//
// One step of the model is written once (model.cpp) over the Ops interface; the device decides which
// kernels run. The loss is computed in chunks of tokens, so the logits of the whole batch never exist at
// once (a 248k vocabulary makes them 32 GB for 32k tokens in float32); in a training forward each chunk's
// gradient is formed right away, so backward() does not compute the logits again.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "deltatrain/core/allocator.h"
#include "deltatrain/core/tensor.h"
#include "deltatrain/model/config.h"
#include "deltatrain/model/params.h"

namespace deltatrain::model {

class InferenceState;

struct ModelOptions {
  Device device{};  // the CPU, or a CUDA GPU
  // Parameters and activations: float32 or float64 on the CPU (everything in that dtype); bfloat16 on a
  // GPU, with float32 statistics (norms, softmax), gates and parameter gradients, and float32 accumulation.
  DType dtype = DType::f32;
  int cpu_threads = 0;             // CPU: 0 = all available
  void* stream = nullptr;          // GPU: the cudaStream_t every kernel and copy of the model runs on
  // Tokens per chunk of the loss (logits of loss_chunk x vocab exist at once); 0: default_loss_chunk(device).
  std::int64_t loss_chunk = 0;
  bool recompute = false;          // keep only each layer's input; recompute the layer in the backward
  // Where activations (and an InferenceState's caches) are allocated; null: plain device memory. Its
  // device must be `device`. It must outlive the model.
  Allocator* memory = nullptr;
  // Every token's logits a function of its own sequence's prefix alone, computed the same way whatever the
  // batch, the prefix's length or the path (training forward, prefill, decode): products whose rows do not
  // depend on the other rows (CPU: row by row in a fixed order; GPU: one cuBLASLt algorithm for every row count,
  // none that splits K), the GDN recurrence token by token everywhere (its backward stays chunked), attention by
  // decode's kernel (GPU), log-probabilities by one float64 formula shared with the rollout's sampler, and the
  // rest row-wise already. A rollout and a trainer both in this mode agree on every log-probability bit for bit
  // (RL's true on-policy), at several times the cost of the products on the CPU.
  bool batch_invariant = false;
  // GPU: decode replays a CUDA graph of its kernels (one launch for the hundreds of a step), recorded per batch
  // size on `stream`, with the same logits bit for bit. A graph cannot be recorded from the legacy default stream:
  // with stream = nullptr decode runs its kernels one by one (give the model a stream to have graphs). Ignored on
  // the CPU.
  bool cuda_graphs = true;
};

// The loss chunk a model takes unless told: 1024 tokens on the CPU; 8192 on a GPU, where the lm_head's weight-
// gradient product (its inner dimension is the chunk) reads and writes its float32 accumulator (vocab x hidden,
// 1 GB at Qwen3.5's vocabulary) once per chunk: the 0.8B step at 8 x 4096 tokens took 348 ms at 8192 against
// 355-359 at 4096 and 353-355 at 16384 (bench/NOTES.md, Model). The price is the logits: 4 GB of bfloat16 at that
// vocabulary (1.9 GiB more than 4096 in that step).
std::int64_t default_loss_chunk(const Device& device);

// The dtype of the gradients a model with these options accumulates into (the parameters' on the CPU,
// float32 on a GPU).
DType gradient_dtype(const ModelOptions& options);

// An objective of the targets' log-probabilities that is not a weighted NLL (GRPO's clipped ratio, a KL to a
// reference policy): loss = sum_t term_t(logp_t). The forward calls it chunk by chunk, in token order, with the
// log-probabilities of tokens [begin, begin + logprobs.size()) (0 where the target is -1), before it forms
// that chunk's gradient; it writes each token's term and d term / d logp (0 and 0 where the target is -1).
using TokenObjective = std::function<void(std::int64_t begin, std::span<const double> logprobs,
                                          std::span<double> terms, std::span<double> derivatives)>;

// Host memory. tokens [T]; cu_seqlens [N + 1] from 0 to T, non-decreasing. targets [T] (-1: no loss at
// that position): default the next token of the same sequence (the last token of each sequence has none).
// weights [T]: each token's weight in the loss; default 1 / (number of tokens with a target), the mean.
struct Batch {
  std::span<const std::int32_t> tokens;
  std::span<const std::int32_t> cu_seqlens;
  std::span<const std::int32_t> targets = {};
  std::span<const double> weights = {};
  const TokenObjective* objective = nullptr;  // instead of the weighted NLL (then weights must be empty)
};

class Model {
 public:
  Model(const Config& config, const ModelOptions& options = {});
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const Config& config() const;
  const ModelOptions& options() const;

  // Resolves every parameter (options.dtype) and gradient (gradient_dtype(options)) by name once;
  // InvalidArgument naming a tensor that has the wrong shape, dtype or device. grads may be empty for a
  // model that only runs forward.
  void bind(const TensorLookup& params, const TensorLookup& grads = {});

  // The loss sum_t weights[t] * -log p(targets[t] | tokens[<= t]) over the batch. With `training` the
  // activations the backward needs are kept and the loss's gradient is formed.
  double forward(const Batch& batch, bool training = true);
  // After a training forward: adds d loss / d parameter to the bound gradients. (The lm_head's share is
  // added during the forward, chunk by chunk, with the loss's gradient.)
  void backward();
  // Returns once the model's queued device work (on options.stream) has finished; nothing to wait for on a CPU.
  void synchronize() const;

  // log p(targets[t]) per token (0 where the target is -1), from the last forward.
  std::span<const double> token_logprobs() const;
  // Full logits [T, vocab] of a batch in the model's dtype, on its device (for checks and small models:
  // T x vocab memory).
  void logits(const Batch& batch, const TensorView& out);

  // Inference (rollout) through the same layers, with the state of each sequence kept in a slot of `state`
  // (inference.h). The logits [N, vocab] go to a contiguous tensor of the model's dtype on its device that the
  // caller owns (written on options.stream and not waited for: a GPU sampler reads them there), or come back
  // to the host in float64 (the same step into a device buffer, then copied and widened).
  //
  // prefill: each sequence n of `prompts` (packed as a Batch; targets and weights are ignored) runs from an
  // empty state into slot slots[n], replacing what the slot held; writes the logits of its last token.
  // InvalidArgument: an empty prompt, one longer than the state's max_length, a slot out of range or repeated.
  void prefill(const Batch& prompts, std::span<const std::int32_t> slots, InferenceState& state,
               const TensorView& logits);
  void prefill(const Batch& prompts, std::span<const std::int32_t> slots, InferenceState& state,
               std::span<double> logits);
  // decode: appends tokens[n] to slot slots[n] (at position state.length(slot)) and writes the next logits.
  // InvalidArgument: a token outside the vocabulary, an empty or full slot, a slot out of range or repeated.
  void decode(std::span<const std::int32_t> tokens, std::span<const std::int32_t> slots, InferenceState& state,
              const TensorView& logits);
  void decode(std::span<const std::int32_t> tokens, std::span<const std::int32_t> slots, InferenceState& state,
              std::span<double> logits);
  // decode with the tokens already on the model's GPU (int32 [slots.size()], in the vocabulary, written by work
  // queued earlier on the model's stream: a sampler's device tokens), so that the step is queued before the host
  // has them. InvalidArgument naming "device_tokens" on the CPU or for null.
  void decode(const std::int32_t* device_tokens, std::span<const std::int32_t> slots, InferenceState& state,
              const TensorView& logits);
  // Whether decode replays CUDA graphs: options.cuda_graphs on a GPU with a stream other than the legacy default.
  // A step whose batch size comes with new buffers (logits, state, grown activation memory) runs its kernels one by
  // one, the next such step records the graph, and later ones replay it; bind() drops the graphs.
  bool decode_uses_cuda_graphs() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Targets and weights as Batch's defaults define them, for callers that want to see or change them.
std::vector<std::int32_t> next_token_targets(std::span<const std::int32_t> tokens,
                                             std::span<const std::int32_t> cu_seqlens);

// InvalidArgument naming the argument: token ids outside [0, vocab), bad cu_seqlens, sizes that disagree.
void validate_batch(const Batch& batch, std::int64_t vocab_size);

}  // namespace deltatrain::model
