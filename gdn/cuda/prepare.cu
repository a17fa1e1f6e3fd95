// The parallel start of the chunked algorithm: the chunk schedule, the optional L2 norm of q and k, and
// per (chunk, value head) the WY/UT transform (docs/gdn-algorithm.md section 3):
//   gamma = in-chunk cumsum of g,  A = strict_tril(diag(beta) (K K^T) * Gamma),  T = (I + A)^-1 (float32),
//   W = T diag(beta e^gamma) K,  P = scale * tril(Q K^T) * Gamma,  and either U = T diag(beta) V for the
//   mma.sync passes or T and beta by head for the wgmma passes, which scale T by beta themselves and form U
//   (state_hopper.cu), as they form W where the plan says so (passes_form_w). For a segmented call (or the forward
//   of a call whose backward is) also the bound on the log norm of the chunk's map, gamma_last + sum log max(1,
//   |1 - beta |k|^2|) (warmup.h), from which the segment ends passes choose where to warm up.
#include <algorithm>
#include <cub/block/block_scan.cuh>

#include "chunk.cuh"
#include "dispatch.cuh"
#include "launch.h"
#include "warmup.h"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kStartThreads = 256;

// The chunks of every sequence, in order: sequence_chunks[n] is the first chunk of sequence n. One block:
// the chunk counts of each thread's run of sequences are scanned by the block, then every thread fills
// table entries, finding each chunk's sequence by binary search (one long sequence must not leave a single
// thread to write all of its chunks).
__device__ void schedule(const Params& p) {
  using Scan = cub::BlockScan<int, kStartThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int total_chunks;
  const int per_thread = (p.sequences + kStartThreads - 1) / kStartThreads;
  const int begin = min(p.sequences, static_cast<int>(threadIdx.x) * per_thread);
  const int end = min(p.sequences, begin + per_thread);
  auto chunks_of = [&](int n) {
    return static_cast<int>((sequence_start(p, n + 1) - sequence_start(p, n) + kChunk - 1) / kChunk);
  };
  int count = 0;
  for (int n = begin; n < end; ++n) count += chunks_of(n);
  int first = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(count, first, total);
  for (int n = begin; n < end; ++n) {
    p.sequence_chunks[n] = first;
    first += chunks_of(n);
  }
  if (threadIdx.x == 0) {
    p.sequence_chunks[p.sequences] = total;
    total_chunks = total;
  }
  __syncthreads();  // sequence_chunks is written (global writes are visible within the block after it)
  for (int chunk = threadIdx.x; chunk < total_chunks; chunk += kStartThreads) {
    int lo = 0, hi = p.sequences - 1;  // the last sequence whose first chunk is at or before `chunk`
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.sequence_chunks[mid] <= chunk) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const std::int64_t start =
        sequence_start(p, lo) + static_cast<std::int64_t>(chunk - p.sequence_chunks[lo]) * kChunk;
    const std::int64_t stop = sequence_start(p, lo + 1);
    const auto length = static_cast<std::int32_t>(stop - start < kChunk ? stop - start : kChunk);
    p.chunk_table[chunk] = ChunkInfo{static_cast<std::int32_t>(start), length, lo, 0};
  }
}

// N 32-bit words that one vector access moves (8 bytes for N = 2, 16 for N = 4).
template <int N>
struct alignas(4 * N) Words {
  std::uint32_t w[N];
};
// N consecutive elements of E (N even) as the words that hold them: float32 as its bits, 16-bit types in pairs.
template <class E, int N>
using Run = Words<N * static_cast<int>(sizeof(E)) / 4>;

