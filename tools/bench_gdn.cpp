// `deltatrain bench gdn`: times the GDN operator's passes on random inputs and sets the effective rate
// beside this machine's single-precision matrix-product rate (BLAS sgemm), measured in the same run.
//
// Effective GFLOP/s uses the FLOP model of docs/gdn-algorithm.md §6 (dense, as fla executes it, chunk C = 64),
// per token and value head: forward 2(3CK + 2CV + 3KV) + (2/3)C^2, backward 18CK + 10CV + 16KV + 4C^2
// (183 and 508 KFLOP at K = V = 128). A backend that does less work than the model can exceed sgemm.
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"
#include "deltatrain/gdn/backend.h"
#include "deltatrain/gdn/gdn.h"
#include "describe.h"

#ifdef DELTATRAIN_WITH_CUDA
#include <cuda_runtime_api.h>

#include "deltatrain/core/cuda_check.h"
#endif

// OpenBLAS reports its kernel choice; weak, so that another BLAS links too.
extern "C" char* openblas_get_corename(void) __attribute__((weak));
extern "C" int openblas_get_num_threads(void) __attribute__((weak));

namespace deltatrain::tools {
namespace {

constexpr double kChunk = 64;

enum class Pass { forward, backward };

double model_flops_per_token(Pass pass, double K, double V) {
  const double C = kChunk;
  return pass == Pass::forward ? 2 * (3 * C * K + 2 * C * V + 3 * K * V) + 2.0 / 3.0 * C * C
                               : 18 * C * K + 10 * C * V + 16 * K * V + 4 * C * C;
}

struct Heads {
  std::int64_t H = 0, HV = 0;
  std::string text;
};

// "16/32" (q/k heads / value heads) or "32" (as many of each).
Heads parse_heads(const std::string& text) {
  Heads heads{0, 0, text};
  const auto slash = text.find('/');
  try {
    std::size_t used = 0;
    heads.H = std::stoll(text.substr(0, slash), &used);
    if (used != (slash == std::string::npos ? text.size() : slash)) throw std::invalid_argument(text);
    heads.HV = slash == std::string::npos ? heads.H : std::stoll(text.substr(slash + 1), &used);
    if (slash != std::string::npos && used != text.size() - slash - 1) throw std::invalid_argument(text);
  } catch (const std::logic_error&) {
    throw InvalidArgument("--heads", "expected H/HV such as 16/32, got '" + text + "'");
  }
  if (heads.H < 1 || heads.HV < heads.H || heads.HV % heads.H != 0) {
    throw InvalidArgument("--heads", "HV must be a positive multiple of H, got '" + text + "'");
  }
  return heads;
}

struct Sequences {
  std::vector<std::int64_t> lengths;
  std::string text;
  std::int64_t tokens() const {
    std::int64_t total = 0;
    for (std::int64_t length : lengths) total += length;
    return total;
  }
};

// "4x2048" (N sequences of T tokens) or "1500+700+1100" (packed lengths).
Sequences parse_seqlens(const std::string& text) {
  Sequences seqs{{}, text};
  const auto fail = [&] {
    return InvalidArgument("--seqlens", "expected NxT such as 4x2048, or lengths such as 1500+700, got '" + text + "'");
  };
  const auto number = [&](const std::string& part, long long least) {
    std::size_t used = 0;
    long long value = 0;
    try {
      value = std::stoll(part, &used);
    } catch (const std::logic_error&) {
      throw fail();
    }
    if (used != part.size() || value < least) throw fail();
    return static_cast<std::int64_t>(value);
  };
  if (const auto x = text.find('x'); x != std::string::npos) {
    seqs.lengths.assign(number(text.substr(0, x), 1), number(text.substr(x + 1), 1));
    return seqs;
  }
  for (std::size_t begin = 0; begin <= text.size();) {
    const std::size_t plus = std::min(text.find('+', begin), text.size());
    seqs.lengths.push_back(number(text.substr(begin, plus - begin), 0));  // empty sequences are allowed
    begin = plus + 1;
  }
  if (seqs.tokens() == 0) throw fail();
  return seqs;
}

// A tensor of random values (or zeros) on the host, mirrored on the benchmark's GPU when there is one.
class Buffer {
 public:
  Buffer(std::initializer_list<std::int64_t> shape, DType dtype, Device device)
      : layout_(TensorView::contiguous(nullptr, dtype, shape, device)), host_(layout_.nbytes(), 0) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
#ifdef DELTATRAIN_WITH_CUDA
    if (device_memory_) cudaFree(device_memory_);
#endif
  }

  template <class T, class Distribution>
  Buffer& fill(std::mt19937& rng, Distribution distribution) {
    T* values = reinterpret_cast<T*>(host_.data());
    for (std::size_t i = 0; i < host_.size() / sizeof(T); ++i) values[i] = static_cast<T>(distribution(rng));
    return upload();
  }

