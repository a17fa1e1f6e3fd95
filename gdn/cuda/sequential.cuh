// Pieces of the sequential passes over a sequence's chunks shared by the mma.sync kernels (state.cu) and
// the Hopper ones (state_hopper.cu): the chunk walk with its copy pipeline, and the state blocks.
#pragma once

#include "chunk.cuh"
#include "warmup.h"

namespace deltatrain::gdn::cuda {

inline constexpr int kSmemLimit = 227 * 1024;  // per-block opt-in limit of sm_80 and sm_90
inline constexpr int kSmemPerSm = 228 * 1024;  // an sm_90 SM's, shared by its CTAs (each also reserves 1 KB)

// The chunks of sequence n: contiguous, 64 tokens each but the last. Computed rather than read from the
// chunk table so that no global load sits on the sequential path.
struct SequenceChunks {
  std::int64_t begin, end;
  int first;  // global index of the first chunk (per-chunk workspace rows)
  int count;
  __device__ SequenceChunks(const Params& p, int n)
      : begin(sequence_start(p, n)), end(sequence_start(p, n + 1)), first(p.sequence_chunks[n]),
        count(static_cast<int>((end - begin + kChunk - 1) / kChunk)) {}
  __device__ ChunkInfo operator[](int j) const {
    const std::int64_t start = begin + static_cast<std::int64_t>(j) * kChunk;
    const std::int64_t length = end - start < kChunk ? end - start : kChunk;
    return ChunkInfo{static_cast<std::int32_t>(start), static_cast<std::int32_t>(length), 0, 0};
  }
  // Segment s of `segments` near-equal runs of chunks (the last ones may be short or empty).
  __device__ SequenceChunks segment(int s, int segments) const {
    const int per = segment_chunks(count, segments), skip = min(count, s * per);
    SequenceChunks part = *this;
    part.begin += static_cast<std::int64_t>(skip) * kChunk;
    part.first += skip;
    part.count = min(per, count - skip);
    return part;
  }
  // Its chunks from the j-th on (a segment's last chunks, which a forward warm-up walks).
  __device__ SequenceChunks from(int j) const {
    SequenceChunks part = *this;
    part.begin += static_cast<std::int64_t>(j) * kChunk;
    part.first += j;
    part.count -= j;
    return part;
  }
  // Its first j chunks (a segment's first chunks, which a reverse warm-up walks, last to first).
  __device__ SequenceChunks before(int j) const {
    SequenceChunks part = *this;
    part.count = j;
    return part;
  }
  // Chunks per segment (all but the last ones) of a sequence of `count` chunks, and the segment of its chunk j.
  __host__ __device__ static int segment_chunks(int count, int segments) { return (count + segments - 1) / segments; }
  __host__ __device__ static int segment_of(int j, int count, int segments) { return j / segment_chunks(count, segments); }
};

// A segment's row blocks in the workspace: [sequence, run, HV, rows, K] with `rows` rows.
template <class T>
__device__ __forceinline__ T* segment_rows(void* base, const Params& p, int n, int run, int runs, int hv, int rows) {
  return static_cast<T*>(base) + ((static_cast<std::int64_t>(n) * runs + run) * p.HV + hv) * rows * p.K;
}
// Run `run` of sequence n's segmented pass (0 the first walked: in the reverse passes the last segment).
template <bool kReverse>
__device__ __forceinline__ SequenceChunks run_chunks(const Params& p, int n, int run) {
  return SequenceChunks(p, n).segment(kReverse ? p.segments - 1 - run : run, p.segments);
}

// Where a run of a segmented pass warms up (warmup.h) rather than being walked whole: how many of its chunks the
// warm-up walks, those nearest the next run (a forward run's last, a reverse run's first: its reverse walk's last;
// A_t is symmetric, so the reverse map's bound is the forward one's, summed from the first chunk on), or 0 where it
// does not (or the call has no bounds). Every thread that asks (the segment ends pass, segment_starts_kernel and the
// readers of the starts) chooses alike: the same loads, the same order of sums.
template <bool kReverse>
__device__ __forceinline__ int warmup_chunks(const Params& p, const SequenceChunks& run, int hv) {
  if (p.chunk_log_norms == nullptr) return 0;
  const float* log_norms = p.chunk_log_norms + static_cast<std::int64_t>(hv) * p.chunks + run.first;
  const int count = run.count;
  int first;  // in the walk's order
  if constexpr (kReverse) {
    first = warmup_first_chunk(count, [&](int c) { return log_norms[count - 1 - c]; });
  } else {
    first = warmup_first_chunk(count, [&](int c) { return log_norms[c]; });
  }
  return first < 0 ? 0 : count - first;
}

// The rows of S^T (or of its gradient) entering run `run` >= 1 of sequence n's segmented pass, [V][K] in float32.
// start_r = start_(r-1) M_(r-1) + R_(r-1), so where the previous run is the first (it started from the true state) or
// warmed up (its M is zero) the start is that run's end R_(r-1), which the segment ends pass stored, and is read
// there; else it is the one segment_starts_kernel composed, which then chains.
template <bool kReverse>
__device__ __forceinline__ const float* segment_start_rows(const Params& p, int n, int run, int hv) {
  const bool from_end = run == 1 || warmup_chunks<kReverse>(p, run_chunks<kReverse>(p, n, run - 1), hv) > 0;
  return from_end ? segment_rows<float>(p.segment_ends[kReverse], p, n, run - 1, p.segments - 1, hv, p.V)
                  : segment_rows<float>(p.segment_starts[kReverse], p, n, run, p.segments, hv, p.V);
}

// Walks the chunks of a sequence (in order, or last to first) with `stages` chunks in flight:
// issue(j, stage) starts chunk j's copies into a stage, body(j, stage) consumes them once they landed.
// kAsyncProxy: the body reads the tiles with wgmma, which reads shared memory through the async proxy, so
// each thread's copies are fenced for it before the barrier. kBodyAwaitsNext: the body itself waits for the next
// chunk's copies, fences them and synchronises (it forms something from them a step ahead), and fences what it writes
// for the next step; then only the first chunk's step starts with a wait and a barrier.
template <int kStages, bool kReverse, bool kAsyncProxy = false, bool kBodyAwaitsNext = false, class Issue, class Body>
__device__ __forceinline__ void sequential_pass(int count, Issue&& issue, Body&& body) {
  auto chunk = [&](int i) { return kReverse ? count - 1 - i : i; };
  for (int s = 0; s < kStages; ++s) {
    if (s < count) issue(chunk(s), s);
    cp_async_commit();
  }
#pragma unroll 1
  for (int i = 0; i < count; ++i) {
    const int stage = i % kStages;
    if (!kBodyAwaitsNext || i == 0) {
      cp_async_wait<kStages - 1>();
      if constexpr (kAsyncProxy) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();
    }
    body(chunk(i), stage);
    __syncthreads();  // the stage is free
    if (i + kStages < count) issue(chunk(i + kStages), stage);
    cp_async_commit();
  }
}

// Where a warp's rows of S^T sit: columns of V from v0, keys from k0 (all of them).
struct StateRows {
  int v0, k0;
};

// A warp's block of a [N, HV, K, V] float32 state (zero when absent), as S^T in acc: rows (columns of V)
// from at.v0, columns (keys) from at.k0.
template <int NT, class Place>
__device__ __forceinline__ void load_state(float (&acc)[1][NT][4], const float* src, const Params& p, int n, int hv,
                                           const Place& at) {
  const std::int64_t base = (static_cast<std::int64_t>(n) * p.HV + hv) * p.K * p.V;
  for_each(acc, 0, 0, [&](int r, int c, float& x) {
    x = src == nullptr ? 0.f : src[base + static_cast<std::int64_t>(at.k0 + c) * p.V + at.v0 + r];
  });
}
template <int NT, class Place>
__device__ __forceinline__ void store_state(float (&acc)[1][NT][4], float* dst, const Params& p, int n, int hv,
                                            const Place& at) {
  const std::int64_t base = (static_cast<std::int64_t>(n) * p.HV + hv) * p.K * p.V;
  for_each(acc, 0, 0,
           [&](int r, int c, float& x) { dst[base + static_cast<std::int64_t>(at.k0 + c) * p.V + at.v0 + r] = x; });
}

// The warp's block of a per-chunk [chunks, HV, V, K] tensor of states.
template <class E, class Place>
__device__ __forceinline__ E* chunk_state_block(void* base, const Params& p, std::int64_t chunk, int hv,
                                                const Place& at) {
  return static_cast<E*>(base) + ((chunk * p.HV + hv) * p.V + at.v0) * p.K + at.k0;
}

}  // namespace deltatrain::gdn::cuda
