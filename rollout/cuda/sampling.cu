// BatchSampler on a GPU: one thread block per row of bfloat16 logits computes in float64 exactly the algorithm
// of sample_token (sampling.cpp), so that on the same values the two draw the same token and logprobs equal
// to rounding; only the N samples come back to the host.
//
// A bfloat16 value is a 16-bit pattern, and a monotone map of it (key_of) orders the keys as the values. So a
// count per key is all a row's distribution needs: the tempered weight of every token with one key is the same
// number, weight(key). A block counts one half of the 65536 keys at a time in shared memory (128 KiB), and
// reduces each half to per-group sums (a group: the 256 keys of one high byte): count and tempered mass.
// top_k and top_p are then radix selects over the ranking (larger key first, lower id among
// equals): walk the groups from the top to the one where the count (top_k) or the kept mass (top_p) is
// reached, count that group's 256 keys in one more pass over the row, and walk them to the cut key and how
// many of the tokens at it are kept (the lowest ids). The draw is the inverse CDF over the kept tokens in id
// order: a block-wide prefix sum over the row, tile by tile, until the cumulative mass passes u * total.
// The untempered log-probability of the token is the model's own float64 log-softmax (log_softmax.cuh), the
// number its loss gives the same token in batch-invariant mode. A batch of greedy rows that want no untempered
// log-probability needs only each row's largest value with its lowest id: greedy_rows spreads each row over
// greedy_parts blocks (device_sampler.h), which fold their best into the row's by atomicMax (exact in any order).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"
#include "deltatrain/model/log_softmax.cuh"
#include "device_sampler.h"

namespace deltatrain::rollout {
namespace {

constexpr int kThreads = model::kLogSoftmaxThreads;  // a block computes the untempered log-softmax too
constexpr int kWarps = kThreads / 32;
constexpr int kItems = 4;         // consecutive tokens per thread in a tile of the walk
constexpr int kKeyBits = 16;
constexpr int kGroups = 256;      // a key's high byte
constexpr int kGroupKeys = 256;   // its low byte
constexpr int kHalfKeys = 1 << (kKeyBits - 1);
constexpr int kHalfGroups = kGroups / 2;
constexpr std::size_t kHistogramBytes = kHalfKeys * sizeof(unsigned);

struct RowRequest {
  double temperature;  // 0: greedy
  double top_p;
  double u;
  std::int64_t top_k;  // 0 or >= V: no cut
  std::int32_t want_untempered;
};

struct RowResult {
  double logprob;
  double untempered_logprob;
  std::int32_t token;
};

// The order-preserving key of a bfloat16 pattern: larger value, larger key (-0 is +0, as they compare equal).
__device__ __forceinline__ unsigned key_of(unsigned bits) {
  if (bits == 0x8000u) bits = 0;
  return (bits & 0x8000u) ? (~bits & 0xFFFFu) : (bits | 0x8000u);
}

__device__ __forceinline__ double value_of(unsigned key) {
  const unsigned bits = (key & 0x8000u) ? (key & 0x7FFFu) : (~key & 0xFFFFu);
  return static_cast<double>(__uint_as_float(bits << 16));
}

struct Larger {
  template <class T>
  __device__ T operator()(const T& a, const T& b) const { return a > b ? a : b; }
};
struct Smaller {
  template <class T>
  __device__ T operator()(const T& a, const T& b) const { return a < b ? a : b; }
};

// visit(bits, id) for the values [begin, end) of a row, spread over `threads` threads: in 16-byte vectors of 8 values
// where the address allows (a row of an odd vocabulary may start anywhere), the values before and after them one
// by one.
template <class Visit>
__device__ __forceinline__ void for_each_value(const std::uint16_t* row, long long begin, long long end, int thread,
                                               int threads, Visit&& visit) {
  const auto address = reinterpret_cast<std::uintptr_t>(row + begin);
  const long long head = min(end - begin, static_cast<long long>((16 - address % 16) % 16 / 2));
  const long long first = begin + head, vectors = (end - first) / 8;
  for (long long i = begin + thread; i < first; i += threads) visit(row[i], i);
  const uint4* body = reinterpret_cast<const uint4*>(row + first);
#pragma unroll 4
  for (long long v = thread; v < vectors; v += threads) {
    const uint4 q = body[v];
    const unsigned words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // little-endian: the lower address in the low half
      visit(words[e] & 0xFFFFu, first + 8 * v + 2 * e);
      visit(words[e] >> 16, first + 8 * v + 2 * e + 1);
    }
  }
  for (long long i = first + 8 * vectors + thread; i < end; i += threads) visit(row[i], i);
}

// A value's key with the complement of its id below: the larger of two is the larger value, the lower id among equals.
__device__ __forceinline__ unsigned long long ranked(unsigned bits, long long id) {
  return (static_cast<unsigned long long>(key_of(bits)) << 32) | (0xFFFFFFFFull - static_cast<unsigned long long>(id));
}
__device__ __forceinline__ std::int32_t id_of_ranked(unsigned long long r) {
  return static_cast<std::int32_t>(0xFFFFFFFFull - (r & 0xFFFFFFFFull));
}

template <class T>
__device__ __forceinline__ T warp_sum(T x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xFFFFFFFFu, x, offset);
  return x;
}