  TensorView view() {
    TensorView view = layout_;
    view.data = layout_.device.type == DeviceType::cpu ? static_cast<void*>(host_.data()) : device_memory_;
    return view;
  }
  TensorView host_view() {
    TensorView view = layout_;
    view.data = host_.data();
    view.device = Device{};
    return view;
  }

  Buffer& upload() {
    if (layout_.device.type == DeviceType::cpu) return *this;
#ifdef DELTATRAIN_WITH_CUDA
    cuda_check(device_memory_ ? cudaSuccess : cudaMalloc(&device_memory_, host_.size()), "cudaMalloc");
    cuda_check(cudaMemcpy(device_memory_, host_.data(), host_.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
#endif
    return *this;
  }

 private:
  TensorView layout_;  // shape, strides, dtype and device; data is set per view
  std::vector<std::uint8_t> host_;
  void* device_memory_ = nullptr;
};

void synchronize(Device device) {
#ifdef DELTATRAIN_WITH_CUDA
  if (device.type == DeviceType::cuda) {
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
#endif
}

struct Settings {
  std::string backend = "auto";
  std::vector<std::string> heads{"16/32"};
  std::vector<std::string> seqlens{"4x2048"};
  std::vector<std::string> passes{"fwd", "bwd"};
  std::int64_t dim = 128;
  int repeat = 3;
  int threads = 0;
  bool l2norm = true;
  std::string device = "auto";
  int sgemm_size = 2048;
  bool json = false;
};

Device device_of(const Settings& s) {
  const bool host_backend = s.backend == "cpu" || s.backend == "reference";
  if (s.device == "cpu" || (s.device == "auto" && (host_backend || !cuda_info().usable()))) return Device{};
  if (s.device == "cuda" || s.device == "auto") {
    if (!cuda_info().usable()) throw Unavailable("--device cuda", cuda_info().unavailable_reason);
    return Device{DeviceType::cuda, 0};
  }
  throw InvalidArgument("--device", "expected auto, cpu or cuda, got '" + s.device + "'");
}

// Seconds per call: the median of `repeat` timed calls after one untimed warm-up call.
template <class Run>
std::pair<double, double> time_calls(const Run& run, int repeat, Device device) {
  run();
  synchronize(device);
  std::vector<double> seconds;
  for (int i = 0; i < repeat; ++i) {
    const auto start = std::chrono::steady_clock::now();
    run();
    synchronize(device);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  return {seconds[seconds.size() / 2], seconds.front()};
}

nlohmann::json measure_sgemm(int n, int repeat) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1, 1);
  std::vector<float> a(static_cast<std::size_t>(n) * n), b(a.size()), c(a.size());
  for (float& x : a) x = uniform(rng);
  for (float& x : b) x = uniform(rng);
  const auto run = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  };
  const auto [median, best] = time_calls(run, repeat, Device{});
  const double flops = 2.0 * n * n * n;
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  return {{"size", n},
          {"repeat", repeat},
          {"best_ms", best * 1e3},
          {"median_ms", median * 1e3},
          {"gflops", flops / best / 1e9},
          {"blas_core", openblas_get_corename ? openblas_get_corename() : "unknown (not OpenBLAS)"},
          {"blas_threads", openblas_get_num_threads ? openblas_get_num_threads() : 0},
          {"OPENBLAS_CORETYPE", coretype ? coretype : ""}};
}

struct Case {
  Heads heads;
  Sequences seqs;
};

std::vector<nlohmann::json> measure_case(const Settings& s, const Case& c, const std::vector<Pass>& passes,
                                         Device device, std::mt19937& rng) {
  const std::int64_t T = c.seqs.tokens(), H = c.heads.H, HV = c.heads.HV, K = s.dim, V = s.dim;
  std::normal_distribution<double> normal(0, 1);
  Buffer q({1, T, H, K}, DType::f32, device), k({1, T, H, K}, DType::f32, device), v({1, T, HV, V}, DType::f32, device);
  Buffer g({1, T, HV}, DType::f32, device), beta({1, T, HV}, DType::f32, device);
  q.fill<float>(rng, normal), k.fill<float>(rng, normal), v.fill<float>(rng, normal);
  // Qwen-like gates: g = -exp(A_log) softplus(...) lands mostly in [-2, 0); beta = sigmoid(...) in (0, 1).
  g.fill<float>(rng, std::uniform_real_distribution<double>(-2.0, -0.01));
  beta.fill<float>(rng, std::uniform_real_distribution<double>(0.02, 0.98));
  Buffer cu({static_cast<std::int64_t>(c.seqs.lengths.size()) + 1}, DType::i32, device);
  {
    std::int32_t* offsets = cu.host_view().ptr<std::int32_t>();
    offsets[0] = 0;
    for (std::size_t n = 0; n < c.seqs.lengths.size(); ++n) offsets[n + 1] = offsets[n] + static_cast<std::int32_t>(c.seqs.lengths[n]);
    cu.upload();
  }
  Buffer o({1, T, HV, V}, DType::f32, device);
  const gdn::Inputs in{q.view(), k.view(), v.view(), g.view(), beta.view(), std::nullopt, cu.view(), cu.host_view()};
  gdn::Options options;
  options.backend = s.backend;
  options.use_qk_l2norm_in_kernel = s.l2norm;
  options.cpu_threads = s.threads;

  std::vector<nlohmann::json> rows;
  for (const Pass pass : passes) {
    const bool backward = pass == Pass::backward;
    const std::string name = gdn::resolve_backend(in, options, backward);
    std::fprintf(stderr, "bench gdn: %s %s %s %s (%d timed calls)...\n", name.c_str(), c.heads.text.c_str(),
                 c.seqs.text.c_str(), backward ? "bwd" : "fwd", s.repeat);
    std::pair<double, double> seconds;
    if (!backward) {
      seconds = time_calls([&] { gdn::chunk_forward(in, {o.view(), std::nullopt}, options); }, s.repeat, device);
    } else {
      Buffer d_o({1, T, HV, V}, DType::f32, device), dq({1, T, H, K}, DType::f32, device),
          dk({1, T, H, K}, DType::f32, device), dv({1, T, HV, V}, DType::f32, device),
          dg({1, T, HV}, DType::f32, device), dbeta({1, T, HV}, DType::f32, device);
      d_o.fill<float>(rng, normal);
      for (Buffer* out : {&dq, &dk, &dv, &dg, &dbeta}) out->upload();
      const gdn::Gradients grads{dq.view(), dk.view(), dv.view(), dg.view(), dbeta.view(), std::nullopt};
      seconds = time_calls([&] { gdn::chunk_backward(in, {d_o.view(), std::nullopt}, grads, options); }, s.repeat,
                           device);
    }
    const double flops = model_flops_per_token(pass, K, V) * T * HV;
    rows.push_back({{"backend", name},
                    {"heads", c.heads.text},
                    {"seqlens", c.seqs.text},
                    {"tokens", T},
                    {"pass", backward ? "bwd" : "fwd"},
                    {"median_ms", seconds.first * 1e3},
                    {"best_ms", seconds.second * 1e3},
                    {"tokens_per_s", T / seconds.first},
                    {"model_gflop", flops / 1e9},
                    {"effective_gflops", flops / seconds.first / 1e9}});
  }
  return rows;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return text;
}

void run_bench(const Settings& s) {
  if (s.dim < 1) throw InvalidArgument("--dim", "must be positive, got " + std::to_string(s.dim));
  if (s.repeat < 1) throw InvalidArgument("--repeat", "must be at least 1, got " + std::to_string(s.repeat));
  gdn::check_cpu_threads(s.threads);  // the operator's own rule, checked before the sgemm reference runs, not after
  std::vector<Pass> passes;
  for (const std::string& pass : s.passes) {
    if (pass != "fwd" && pass != "bwd" && pass != "both") {
      throw InvalidArgument("--pass", "expected fwd, bwd or both, got '" + pass + "'");
    }
    if (pass != "bwd") passes.push_back(Pass::forward);
    if (pass != "fwd") passes.push_back(Pass::backward);
  }
  std::vector<Case> cases;
  for (const std::string& heads : s.heads) {
    for (const std::string& seqlens : s.seqlens) cases.push_back({parse_heads(heads), parse_seqlens(seqlens)});
  }
  const Device device = device_of(s);
  for (const Case& c : cases) {  // float q and k of H heads, v and the output of HV heads, tokens x heads x dim
    const double floats_per_token = 2.0 * static_cast<double>(c.heads.H + c.heads.HV) * s.dim;
    const double bytes = 4.0 * static_cast<double>(c.seqs.tokens()) * floats_per_token;
    const std::string what = "q, k, v and o of " + c.seqs.text + " at " + std::to_string(c.heads.H) + "/" +
                             std::to_string(c.heads.HV) + " heads";
    // A Buffer keeps its host copy beside the GPU's: the host holds the tensors on either device.
    check_fits_in_memory("--seqlens", bytes, what, Device{});
    if (device.type != DeviceType::cpu) check_fits_in_memory("--seqlens", bytes, what, device);
  }

  nlohmann::json sgemm = nullptr;
  if (s.sgemm_size > 0) {
    std::fprintf(stderr, "bench gdn: sgemm %d^3 on all cores...\n", s.sgemm_size);
    sgemm = measure_sgemm(s.sgemm_size, s.repeat);
  }
  std::mt19937 rng(2024);
  nlohmann::json results = nlohmann::json::array();
  for (const Case& c : cases) {
    for (nlohmann::json& row : measure_case(s, c, passes, device, rng)) {
      if (!sgemm.is_null()) row["of_sgemm"] = row["effective_gflops"].get<double>() / sgemm["gflops"].get<double>();
      results.push_back(std::move(row));
    }
  }

  if (s.json) {
    const nlohmann::json report = {
        {"date", utc_now()},
        {"machine", describe_build_and_machine()},
        {"settings",
         {{"backend", s.backend}, {"dim", s.dim}, {"repeat", s.repeat}, {"threads", s.threads},
          {"use_qk_l2norm_in_kernel", s.l2norm}, {"dtype", "float32"}, {"device", device_name(device)},
          {"timing", "median of repeat calls after one warm-up call"}}},
        {"flop_model", "docs/gdn-algorithm.md §6 per token per value head, C=64: fwd 2(3CK+2CV+3KV)+(2/3)C^2, "
                       "bwd 18CK+10CV+16KV+4C^2"},
        {"sgemm", sgemm},
        {"results", results}};
    std::printf("%s\n", report.dump(2).c_str());
    return;
  }
  if (!sgemm.is_null()) {
    std::printf("sgemm %d^3: %.1f GFLOP/s (best of %d; BLAS core %s, %d threads)\n", s.sgemm_size,
                sgemm["gflops"].get<double>(), s.repeat, sgemm["blas_core"].get<std::string>().c_str(),
                sgemm["blas_threads"].get<int>());
    if (const std::string forced = sgemm["OPENBLAS_CORETYPE"].get<std::string>(); !forced.empty()) {
      // A forced kernel choice can understate the machine's rate (Haswell kernels halve it on AVX-512 CPUs).
      std::printf("note: OPENBLAS_CORETYPE=%s forces OpenBLAS's kernels; for the machine's own rate run with "
                  "`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE`\n",
                  forced.c_str());
    }
  }
  std::printf("%-10s %-7s %-14s %-4s %10s %12s %9s %9s\n", "backend", "heads", "seqlens", "pass", "ms", "tokens/s",
              "GFLOP/s", "of sgemm");
  for (const auto& row : results) {
    char of_sgemm[16] = "-";
    if (row.contains("of_sgemm")) std::snprintf(of_sgemm, sizeof of_sgemm, "%.2f", row["of_sgemm"].get<double>());
    std::printf("%-10s %-7s %-14s %-4s %10.2f %12.0f %9.1f %9s\n", row["backend"].get<std::string>().c_str(),
                row["heads"].get<std::string>().c_str(), row["seqlens"].get<std::string>().c_str(),
                row["pass"].get<std::string>().c_str(), row["median_ms"].get<double>(),
                row["tokens_per_s"].get<double>(), row["effective_gflops"].get<double>(), of_sgemm);
  }
}

}  // namespace

void add_bench_gdn_command(CLI::App& bench) {
  auto s = std::make_shared<Settings>();
  CLI::App* gdn = bench.add_subcommand("gdn", "time the GDN operator's forward and backward beside the sgemm rate");
  gdn->add_option("--backend", s->backend, "backend name, or auto")->capture_default_str();
  gdn->add_option("--heads", s->heads, "q/k heads / value heads, e.g. 16/32 (repeatable or comma list)")
      ->delimiter(',')
      ->capture_default_str();
  gdn->add_option("--seqlens", s->seqlens, "packed sequences: NxT (e.g. 4x2048) or lengths (1500+700+1100)")
      ->delimiter(',')
      ->capture_default_str();
  gdn->add_option("--dim", s->dim, "head dimension K = V")->capture_default_str();
  gdn->add_option("--pass", s->passes, "fwd, bwd or both (fwd,bwd)")->delimiter(',')->capture_default_str();
  gdn->add_option("--repeat", s->repeat, "timed calls per measurement (the median is reported)")->capture_default_str();
  gdn->add_option("--threads", s->threads, "CPU backends: threads, 0 = all cores")->capture_default_str();
  gdn->add_option("--l2norm", s->l2norm, "use_qk_l2norm_in_kernel")->capture_default_str();
  gdn->add_option("--device", s->device, "where the tensors live: auto, cpu or cuda")->capture_default_str();
  // At most 16384: its three n x n float matrices take 3 GiB.
  gdn->add_option("--sgemm-size", s->sgemm_size, "n of the n^3 sgemm reference (0 skips it)")
      ->capture_default_str()
      ->check(CLI::Range(0, 16384));
  gdn->add_flag("--json", s->json, "print JSON (with date, machine and versions) instead of a table");
  gdn->callback([s] { run_bench(*s); });
}

}  // namespace deltatrain::tools
