// The rollout engine on a GPU (bfloat16): batches of --batches sequences of --prompt random tokens, each generating
// exactly --new-tokens greedy tokens (no stop tokens), through rollout::Engine with every prompt admitted in one
// prefill. Parameters are HF's initialisation from a seed. Reports per batch size: the prefill's time (and that of
// the shape's first prefill, which builds its cuDNN attention graphs), decode tokens/s (the steps after the
// prefill), the cache's bytes (InferenceState::bytes) and the device memory the run
// took; and where a decode step's time goes: Model::decode into device logits alone (the engine's path), the GPU
// sampling of those logits (BatchSampler: greedy, temperature 1 with top-p 0.9, top-k 50), the former host path
// for comparison (Model::decode into host doubles, then greedy sample_token on the host), Model::decode with the
// vocabulary cut to 4096 (the layers and launches without the full vocabulary's product), and the bytes a step
// must move (weights once, each GDN state read and written, the K/V cache read) over --bandwidth-tbs as the
// roofline. Decode replays CUDA graphs (ModelOptions::cuda_graphs) unless --cuda-graphs false; each row says
// whether they were used.
//
//   rollout_benchmark [--config qwen3.5-0.8b] [--batches 64,256] [--prompt 128] [--new-tokens 256]
//                     [--decode-probe 16] [--bandwidth-tbs 4.3] [--cuda-graphs true] [--overlap-steps true]
//                     [--json FILE]
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string_view>
#include <vector>

#include "deltatrain/core/clock.h"
#include "deltatrain/core/cuda_check.h"
#include "deltatrain/model/inference.h"
#include "deltatrain/model/model.h"
#include "deltatrain/model/params.h"
#include "deltatrain/rollout/engine.h"
#include "deltatrain/rollout/sampling.h"

using namespace deltatrain;
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::size_t used_bytes() {
  std::size_t free = 0, total = 0;
  cuda_check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return total - free;
}