// Where the row's tokens are cut: those with a key above cut_key are kept, and of those at cut_key the
// keep_at_cut lowest ids; total is the kept tokens' tempered mass.
struct Cut {
  bool active;
  unsigned key;
  long long keep_at_cut;
  double total;
};

struct SharedState {
  unsigned group_count[kGroups];
  double group_mass[kGroups];   // sum of weight(key) over the group's tokens
  unsigned key_count[kGroupKeys];  // one group's tokens per key
  double key_mass[kGroupKeys];     // their kept mass per key
  unsigned max_key;
  int argmax;
  int top_k_group;                 // the group the top-k cut falls in
  long long count_above;           // tokens ranked above the group being walked
  double mass_above;               // their kept mass
  double top_k_group_mass;         // the kept mass of top_k_group
  Cut cut;
  int pick;
  union {
    cub::BlockReduce<unsigned long long, kThreads>::TempStorage max_u64;
    cub::BlockReduce<int, kThreads>::TempStorage reduce_int;
    cub::BlockScan<int, kThreads>::TempStorage scan_int;
    cub::BlockScan<double, kThreads>::TempStorage scan_double;
    model::LogSoftmaxStorage log_softmax;
  } cub;
};

class RowKernel {
 public:
  __device__ RowKernel(const std::uint16_t* row, long long V, const RowRequest& r, unsigned* histogram,
                       SharedState& s)
      : row_(row), V_(V), r_(r), histogram_(histogram), s_(s), greedy_(r.temperature == 0),
        inv_t_(greedy_ ? 0.0 : 1.0 / r.temperature) {}

  __device__ void run(RowResult& result) {
    find_max_and_count_half(!greedy_);
    max_value_ = value_of(s_.max_key);
    max_t_ = __dmul_rn(max_value_, inv_t_);
    int token = s_.argmax;
    double logprob = 0;
    if (!greedy_) {
      summarise_half(1);
      count_half(0);
      summarise_half(0);
      select_top_k();
      if (r_.top_p < 1) select_top_p();
      token = draw();
      logprob = tempered(key_of(row_[token])) - log(s_.cut.total);
    }
    // The model's formula (log_softmax.cuh), which its loss computes in batch-invariant mode.
    double untempered = 0;
    if (r_.want_untempered != 0) {
      __syncthreads();  // the cub storage the draw used is reused
      untempered = model::row_log_sum_exp(row_, V_, s_.cub.log_softmax).log_prob(model::bf16_bits_to_double(row_[token]));
    }
    if (threadIdx.x == 0) {
      result.token = token;
      result.logprob = logprob;
      result.untempered_logprob = untempered;
    }
  }