// N values rounded to E as one vector's words, and back.
template <class E, int N>
__device__ __forceinline__ Run<E, N> pack_run(const float (&x)[N]) {
  Run<E, N> run;
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    if constexpr (std::is_same_v<E, float>) {
      run.w[i] = __float_as_uint(x[i]);
      run.w[i + 1] = __float_as_uint(x[i + 1]);
    } else {
      run.w[i / 2] = pack2<E>(x[i], x[i + 1]);
    }
  }
  return run;
}
template <class E, int N>
__device__ __forceinline__ void unpack_run(Run<E, N> run, float (&x)[N]) {  // by value: one vector load
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    const float2 pair = std::is_same_v<E, float> ? make_float2(__uint_as_float(run.w[i]), __uint_as_float(run.w[i + 1]))
                                                 : unpack2<E>(run.w[i / 2]);
    x[i] = pair.x;
    x[i + 1] = pair.y;
  }
}

// One warp per (token, head) row of q and of k, 8 rows per block: x / sqrt(sum x^2 + eps), and
// 1 / sqrt(...) for the backward. Each lane reads runs of up to four columns as one vector, q's and k's both
// before either sum, so that a warp has both rows' loads in flight at once (the scalar form, 2-byte loads and
// one row after the other, moved ~3.6 TB/s; this one ~3.9).
template <class E, int K>
__device__ void l2norm_rows(const Params& p, std::int64_t block) {
  const std::int64_t row = block * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= static_cast<std::int64_t>(p.tokens) * p.H) return;
  constexpr int kPerLane = K / 32, kRun = kPerLane < 4 ? kPerLane : 4, kRuns = kPerLane / kRun;
  float x[2][kRuns][kRun];
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    const auto* src = reinterpret_cast<const Run<E, kRun>*>(static_cast<const E*>(which == 0 ? p.q : p.k) + row * K);
#pragma unroll
    for (int j = 0; j < kRuns; ++j) unpack_run<E>(src[lane + 32 * j], x[which][j]);
  }
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kRuns; ++j) {
#pragma unroll
      for (int i = 0; i < kRun; ++i) sum += x[which][j][i] * x[which][j][i];
    }
    const float rstd = 1.f / sqrtf(warp_sum(sum) + 1e-6f);
    auto* dst = reinterpret_cast<Run<E, kRun>*>(static_cast<E*>(which == 0 ? p.q_normed : p.k_normed) + row * K);
#pragma unroll
    for (int j = 0; j < kRuns; ++j) {
      float normed[kRun];
#pragma unroll
      for (int i = 0; i < kRun; ++i) normed[i] = x[which][j][i] * rstd;
      dst[lane + 32 * j] = pack_run<E>(normed);
    }
    if (lane == 0) (which == 0 ? p.q_rstd : p.k_rstd)[row] = rstd;
  }
}

// The first launch of both chunked passes: the chunk schedule in block 0 and, when the norm is on, the L2
// norm of q and k in the other blocks. The two are independent, and one launch costs the host less.
// At least 4 blocks an SM: without a minimum, ptxas held the float32 K = 128 norm to 32 registers and spilled.
template <class E, int K>
__global__ void __launch_bounds__(kStartThreads, 4) start_kernel(Params p) {
  if (blockIdx.x == 0) {
    schedule(p);
  } else {
    l2norm_rows<E, K>(p, blockIdx.x - 1);
  }
}