// The bytes one decode step of `batch` sequences at cache length `length` must move: every parameter once
// (bfloat16), each GDN state read and written (float32) and each conv history read and written, and the K/V
// cache read.
double decode_step_bytes(const model::Config& c, std::int64_t batch, std::int64_t length) {
  double bytes = 2.0 * double(model::param_count(c));
  for (int l = 0; l < c.num_hidden_layers(); ++l) {
    if (c.layer_types[l] == model::LayerKind::linear_attention) {
      bytes += 2.0 * batch * 4.0 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
      bytes += 2.0 * batch * 2.0 * (c.linear_conv_kernel_dim - 1) * c.linear_conv_dim();
    } else {
      bytes += batch * 2.0 * 2.0 * length * c.num_key_value_heads * c.head_dim;
    }
  }
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"the rollout engine on a GPU"};
  std::string config_name = "qwen3.5-0.8b", json_path, batch_list = "64,256";
  int prompt = 128, new_tokens = 256, probe_steps = 16;
  double bandwidth_tbs = 4.3;
  bool cuda_graphs = true;
  bool overlap_steps = true;
  app.add_option("--config", config_name);
  app.add_option("--batches", batch_list, "comma-separated batch sizes");
  app.add_option("--prompt", prompt, "prompt tokens per sequence");
  app.add_option("--new-tokens", new_tokens, "tokens generated per sequence");
  app.add_option("--decode-probe", probe_steps, "Model::decode steps timed alone per batch size")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--bandwidth-tbs", bandwidth_tbs, "device memory bandwidth for the roofline (H200 copy: 4.3)");
  app.add_option("--cuda-graphs", cuda_graphs, "replay decode steps from CUDA graphs");
  app.add_option("--overlap-steps", overlap_steps, "queue each decode step from the last one's device tokens");
  app.add_option("--json", json_path);
  CLI11_PARSE(app, argc, argv);

  try {
    std::vector<std::int64_t> batches;
    for (std::size_t at = 0; at < batch_list.size();) {
      const std::size_t comma = std::min(batch_list.find(',', at), batch_list.size());
      batches.push_back(std::stoll(batch_list.substr(at, comma - at)));
      at = comma + 1;
    }
    const model::Config config = model::load_config(config_name);
    const std::int64_t V = config.vocab_size;
    const Device gpu{DeviceType::cuda, 0};
    cudaStream_t stream;
    cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
    model::ParamStore host(config, DType::bf16);
    host.init(config.initializer_range, 1);
    model::DeviceParams device(host, gpu);
    device.upload(host, stream);
    const model::ModelOptions options{.device = gpu, .dtype = DType::bf16, .stream = stream, .cuda_graphs = cuda_graphs};
    const std::int64_t max_length = prompt + new_tokens - 1;
    // The probes decode 2 (probe + 2) and probe + 2 steps after the prompt, whatever --new-tokens is.
    const std::int64_t probe_length = std::max<std::int64_t>(max_length, prompt + 2 * (probe_steps + 2));

    nlohmann::ordered_json rows = nlohmann::json::array();
    for (const std::int64_t B : batches) {
      std::mt19937 rng(static_cast<unsigned>(B));
      std::uniform_int_distribution<std::int32_t> token(0, static_cast<std::int32_t>(V - 1));
      std::vector<rollout::Request> requests(B);
      for (std::int64_t i = 0; i < B; ++i) {
        requests[i].id = static_cast<std::uint64_t>(i);
        requests[i].prompt.resize(prompt);
        for (auto& t : requests[i].prompt) t = token(rng);
        requests[i].max_new_tokens = new_tokens;
        requests[i].sampling.temperature = 0;  // greedy, as transformers' generate is run beside it
      }

      // The engine: the first step admits every prompt (one packed prefill, which draws each first token); every
      // later step decodes one token for each sequence. The same prompts run once before as one-token requests,
      // so that the timed prefill is not the shape's first (which builds cuDNN's attention graphs for it: timed
      // apart as prefill_first_s).
      const std::size_t used_before = used_bytes();
      double prefill_first_s = 0, prefill_s = 0, decode_s = 0;
      std::int64_t decode_tokens = 0, steps = 0;
      std::vector<double> step_s;
      std::size_t used_engine = 0, used_peak = 0;
      {
        rollout::Engine engine(config, options, device.params(),
                               {.max_batch = B, .max_length = max_length, .max_prefill_tokens = B * prompt,
                                .overlap_steps = overlap_steps});
        used_engine = used_bytes();
        for (rollout::Request r : requests) {
          r.max_new_tokens = 1;
          engine.submit(r);
        }
        auto start = Clock::now();
        while (!engine.idle()) engine.step();
        prefill_first_s = seconds_since(start);
        engine.take_finished();
        for (const rollout::Request& r : requests) engine.submit(r);
        start = Clock::now();
        engine.step();
        prefill_s = seconds_since(start);
        // Every step after the prefill is timed: with overlap_steps the first only queues a decode (its tokens are
        // accepted by the next), without it the last only retires. The mean is over the steps that accepted tokens.
        while (!engine.idle()) {
          start = Clock::now();
          const std::int64_t generated = engine.step();
          const double s = seconds_since(start);
          decode_s += s;
          decode_tokens += generated;
          if (generated == 0) continue;
          step_s.push_back(s);
          ++steps;
        }
        used_peak = used_bytes();
        const std::vector<rollout::Completion> done = engine.take_finished();
        std::int64_t complete = 0;
        for (const rollout::Completion& c : done) complete += std::ssize(c.tokens) == new_tokens;
        if (complete != B)
          throw std::runtime_error(std::to_string(B - complete) + " sequences did not get all their tokens");
      }

      // Model::decode alone on the same batch (prefilled prompts) into device logits, the GPU sampling of them in
      // three modes, and the former host path: decode into host doubles, then greedy sampling on the host.
      std::vector<std::int32_t> tokens, cu{0}, slots(B), next(B);
      for (std::int64_t i = 0; i < B; ++i) {
        tokens.insert(tokens.end(), requests[i].prompt.begin(), requests[i].prompt.end());
        cu.push_back(static_cast<std::int32_t>(tokens.size()));
      }
      std::iota(slots.begin(), slots.end(), 0);
      const std::vector<rollout::SamplingParams> modes{
          {.temperature = 0}, {.temperature = 1.0, .top_p = 0.9}, {.temperature = 1.0, .top_k = 50}};
      std::vector<double> model_decode_s, host_decode_s, host_greedy_s;
      std::vector<std::vector<double>> gpu_sampling_s(modes.size());
      bool graphs_used = false;
      {  // freed before the next probe: a prefill of B x prompt tokens keeps every layer's activations
        model::Model m(config, options);
        m.bind(device.params());
        graphs_used = m.decode_uses_cuda_graphs();
        model::InferenceState state(config, options, B, probe_length);
        void* device_logits = nullptr;
        cuda_check(cudaMalloc(&device_logits, B * V * sizeof(std::uint16_t)), "cudaMalloc");
        const TensorView logits = TensorView::contiguous(device_logits, DType::bf16, {B, V}, gpu);
        std::vector<double> host_logits(B * V);
        m.prefill({tokens, cu}, slots, state, logits);
        rollout::BatchSampler sampler;
        std::vector<rollout::RowSampling> draws(B);
        std::vector<std::int32_t> scratch;
        // The device path's steps, then the host path's, each after two warm-up steps: a CUDA graph is recorded per
        // logits buffer, so alternating the two paths would run every step one kernel at a time.
        for (int s = 0; s < 2 * (probe_steps + 2); ++s) {
          for (std::int64_t i = 0; i < B; ++i) next[i] = token(rng);
          const bool host_path = s >= probe_steps + 2;
          const bool timed = s % (probe_steps + 2) >= 2;
          auto start = Clock::now();
          if (host_path) {
            m.decode(next, slots, state, host_logits);
            const double decode = seconds_since(start);
            start = Clock::now();
            for (std::int64_t i = 0; i < B; ++i)
              rollout::sample_token(std::span<const double>(host_logits).subspan(i * V, V), {.temperature = 0}, 0.5,
                                    false, scratch);
            if (timed) host_decode_s.push_back(decode), host_greedy_s.push_back(seconds_since(start));
            continue;
          }
          m.decode(next, slots, state, logits);
          cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
          const double decode = seconds_since(start);
          if (timed) model_decode_s.push_back(decode);
          for (std::size_t mode = 0; mode < modes.size(); ++mode) {
            for (std::int64_t i = 0; i < B; ++i) draws[i] = {modes[mode], rollout::uniform(7, i, s), false};
            start = Clock::now();
            sampler.sample(logits, draws, stream);
            if (timed) gpu_sampling_s[mode].push_back(seconds_since(start));
          }
        }
        cuda_check(cudaFree(device_logits), "cudaFree");
      }

      // The same decode with the vocabulary cut to its first kProbeVocab rows (the tied embedding's prefix, so the
      // same weights): the layers, the final norm and the launches, without the full vocabulary's logits on the host.
      constexpr std::int64_t kProbeVocab = 4096;
      model::Config small = config;
      small.vocab_size = kProbeVocab;
      const model::TensorLookup full = device.params();
      model::Model layers(small, options);
      layers.bind([&](std::string_view name) {
        TensorView v = full(name);
        if (name == "model.embed_tokens.weight") v.shape[0] = kProbeVocab;
        return v;
      });
      model::InferenceState small_state(small, options, B, probe_length);
      for (auto& t : tokens) t %= kProbeVocab;
      std::vector<double> small_logits(B * kProbeVocab);
      layers.prefill({tokens, cu}, slots, small_state, small_logits);
      std::vector<double> layers_decode_s;
      for (int s = 0; s < probe_steps + 2; ++s) {
        for (std::int64_t i = 0; i < B; ++i) next[i] = token(rng) % kProbeVocab;
        const auto start = Clock::now();
        layers.decode(next, slots, small_state, small_logits);
        if (s >= 2) layers_decode_s.push_back(seconds_since(start));
      }

      const double step = decode_s / double(std::max<std::int64_t>(steps, 1));
      const double mean_length = prompt + new_tokens / 2.0;
      const double roofline_s =
          decode_step_bytes(config, B, static_cast<std::int64_t>(mean_length)) / (bandwidth_tbs * 1e12);
      nlohmann::ordered_json row = {
          {"batch", B},
          {"cuda_graphs", graphs_used},
          {"overlap_steps", overlap_steps},
          {"prompt", prompt},
          {"new_tokens", new_tokens},
          {"prefill_first_s", prefill_first_s},
          {"prefill_s", prefill_s},
          {"prefill_tokens_per_s", double(B * prompt) / prefill_s},
          {"decode_tokens", decode_tokens},
          {"decode_steps", steps},
          {"decode_s", decode_s},
          {"decode_tokens_per_s", double(decode_tokens) / decode_s},
          {"engine_step_ms_mean", 1e3 * step},
          {"engine_step_ms_median", 1e3 * median(step_s)},
          {"model_decode_ms", 1e3 * median(model_decode_s)},
          {"gpu_sampling_greedy_ms", 1e3 * median(gpu_sampling_s[0])},
          {"gpu_sampling_top_p_ms", 1e3 * median(gpu_sampling_s[1])},
          {"gpu_sampling_top_k_ms", 1e3 * median(gpu_sampling_s[2])},
          {"host_path_decode_ms", 1e3 * median(host_decode_s)},
          {"host_path_greedy_sampling_ms", 1e3 * median(host_greedy_s)},
          {"layers_decode_ms", 1e3 * median(layers_decode_s)},
          {"roofline_step_ms", 1e3 * roofline_s},
          {"roofline_tokens_per_s", double(B) / roofline_s},
          {"cache_bytes", model::InferenceState::bytes(config, options, B, max_length)},
          {"engine_memory_gib", double(used_engine - used_before) / (1ull << 30)},
          {"run_peak_memory_gib", double(used_peak - used_before) / (1ull << 30)},
      };
      std::printf("%s\n", row.dump().c_str());
      std::fflush(stdout);
      rows.push_back(row);
    }
    cudaDeviceProp prop{};
    cuda_check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    const nlohmann::ordered_json out = {{"gpu", prop.name}, {"config", config_name}, {"rows", rows}};
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(1) << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rollout_benchmark: %s\n", e.what());
    return 1;
  }
  return 0;
}