 private:
  __device__ unsigned key(long long i) const { return key_of(row_[i]); }
  // __dmul_rn: a product rounded on its own, as the CPU's (no fused multiply-add).
  __device__ double tempered(unsigned key) const { return __dmul_rn(value_of(key), inv_t_) - max_t_; }
  __device__ double weight(unsigned key) const { return exp(tempered(key)); }

  // One pass: the largest key with its lowest id, and the counts of the upper half's keys (neither depends on the
  // order of the visits).
  __device__ void find_max_and_count_half(bool count) {
    if (count) clear_histogram();
    unsigned long long best = 0;
    for_each_value(row_, 0, V_, threadIdx.x, kThreads, [&](unsigned bits, long long i) {
      best = max(best, ranked(bits, i));
      const unsigned k = key_of(bits);
      if (count && k >= kHalfKeys) atomicAdd(&histogram_[k - kHalfKeys], 1u);
    });
    best = cub::BlockReduce<unsigned long long, kThreads>(s_.cub.max_u64).Reduce(best, Larger());
    if (threadIdx.x == 0) {
      s_.max_key = static_cast<unsigned>(best >> 32);
      s_.argmax = id_of_ranked(best);
    }
    __syncthreads();
  }

  __device__ void clear_histogram() {
    for (int b = threadIdx.x; b < kHalfKeys; b += kThreads) histogram_[b] = 0;
    __syncthreads();
  }

  __device__ void count_half(int half) {
    clear_histogram();
    for (long long i = threadIdx.x; i < V_; i += kThreads) {
      const unsigned k = key(i);
      if ((k >> (kKeyBits - 1)) == static_cast<unsigned>(half)) atomicAdd(&histogram_[k - half * kHalfKeys], 1u);
    }
    __syncthreads();
  }