template <class E, int K>
struct PrepareSmem {
  using KeyTile = Tile<E, kChunk, K>;
  using ChunkTile = Tile<E, kChunk, kChunk>;
  using FloatTile = Tile<float, kChunk, kChunk>;
  // V comes in blocks of up to 128 columns (at most K, so that U's staging fits in K's region).
  static constexpr int kMaxVBlock = K < 128 ? K : 128;
  using VTile = Tile<E, kChunk, kMaxVBlock>;
  // Three regions, each reused as its contents die: K, until W's product; Q, then the inverse's
  // intermediate products, then T diag(beta e^gamma) and T diag(beta); A, inverted in place into T, then
  // W's staging, then blocks of V (the mma.sync passes' U, which is staged in K's region).
  static constexpr int k = 0;
  static constexpr int q = k + KeyTile::kBytes;
  static constexpr int t_beta_decay = q;
  static constexpr int t_beta = q + ChunkTile::kBytes;
  static constexpr int a = q + std::max({KeyTile::kBytes, FloatTile::kBytes, 2 * ChunkTile::kBytes});
  static constexpr int gamma = a + std::max({FloatTile::kBytes, KeyTile::kBytes, VTile::kBytes});
  static constexpr int beta = gamma + kChunk * 8;  // gamma is hi + lo (chunk.cuh)
  static constexpr int beta_decay = beta + kChunk * 4;  // beta e^gamma
  static constexpr int key_norm2 = beta_decay + kChunk * 4;  // |k|^2 per row, for the chunk's bound (warmup.h)
  static constexpr int bytes = key_norm2 + kChunk * 4;
  static_assert(gamma % 16 == 0, "for_each_decay reads two columns' gamma as one float4");
  // CTAs per SM that shared memory admits on sm_90 (228 KiB, 1 KiB reserved per CTA), at most four: the
  // register budget the kernel is compiled for. The kernel is a chain of short steps between barriers, so
  // more CTAs per SM hide more of it (K = 128 fits four in 54 KB).
  static constexpr int ctas_per_sm = 228 * 1024 / (bytes + 1024) < 4 ? 228 * 1024 / (bytes + 1024) : 4;
};

// The inverse's merges in one TF32 product where T leaves prepare in 16 bits, in three (about float32) where it leaves
// in float32. The passes read T rounded to bfloat16 (2^-9 relative) or half (2^-11); one TF32 product leaves T within
// 3e-5 to 1.6e-4 of the exact inverse (three: 1e-8), and the forward's errors against float64 then move by a median
// 0.0%, at most +1.9% at K = V = 64 and 128 and +4.9% at 32 (bench/prototypes/tf32_inverse.py: the forward's roundings
// emulated over the anchors' gates, long memory, strong decay, beta at 0 and 1; bench/NOTES.md, session 47).
// The merges are prepare's largest piece of instructions; with one product, a third of their tensor-core instructions
// and no split of the operands.
template <class E>
constexpr Tf32Products kInverseMergeProducts = sizeof(E) == 2 ? Tf32Products::one : Tf32Products::three;

// T = (I + A)^-1 for strictly lower-triangular A (64 x 64, float32), in place, by doubling: the four
// 16 x 16 diagonal blocks by forward substitution (one lane a column), then two merges of neighbouring
// diagonal blocks, 16 -> 32 and 32 -> 64, each
//   T_21 = -T_22 (A_21 T_11)
// as two TF32 tensor-core products (kMergeProducts each) with A_21 T_11 in `scratch` at T's coordinates;
// T_21 replaces A_21 once the first product has read it. Four barriers; above the diagonal blocks the tile
// keeps A's zeros.
template <Tf32Products kMergeProducts>
__device__ void invert_unit_lower(Tile<float, kChunk, kChunk> t, Tile<float, kChunk, kChunk> scratch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (warp < 4 && lane < 16) {
    const int base = 16 * warp;
    float column[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float x = i == lane ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < i; ++m) x -= t(base + i, base + m) * column[m];
      column[i] = x;
    }
    __syncwarp(0x0000ffffu);  // every lane has read the block's A before any writes its column of T
#pragma unroll
    for (int i = 0; i < 16; ++i) t(base + i, base + lane) = column[i];
  }
  __syncthreads();
  // Merges the diagonal blocks at rows/columns lo and lo + size into one of 2 size; each warp takes the
  // 16 x 16 output tile at (row, col) of the lower-left block (T_11 and T_22 are lower triangular, so the
  // products skip their zero blocks).
  auto merge = [&](int lo, int size, int row, int col, bool active) {
    float acc[1][2][4];
    if (active) {
      zero(acc);
      warp_mma<kMergeProducts>(acc, plain(t), lo + size + row, plain(t), lo + col, lo + col, lo + size);
      store_pairs(acc, &scratch(lo + size + row, lo + col), scratch.kLd);
    }
    __syncthreads();
    if (active) {
      zero(acc);
      warp_mma<kMergeProducts>(acc, plain(t), lo + size + row, plain(scratch), lo + col, lo + size,
                               lo + size + row + 16);
      for_each(acc, 0, 0, [](int, int, float& x) { x = -x; });
      store_pairs(acc, &t(lo + size + row, lo + col), t.kLd);
    }
    __syncthreads();
  };
  merge(32 * (warp & 1), 16, 0, 0, warp < 2);
  merge(0, 32, 16 * ((warp >> 1) & 1), 16 * (warp & 1), warp < 4);
}

// Four values rounded to E at dst (8-byte aligned for 16-bit E), in one store.
template <class E>
__device__ __forceinline__ void store4(E* dst, float a, float b, float c, float d) {
  const float x[4] = {a, b, c, d};
  *reinterpret_cast<Run<E, 4>*>(dst) = pack_run<E>(x);
}

constexpr int kPrepareThreads = 256;  // 8 warps: 4 row blocks of 16 x 2 column halves

// The end of prepare, once T diag(beta e^gamma) (for W) and T diag(beta) are in shared memory:
//   W = (T diag(beta e^gamma)) K  where a pass reads it and, for the mma.sync passes, U = (T diag(beta)) V,
// each staged and stored with 16-byte rows: W in A's dead region, U in K's once W is formed, with V in
// blocks of kVBlock columns in A's region. T is lower triangular, so rows m0.. need k < m0 + 16.
template <class E, int K, int kVBlock, bool kFormsW>
__device__ void write_w_u(const Params& p, char* smem, const ChunkInfo& chunk, int hv, int tid) {
  using L = PrepareSmem<E, K>;
  using VTile = Tile<E, kChunk, kVBlock>;
  static_assert(VTile::kBytes <= L::KeyTile::kBytes && kVBlock <= L::kMaxVBlock);
  const typename L::KeyTile k_tile{smem_at<E>(smem, L::k)}, w_stage{smem_at<E>(smem, L::a)};
  const typename L::ChunkTile tbd_tile{smem_at<E>(smem, L::t_beta_decay)}, tb_tile{smem_at<E>(smem, L::t_beta)};
  const VTile v_tile{smem_at<E>(smem, L::a)}, u_stage{smem_at<E>(smem, L::k)};
  const int warp = tid / 32, m0 = 16 * (warp % 4), n_half = warp / 4;
  const std::int64_t t0 = chunk.start;
  const int rows = chunk.length;

  if constexpr (kFormsW) {
#pragma unroll 1
    for (int n0 = 0; n0 < K; n0 += 64) {
      float acc[1][4][4];
      zero(acc);
      warp_mma(acc, plain(tbd_tile), m0, plain(k_tile), n0 + 32 * n_half, 0, m0 + 16);
      store_accumulator(acc, plain(w_stage), m0, n0 + 32 * n_half);
    }
    __syncthreads();
    store_rows<kPrepareThreads>(w_stage, static_cast<E*>(p.w) + (t0 * p.HV + hv) * K,
                                static_cast<std::int64_t>(p.HV) * K, rows, tid);
  }

  if (p.u == nullptr) return;  // the wgmma passes form U themselves
  const std::int64_t v_row = (t0 * p.HV + hv) * p.V, v_stride = static_cast<std::int64_t>(p.HV) * p.V;
#pragma unroll 1
  for (int vb = 0; vb < p.V; vb += kVBlock) {
    __syncthreads();  // the previous staging (W's, then U's) is stored and its V read
    load_chunk_rows<kPrepareThreads>(v_tile, p.v, p.HV, hv, p.V, vb, chunk, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    float acc[1][kVBlock / 16][4];
    zero(acc);
    warp_mma(acc, plain(tb_tile), m0, plain(v_tile), kVBlock / 2 * n_half, 0, m0 + 16);
    store_accumulator(acc, plain(u_stage), m0, kVBlock / 2 * n_half);
    __syncthreads();
    store_rows<kPrepareThreads>(u_stage, static_cast<E*>(p.u) + v_row + vb, v_stride, rows, tid);
  }
}

// The chunk's bound on the log norm of its map (warmup.h) into chunk_log_norms [HV, chunks], by one warp from the
// keys' squared norms (the diagonal of K K^T, which A's product formed) and beta in shared memory: lane l the stretches
// of tokens l and l + 32, summed over the warp in a fixed order (the same bits on every run), then gamma_last. Rows
// past the chunk are zero, with beta 0.
__device__ void store_chunk_log_norm(const Params& p, int chunk, int hv, const float2& gamma_last,
                                     const float* key_norm2, const float* beta) {
  const int lane = threadIdx.x & 31;
  float sum = transition_log_stretch(beta[lane], key_norm2[lane]) +
              transition_log_stretch(beta[lane + 32], key_norm2[lane + 32]);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const std::int64_t at = static_cast<std::int64_t>(hv) * p.chunks + chunk;
  if (lane == 0) p.chunk_log_norms[at] = gamma_last.x + gamma_last.y + sum;
}

// Prepare's launch order. Where the passes form W (two warpgroups a CTA: the batched cells), a GVA group's value heads
// of one chunk are adjacent CTAs, so that each after the first finds its key head's q and k tiles in L2: with the chunk
// fastest they were `chunks` CTAs apart, about one resident wave, and 69% of those second reads went to DRAM (fwd
// 16/32 8192x4: 185 MB of prepare's 462 MB read; bench/NOTES.md, "Prepare's DRAM traffic"). Where prepare forms W the
// adjacent order measured slower (fwd 16/32 1x8192: prepare +8%, its DRAM writes +15%, reads unchanged; the cause not
// found), so that kernel keeps the chunk fastest.
__host__ __device__ constexpr bool group_adjacent_order(bool forms_w) { return !forms_w; }

// Adjacent: x = chunk * group + the value head's place in its group, y = the q/k head. Else x = chunk, y = value head.
dim3 prepare_grid(const Params& p, bool forms_w) {
  if (group_adjacent_order(forms_w)) return dim3(static_cast<unsigned>(p.chunks) * p.group, p.H);
  return dim3(p.chunks, p.HV);
}

struct PrepareBlock {
  int chunk, value_head;
};

template <bool kFormsW>
__device__ PrepareBlock prepare_block(const Params& p) {
  const int x = static_cast<int>(blockIdx.x), y = static_cast<int>(blockIdx.y);
  if constexpr (group_adjacent_order(kFormsW)) return {x / p.group, y * p.group + x % p.group};
  return {x, y};
}

// kFormsW: whether prepare forms W (the plan's prepare_forms_w, seen as the pointer its workspace set), or the passes
// form it from T, beta and the gates. A template argument, so that a kernel that does not form W carries neither
// T diag(beta e^gamma) nor W's product: as runtime branches they cost the kernel that forms W (at its 64 registers) 12
// more bytes of spills and 2-4% of its time.
template <class E, int K, bool kFormsW>
__global__ void __launch_bounds__(kPrepareThreads, PrepareSmem<E, K>::ctas_per_sm) prepare_kernel(Params p) {
  using L = PrepareSmem<E, K>;
  extern __shared__ __align__(16) char smem[];
  const typename L::KeyTile q_tile{smem_at<E>(smem, L::q)}, k_tile{smem_at<E>(smem, L::k)};
  const typename L::FloatTile a_tile{smem_at<float>(smem, L::a)}, scratch{smem_at<float>(smem, L::q)};
  const typename L::ChunkTile tbd_tile{smem_at<E>(smem, L::t_beta_decay)}, tb_tile{smem_at<E>(smem, L::t_beta)};
  float2* gamma = smem_at<float2>(smem, L::gamma);
  float* beta = smem_at<float>(smem, L::beta);
  float* beta_decay = smem_at<float>(smem, L::beta_decay);
  float* key_norm2 = smem_at<float>(smem, L::key_norm2);
  __shared__ double first_half;  // the sum of the chunk's first 32 gates

  const PrepareBlock block = prepare_block<kFormsW>(p);
  const int hv = block.value_head, h = hv / p.group, tid = threadIdx.x, warp = tid / 32;
  const int m0 = 16 * (warp % 4), n_half = 32 * (warp / 4);
  const ChunkInfo chunk = p.chunk_table[block.chunk];
  const std::int64_t t0 = chunk.start;
  const int rows = chunk.length;

  // The gates are read first: the scan below waits on them, and their loads then overlap the copies' issue.
  // Rows past the chunk's end take g = 0 (the scan adds nothing) and beta = 0.
  float g = 0.f;
  if (tid < kChunk && tid < rows) {
    const std::int64_t index = (t0 + tid) * p.HV + hv;
    g = clamp_gate(load_gate<E>(p.g, index, p.g_float));
    beta[tid] = load_gate<E>(p.beta, index, p.beta_float);
  } else if (tid < kChunk) {
    beta[tid] = 0.f;
  }
  load_chunk_rows<kPrepareThreads>(q_tile, queries<E>(p), p.H, h, K, 0, chunk, tid);
  load_chunk_rows<kPrepareThreads>(k_tile, keys<E>(p), p.H, h, K, 0, chunk, tid);
  cp_async_commit();

  // Gate cumsum in float64 (chunk.cuh says why): two warps scan 32 rows each.
  double cumulative = g;
  if (tid < kChunk) {
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const double y = __shfl_up_sync(0xffffffffu, cumulative, offset);
      if ((tid & 31) >= offset) cumulative += y;
    }
    if (tid == 31) first_half = cumulative;
  }
  __syncthreads();
  if (tid >= 32 && tid < kChunk) cumulative += first_half;
  if (tid < kChunk) gamma[tid] = split_sum(cumulative);
  __syncthreads();
  if (tid < kChunk) {
    const float decay = __expf(static_cast<float>(cumulative));
    beta_decay[tid] = beta[tid] * decay;
    if (tid < rows) {
      const std::int64_t at = static_cast<std::int64_t>(hv) * p.tokens + t0 + tid;
      p.gamma[at] = gamma[tid];
      p.gate_in[at] = decay;
      p.gate_out[at] = chunk_decay(gamma[rows - 1], gamma[tid]);
      if (p.beta_by_head != nullptr) p.beta_by_head[at] = beta[tid];
    }
  }

  cp_async_wait<0>();
  __syncthreads();

  // Per chunk and head, rows of a [tokens, HV, C] tensor (P, T), of which only the lower blocks are
  // written (chunk.cuh's lower_blocks_end).
  const std::int64_t chunk_row = (t0 * p.HV + hv) * kChunk, chunk_stride = static_cast<std::int64_t>(p.HV) * kChunk;
  {
    float kk[1][4][4], qk[1][4][4];
    zero(kk);
    zero(qk);
    if (n_half < m0 + 16) {  // the two warps whose tile lies wholly above the diagonal keep their zeros
      warp_mma(kk, plain(k_tile), m0, transposed(k_tile), n_half, 0, K);
      warp_mma(qk, plain(q_tile), m0, transposed(k_tile), n_half, 0, K);
      // A = strict_tril(diag(beta) (K K^T) * Gamma), P = scale tril(Q K^T) * Gamma.
      for_each_decay<1, 4>(gamma, m0, n_half, [&](int r, int c, float decay, FragmentIndex at) {
        if (r == c) key_norm2[r] = at(kk);  // each row's in exactly one warp's tile
        const float a = beta[r] * at(kk) * decay, q = p.scale * at(qk) * decay;
        at(kk) = r > c ? a : 0.f;
        at(qk) = r >= c ? q : 0.f;
      });
    }
    store_pairs(kk, &a_tile(m0, n_half), a_tile.kLd);
    store_pairs(qk, static_cast<E*>(p.p) + chunk_row + m0 * chunk_stride + n_half, chunk_stride, rows - m0,
                lower_blocks_end(m0) - n_half);
  }
  __syncthreads();  // A is complete and Q read: Q's region holds the inverse's intermediate products
  // Each chunk's bound for the segment ends passes, by the last warp, idle in the inverse's first step.
  if (warp == kPrepareThreads / 32 - 1 && p.chunk_log_norms != nullptr) {
    store_chunk_log_norm(p, block.chunk, hv, gamma[kChunk - 1], key_norm2, beta);
  }
  invert_unit_lower<kInverseMergeProducts<E>>(a_tile, scratch);

  // T diag(beta e^gamma) where this call forms W and, where it forms U (the mma.sync passes), T diag(beta) into Q's
  // dead region; T to global memory as it is formed (the wgmma passes and the backward). Each thread converts runs of
  // four columns, writing the zeros above T's diagonal blocks into shared memory (its products read them) but not to
  // global memory (no reader does).
  const typename L::FloatTile& t_tile = a_tile;
  for (int i = tid; i < kChunk * kChunk / 4; i += kPrepareThreads) {
    const int r = i / (kChunk / 4), c = i % (kChunk / 4) * 4;
    const bool in_blocks = c < lower_blocks_end(r);
    const float4 x = in_blocks ? *reinterpret_cast<const float4*>(&t_tile(r, c)) : float4{0.f, 0.f, 0.f, 0.f};
    const float4 b = *reinterpret_cast<const float4*>(&beta[c]), bd = *reinterpret_cast<const float4*>(&beta_decay[c]);
    if constexpr (kFormsW) store4(&tbd_tile(r, c), x.x * bd.x, x.y * bd.y, x.z * bd.z, x.w * bd.w);
    if (p.u != nullptr) store4(&tb_tile(r, c), x.x * b.x, x.y * b.y, x.z * b.z, x.w * b.w);  // only U reads it
    if (r < rows && in_blocks) {
      const std::int64_t at = chunk_row + r * chunk_stride + c;
      if (p.t != nullptr) store4(static_cast<E*>(p.t) + at, x.x, x.y, x.z, x.w);
    }
  }
  __syncthreads();  // T diag(beta e^gamma) is complete and T read: A's region stages W
  if (L::kMaxVBlock == 128 && p.V % 128 == 0) {
    write_w_u<E, K, L::kMaxVBlock, kFormsW>(p, smem, chunk, hv, tid);
  } else {
    write_w_u<E, K, 64, kFormsW>(p, smem, chunk, hv, tid);
  }
}

}  // namespace