  // The histogram of one half into its groups' sums: a warp per group, only keys that occur cost an exp.
  __device__ void summarise_half(int half) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int local = warp; local < kHalfGroups; local += kWarps) {
      const int group = half * kHalfGroups + local;
      unsigned count = 0;
      double mass = 0;
      for (int low = lane; low < kGroupKeys; low += 32) {
        const unsigned c = histogram_[local * kGroupKeys + low];
        if (c == 0) continue;
        const unsigned k = (static_cast<unsigned>(group) << 8) | static_cast<unsigned>(low);
        count += c;
        mass += c * weight(k);
      }
      count = warp_sum(count);
      mass = warp_sum(mass);
      if (lane == 0) {
        s_.group_count[group] = count;
        s_.group_mass[group] = mass;
      }
    }
    __syncthreads();
  }

  // The counts of one group's keys, in one pass over the row.
  __device__ void count_group(int group) {
    for (int b = threadIdx.x; b < kGroupKeys; b += kThreads) s_.key_count[b] = 0;
    __syncthreads();
    for (long long i = threadIdx.x; i < V_; i += kThreads) {
      const unsigned k = key(i);
      if (static_cast<int>(k >> 8) == group) atomicAdd(&s_.key_count[k & 0xFFu], 1u);
    }
    __syncthreads();
  }

  // How many of the group's tokens at key `k` are kept so far (top-k only: before the top-p cut).
  __device__ long long kept_count(unsigned k, unsigned count) const {
    const Cut& c = s_.cut;
    if (!c.active || k > c.key) return count;
    return k == c.key ? c.keep_at_cut : 0;
  }

  // The top-k cut's walk from the highest bucket (of groups, or of one group's keys) down: the bucket that holds the
  // k-th token, with the counts and masses of the buckets above it added to `above` and `mass`.
  static __device__ int walk_down_to(long long k, const unsigned* counts, const double* masses, int top, long long& above,
                                     double& mass) {
    int bucket = top;
    while (above + counts[bucket] < k) {
      above += counts[bucket];
      mass += masses[bucket];
      --bucket;
    }
    return bucket;
  }

  __device__ void select_top_k() {
    const long long k = r_.top_k;
    if (threadIdx.x == 0) s_.cut = {false, 0, 0, 0};
    if (!(k > 0 && k < V_)) {
      if (threadIdx.x == 0) {
        double total = 0;
        for (int g = kGroups - 1; g >= 0; --g) total += s_.group_mass[g];
        s_.cut.total = total;
      }
      __syncthreads();
      return;
    }
    if (threadIdx.x == 0) {
      long long above = 0;
      double mass = 0;
      const int g = walk_down_to(k, s_.group_count, s_.group_mass, kGroups - 1, above, mass);
      s_.top_k_group = g;
      s_.count_above = above;
      s_.mass_above = mass;
    }
    __syncthreads();
    const int group = s_.top_k_group;
    count_group(group);
    if (threadIdx.x < kGroupKeys) {
      const unsigned key = (static_cast<unsigned>(group) << 8) | threadIdx.x;
      s_.key_mass[threadIdx.x] = s_.key_count[threadIdx.x] ? s_.key_count[threadIdx.x] * weight(key) : 0.0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      long long above = s_.count_above;
      double mass = 0;
      const int low = walk_down_to(k, s_.key_count, s_.key_mass, kGroupKeys - 1, above, mass);
      const unsigned cut_key = (static_cast<unsigned>(group) << 8) | static_cast<unsigned>(low);
      const long long keep = k - above;
      const double group_mass = mass + keep * weight(cut_key);
      s_.top_k_group_mass = group_mass;
      s_.cut = {true, cut_key, keep, s_.mass_above + group_mass};
    }
    __syncthreads();
  }

  // The shortest prefix of the ranking (within the top-k cut) whose mass reaches top_p * total.
  __device__ void select_top_p() {
    const double target = r_.top_p * s_.cut.total;
    const bool after_top_k = s_.cut.active;
    const int k_group = after_top_k ? s_.top_k_group : -1;
    if (threadIdx.x == 0) {
      double mass = 0;
      int found = -1;
      for (int g = kGroups - 1; g >= 0 && g >= k_group; --g) {
        const double m = g == k_group ? s_.top_k_group_mass : s_.group_mass[g];
        if (mass + m >= target) {
          found = g;
          break;
        }
        mass += m;
      }
      s_.pick = found;  // -1: rounding kept every token
      s_.mass_above = mass;
    }
    __syncthreads();
    const int group = s_.pick;
    if (group < 0) return;
    if (group != k_group) count_group(group);  // else key_count holds it from the top-k cut
    if (threadIdx.x < kGroupKeys) {
      const unsigned key = (static_cast<unsigned>(group) << 8) | threadIdx.x;
      const long long kept = kept_count(key, s_.key_count[threadIdx.x]);
      s_.key_mass[threadIdx.x] = kept ? kept * weight(key) : 0.0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      double mass = s_.mass_above;
      int low = kGroupKeys - 1, last = -1;
      for (; low >= 0; --low) {
        const unsigned key = (static_cast<unsigned>(group) << 8) | static_cast<unsigned>(low);
        if (kept_count(key, s_.key_count[low]) == 0) continue;
        last = low;
        if (mass + s_.key_mass[low] >= target) break;
        mass += s_.key_mass[low];
      }
      if (low < 0) {  // rounding between the group's sum and its keys': the group's last kept key, all of it
        low = last;
        mass -= s_.key_mass[low];
      }
      const unsigned key = (static_cast<unsigned>(group) << 8) | static_cast<unsigned>(low);
      const long long available = kept_count(key, s_.key_count[low]);
      const double w = weight(key);
      // The fewest tokens at the cut key (lowest ids first) whose mass reaches the target.
      long long keep = w > 0 ? static_cast<long long>(ceil((target - mass) / w)) : available;
      keep = min(max(keep, 1ll), available);
      s_.cut = {true, key, keep, mass + keep * w};
    }
    __syncthreads();
  }

  // The inverse CDF over the kept tokens in id order: the first whose cumulative mass exceeds u * total (the
  // last kept token if rounding leaves u * total at or above the sum).
  __device__ int draw() {
    const Cut cut = s_.cut;
    const double target = r_.u * cut.total;
    double carry = 0;
    long long at_cut_before = 0;
    int last_kept = -1;
    for (long long base = 0; base < V_; base += static_cast<long long>(kThreads) * kItems) {
      unsigned keys[kItems];
      int at_cut = 0;
      for (int j = 0; j < kItems; ++j) {
        const long long i = base + threadIdx.x * kItems + j;
        keys[j] = i < V_ ? key(i) : 0;
        if (i < V_ && cut.active && keys[j] == cut.key) ++at_cut;
      }
      int at_cut_rank = 0, at_cut_tile = 0;
      cub::BlockScan<int, kThreads>(s_.cub.scan_int).ExclusiveSum(at_cut, at_cut_rank, at_cut_tile);
      __syncthreads();
      long long rank = at_cut_before + at_cut_rank;
      double w[kItems];
      double thread_mass = 0;
      for (int j = 0; j < kItems; ++j) {
        const long long i = base + threadIdx.x * kItems + j;
        bool kept = i < V_;
        if (kept && cut.active) kept = keys[j] > cut.key || (keys[j] == cut.key && rank++ < cut.keep_at_cut);
        w[j] = kept ? weight(keys[j]) : -1.0;  // -1: not kept
        if (kept) {
          thread_mass += w[j];
          last_kept = static_cast<int>(i);
        }
      }
      double mass_before = 0, tile_mass = 0;
      cub::BlockScan<double, kThreads>(s_.cub.scan_double).ExclusiveSum(thread_mass, mass_before, tile_mass);
      __syncthreads();
      double cumulative = carry + mass_before;
      int first = INT_MAX;
      for (int j = 0; j < kItems; ++j) {
        if (w[j] < 0) continue;
        cumulative += w[j];
        if (target < cumulative) {
          first = static_cast<int>(base + threadIdx.x * kItems + j);
          break;
        }
      }
      first = cub::BlockReduce<int, kThreads>(s_.cub.reduce_int).Reduce(first, Smaller());
      if (threadIdx.x == 0) s_.pick = first;
      __syncthreads();
      if (s_.pick != INT_MAX) return s_.pick;
      carry += tile_mass;
      at_cut_before += at_cut_tile;
    }
    last_kept = cub::BlockReduce<int, kThreads>(s_.cub.reduce_int).Reduce(last_kept, Larger());
    if (threadIdx.x == 0) s_.pick = last_kept;
    __syncthreads();
    return s_.pick;
  }

  const std::uint16_t* row_;
  long long V_;
  RowRequest r_;
  unsigned* histogram_;
  SharedState& s_;
  bool greedy_;
  double inv_t_;
  double max_value_ = 0, max_t_ = 0;
};

// Row blockIdx.x's sample into results, and its token into tokens when that is not null.
__global__ void __launch_bounds__(kThreads) sample_rows(const std::uint16_t* __restrict__ logits, long long V,
                                                        const RowRequest* __restrict__ requests,
                                                        RowResult* __restrict__ results, std::int32_t* tokens) {
  extern __shared__ unsigned histogram[];
  __shared__ SharedState shared;
  RowKernel kernel(logits + static_cast<long long>(blockIdx.x) * V, V, requests[blockIdx.x], histogram, shared);
  kernel.run(results[blockIdx.x]);
  if (tokens != nullptr && threadIdx.x == 0) tokens[blockIdx.x] = results[blockIdx.x].token;
}

// A greedy batch (greedy_parts): block b takes part b % parts of row b / parts and folds its best into the row's
// ranked value, which starts at 0 (below every value's).
constexpr int kGreedyThreads = 256;

__global__ void __launch_bounds__(kGreedyThreads) greedy_rows(const std::uint16_t* __restrict__ logits, long long V,
                                                              int parts, unsigned long long* __restrict__ best) {
  using Reduce = cub::BlockReduce<unsigned long long, kGreedyThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const long long row = blockIdx.x / parts, part = blockIdx.x % parts;
  const long long per_part = (V + parts - 1) / parts, begin = min(V, part * per_part), end = min(V, begin + per_part);
  unsigned long long mine = 0;
  for_each_value(logits + row * V, begin, end, threadIdx.x, kGreedyThreads,
                 [&](unsigned bits, long long i) { mine = max(mine, ranked(bits, i)); });
  mine = Reduce(storage).Reduce(mine, Larger());
  if (threadIdx.x == 0) atomicMax(&best[row], mine);
}