bool have_kernels(DType io, int K) {
  bool have = false;
  dispatch(io, K, [&]<class E, int kK>() { have = true; });
  return have;
}

cudaError_t probe_kernel_image() {
  cudaFuncAttributes attributes{};
  return cudaFuncGetAttributes(&attributes, start_kernel<__nv_bfloat16, 128>);
}

void launch_start(const Params& p, DType io, bool normalise, KernelSequence& kernels) {
  dispatch(io, p.K, [&]<class E, int K>() {
    const std::int64_t norm_blocks = normalise ? (static_cast<std::int64_t>(p.tokens) * p.H + 7) / 8 : 0;
    launch<start_kernel<E, K>>("gdn start_kernel", dim3(static_cast<unsigned>(1 + norm_blocks)), dim3(kStartThreads), 0,
                               kernels);
  });
}

// Passes that form W belong to the wgmma passes only (16-bit, K <= 128); elsewhere prepare forms W.
void launch_prepare(const Params& p, DType io, KernelSequence& kernels) {
  dispatch(io, p.K, [&]<class E, int K>() {
    auto record = [&]<bool kFormsW>() {
      launch<prepare_kernel<E, K, kFormsW>>("gdn prepare_kernel", prepare_grid(p, kFormsW), dim3(kPrepareThreads),
                                            PrepareSmem<E, K>::bytes, kernels);
    };
    if constexpr (sizeof(E) == 2 && K <= 128) {
      if (p.w == nullptr) return record.template operator()<false>();
    }
    record.template operator()<true>();
  });
}

}  // namespace deltatrain::gdn::cuda