// A greedy batch's samples from the rows' ranked values: the token, log-probability 0 (probability 1).
__global__ void greedy_results(const unsigned long long* __restrict__ best, long long rows, RowResult* __restrict__ results,
                               std::int32_t* tokens) {
  const long long n = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (n >= rows) return;
  const std::int32_t token = id_of_ranked(best[n]);
  results[n] = {0.0, 0.0, token};
  if (tokens != nullptr) tokens[n] = token;
}

// The per-row requests go up and the results come back through pinned host buffers and device workspaces, one set
// for each batch that may be in flight (two: a caller samples step n + 1 before collecting step n), each grown
// (never shrunk) to the largest batch it has held, so that a call allocates nothing once it has run at its size.
class CudaSampler final : public DeviceSampler {
 public:
  explicit CudaSampler(Device device) : device_(device) {
    const CudaDeviceGuard guard(device_.index);
    cuda_check(cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, device_.index),
               "cudaDeviceGetAttribute");
    cuda_check(cudaFuncSetAttribute(sample_rows, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kHistogramBytes)),
               "cudaFuncSetAttribute");
    for (Batch& b : batches_) cuda_check(cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~CudaSampler() override {
    const CudaDeviceGuard guard(device_.index);
    for (Batch& b : batches_) {
      if (b.in_flight) cudaEventSynchronize(b.done);  // its copies still write the pinned buffers
      b.release();
      cudaEventDestroy(b.done);
    }
  }

  Device device() const override { return device_; }

  void launch(const TensorView& logits, std::span<const RowSampling> rows, void* stream_handle,
              std::int32_t* tokens) override {
    const CudaDeviceGuard guard(device_.index);
    const auto stream = static_cast<cudaStream_t>(stream_handle);
    const std::int64_t N = logits.shape[0], V = logits.shape[1];
    if (V > INT_MAX) throw InvalidArgument("logits", "a GPU samples rows of at most 2^31 - 1 tokens, got " + std::to_string(V));
    Batch& b = batches_[(first_ + in_flight_) % kBatches];
    if (in_flight_ == kBatches) {
      throw InvalidArgument("launch", "two batches are already in flight on this sampler: collect one first");
    }
    b.reserve(N);
    const auto* values = static_cast<const std::uint16_t*>(logits.data);
    if (std::all_of(rows.begin(), rows.end(), [](const RowSampling& r) { return r.params.temperature == 0 && !r.want_untempered; })) {
      const int parts = greedy_parts(N, V, multiprocessors_);
      cuda_check(cudaMemsetAsync(b.device_best, 0, N * sizeof(unsigned long long), stream), "cudaMemsetAsync");
      greedy_rows<<<static_cast<unsigned>(N * parts), kGreedyThreads, 0, stream>>>(values, V, parts, b.device_best);
      cuda_check(cudaGetLastError(), "greedy_rows");
      greedy_results<<<static_cast<unsigned>((N + 127) / 128), 128, 0, stream>>>(b.device_best, N, b.device_results,
                                                                               tokens);
      cuda_check(cudaGetLastError(), "greedy_results");
    } else {
      for (std::int64_t n = 0; n < N; ++n) {
        const SamplingParams& p = rows[n].params;
        b.host_requests[n] = {p.temperature, p.top_p, rows[n].u, p.top_k, rows[n].want_untempered ? 1 : 0};
      }
      cuda_check(cudaMemcpyAsync(b.device_requests, b.host_requests, N * sizeof(RowRequest), cudaMemcpyHostToDevice,
                                 stream),
                 "cudaMemcpyAsync");
      sample_rows<<<static_cast<unsigned>(N), kThreads, kHistogramBytes, stream>>>(values, V, b.device_requests,
                                                                                  b.device_results, tokens);
      cuda_check(cudaGetLastError(), "sample_rows");
    }
    cuda_check(cudaMemcpyAsync(b.host_results, b.device_results, N * sizeof(RowResult), cudaMemcpyDeviceToHost, stream),
               "cudaMemcpyAsync");
    cuda_check(cudaEventRecord(b.done, stream), "cudaEventRecord");
    b.rows = N;
    b.in_flight = true;
    ++in_flight_;
  }

  std::int64_t collect(std::span<Sample> out) override {
    if (in_flight_ == 0) throw InvalidArgument("collect", "no batch is in flight on this sampler");
    const CudaDeviceGuard guard(device_.index);
    Batch& b = batches_[first_];
    cuda_check(cudaEventSynchronize(b.done), "cudaEventSynchronize");
    for (std::int64_t n = 0; n < b.rows; ++n)
      out[n] = {b.host_results[n].token, b.host_results[n].logprob, b.host_results[n].untempered_logprob};
    b.in_flight = false;
    first_ = (first_ + 1) % kBatches;
    --in_flight_;
    return b.rows;
  }

 private:
  struct Batch {
    std::int64_t capacity = 0, rows = 0;
    bool in_flight = false;
    cudaEvent_t done = nullptr;  // its results are on the host
    RowRequest* device_requests = nullptr;
    RowResult* device_results = nullptr;
    unsigned long long* device_best = nullptr;  // a greedy batch's ranked values (greedy_rows)
    RowRequest* host_requests = nullptr;
    RowResult* host_results = nullptr;

    void reserve(std::int64_t n) {
      if (n <= capacity) return;
      release();
      cuda_check(cudaMalloc(&device_requests, n * sizeof(RowRequest)), "cudaMalloc");
      cuda_check(cudaMalloc(&device_results, n * sizeof(RowResult)), "cudaMalloc");
      cuda_check(cudaMalloc(&device_best, n * sizeof(unsigned long long)), "cudaMalloc");
      cuda_check(cudaMallocHost(&host_requests, n * sizeof(RowRequest)), "cudaMallocHost");
      cuda_check(cudaMallocHost(&host_results, n * sizeof(RowResult)), "cudaMallocHost");
      capacity = n;
    }
    void release() {
      cudaFree(device_requests);
      cudaFree(device_results);
      cudaFree(device_best);
      cudaFreeHost(host_requests);
      cudaFreeHost(host_results);
      device_requests = nullptr;
      device_results = nullptr;
      device_best = nullptr;
      host_requests = nullptr;
      host_results = nullptr;
      capacity = 0;
    }
  };
  static constexpr int kBatches = 2;

  Device device_;
  int multiprocessors_ = 0;
  Batch batches_[kBatches];
  int first_ = 0, in_flight_ = 0;  // the oldest uncollected batch, and how many are in flight
};

}  // namespace

std::unique_ptr<DeviceSampler> make_cuda_sampler(Device device) { return std::make_unique<CudaSampler>(device); }

}  // namespace deltatrain::rollout
