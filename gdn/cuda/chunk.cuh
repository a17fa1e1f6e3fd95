// Device pieces shared by the GDN kernels: reading gates in either dtype, sequence bounds, the chunk's
// gate cumsum, transposed column stores and fixed-order block reductions.
#pragma once

#include <cstdint>
#include <utility>

#include "mma.cuh"
#include "params.h"

namespace deltatrain::gdn::cuda {

// g and beta are float32 or the io dtype E.
template <class E>
__device__ __forceinline__ float load_gate(const void* base, std::int64_t index, bool is_float) {
  return is_float ? static_cast<const float*>(base)[index] : to_float(static_cast<const E*>(base)[index]);
}
template <class E>
__device__ __forceinline__ void store_gate(void* base, std::int64_t index, bool is_float, float value) {
  if (is_float) {
    static_cast<float*>(base)[index] = value;
  } else {
    static_cast<E*>(base)[index] = from_float<E>(value);
  }
}

// dg of the chunk's rows from dgamma (shared memory, one float a row): row r's is the sum of dgamma over rows
// rows-1 down to r, in that order, by the caller's thread r (`thread` counts from the first of its group) of the
// first `rows`.
template <class E>
__device__ __forceinline__ void store_chunk_dg(const Params& p, const float* dgamma, std::int64_t t0, int rows,
                                               int hv, int thread) {
  const int r = thread;
  if (r >= rows) return;
  float dg = 0.f;
  for (int c = rows - 1; c >= r; --c) dg += dgamma[c];
  store_gate<E>(p.dg, (t0 + r) * p.HV + hv, p.g_float, dg);
}

// First token of sequence n in the flattened B*T tokens (n == N gives the end of the last one).
__device__ __forceinline__ std::int64_t sequence_start(const Params& p, int n) {
  if (p.cu_seqlens == nullptr) return static_cast<std::int64_t>(n) * p.T;
  return p.cu_seqlens_int64 ? static_cast<const std::int64_t*>(p.cu_seqlens)[n]
                            : static_cast<const std::int32_t*>(p.cu_seqlens)[n];
}

// q or k as the kernels consume them: L2-normalised copies when the norm is on.
template <class E>
__device__ __forceinline__ const E* queries(const Params& p) {
  return static_cast<const E*>(p.l2norm ? p.q_normed : p.q);
}
template <class E>
__device__ __forceinline__ const E* keys(const Params& p) {
  return static_cast<const E*>(p.l2norm ? p.k_normed : p.k);
}

// The in-chunk cumulative decays gamma (Params::gamma) are sums of gates clamped at this floor, formed in
// float64 and kept as the unevaluated sum hi + lo of two floats, so that e^(gamma_i - gamma_j), the decay from
// token j to token i, is as exact as the gates it adds: in float32 the sums of strong gates (g = -1e4) round
// away the small ones after them, and a gate of -inf (a full reset of the state) would make the difference
// -inf - (-inf) = NaN. A gate at the floor already decays to exactly 0 in float32 (e^-1e4 underflows), so
// clamping changes no decay; 64 of them stay far inside float64's exact range. A NaN gate is not clamped
// (NaN < floor is false) and stays NaN.
inline constexpr float kGateFloor = -1e4f;
__device__ __forceinline__ float clamp_gate(float g) { return g < kGateFloor ? kGateFloor : g; }
__device__ __forceinline__ float2 split_sum(double gamma) {
  const float hi = static_cast<float>(gamma);
  return {hi, static_cast<float>(gamma - hi)};
}
// e^x for a decay's exponent x <= 0: __expf's own product by log2(e) and ex2, with results below 2^-126 flushed to
// zero (.ftz). __expf gives those as subnormals, at three more instructions each (a compare and two predicated
// multiplies around the ex2). Every decay of 2^-126 or more is __expf's bits; a flushed one moves the term it scales
// by less than 2^-126 times its bf16 operands' product, far below their rounding.
__device__ __forceinline__ float decay_of(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}
// e^(gamma_i - gamma_j) for i >= j (gamma_i <= gamma_j). The highs' difference is exact where they are within a
// factor of two (Sterbenz), and where they are not it is so large that the decay is negligible or zero; the
// lows' difference then restores what the highs dropped. Three float adds: no float64 in the kernels' loops.
__device__ __forceinline__ float chunk_decay(float2 gamma_i, float2 gamma_j) {
  return decay_of((gamma_i.x - gamma_j.x) + (gamma_i.y - gamma_j.y));
}

// Calls f(r, c, decay, at) for every element `at` of a warp's MT x NT accumulator tiles at rows m0.., columns
// n0.. (gamma in shared memory, 16-byte aligned), with decay = chunk_decay(gamma[r], gamma[c]) formed for every
// element. Each lane reads its rows' gamma and, per 8-column block, its two columns' gamma once, before any
// arithmetic, so no lane branches around a load or an exponential: the masked form
// `r >= c ? chunk_decay(gamma[r], gamma[c]) : 0` put each element's two loads and exponential behind a branch
// of its own, serialised (prepare's gating was 11.8% of its ncu samples). Above the diagonal the decay may
// overflow to inf: f masks with a select (r >= c ? x : 0), which drops it.
template <int MT, int NT, class F>
__device__ __forceinline__ void for_each_decay(const float2* gamma, int m0, int n0, F&& f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) {
    const float2 row_gamma[2] = {gamma[m0 + 16 * mi + g], gamma[m0 + 16 * mi + g + 8]};
#pragma unroll
    for (int ni = 0; ni < NT; ++ni) {
      const float4 columns = *reinterpret_cast<const float4*>(&gamma[n0 + 8 * ni + 2 * t]);  // gamma of c, c + 1
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 column_gamma = e & 1 ? float2{columns.z, columns.w} : float2{columns.x, columns.y};
        f(m0 + 16 * mi + g + 8 * (e >> 1), n0 + 8 * ni + 2 * t + (e & 1), chunk_decay(row_gamma[e >> 1], column_gamma),
          FragmentIndex{mi, ni, e});
      }
    }
  }
}

// Where row i (0..63) of the chunk lies in a per-head vector [HV, tokens] of value head hv (gamma, the gates, beta by
// head): rows past the chunk's end repeat the last one, so that a copy of the chunk is always 64 entries.
__device__ __forceinline__ std::int64_t head_vector_at(const Params& p, int hv, const ChunkInfo& chunk, int i) {
  return static_cast<std::int64_t>(hv) * p.tokens + chunk.start + (i < chunk.length ? i : chunk.length - 1);
}

// Starts copying the chunk's in-chunk cumulative decays gamma[0..63] of value head hv into `gamma`;
// rows past the chunk's end repeat the last one (their g is zero). Threads 0..63 call it.
__device__ __forceinline__ void load_gamma_async(const Params& p, float2* gamma, int hv, const ChunkInfo& chunk,
                                                 int thread) {
  if (thread < kChunk) cp_async_8(&gamma[thread], p.gamma + head_vector_at(p, hv, chunk, thread), true);
}

// Starts copying the chunk's gate vectors e^gamma and e^(gamma_last - gamma) of value head hv into
// gate_in[0..63] and gate_out[0..63]; rows past the chunk's end repeat the last one, so gate_in[63] is the
// decay over the whole chunk. Threads 0..127 call it.
__device__ __forceinline__ void load_gates_async(const Params& p, float* gate_in, float* gate_out, int hv,
                                                 const ChunkInfo& chunk, int thread) {
  if (thread < 2 * kChunk) {
    const int i = thread % kChunk;
    const std::int64_t at = head_vector_at(p, hv, chunk, i);
    if (thread < kChunk) {
      cp_async_4(&gate_in[i], p.gate_in + at, true);
    } else {
      cp_async_4(&gate_out[i], p.gate_out + at, true);
    }
  }
}

// Starts copying the chunk's entries of a float [HV, tokens] vector of value head hv (beta_by_head) into dst[0..63];
// rows past the chunk's end repeat the last one, as the gates do. Threads 0..63 call it.
__device__ __forceinline__ void load_head_vector_async(const float* src, float* dst, const Params& p, int hv,
                                                       const ChunkInfo& chunk, int thread) {
  if (thread < kChunk) cp_async_4(&dst[thread], src + head_vector_at(p, hv, chunk, thread), true);
}

// Writes a warp's 16 x 8 NT accumulator (rows: 16 consecutive channels; columns: consecutive tokens),
// rounded to E, to token-major memory: token c's 16 channels at dst + c * stride, for
// c < rows_valid. The transpose goes through the warp's shared `staging` tile, so that the global stores
// are 16-byte vectors; stage_token_rows is the first half, for callers that store later. For 16-bit E on sm_90 the
// transpose is stmatrix's (.trans, NT / 2 of them, from packed pairs) rather than 8 NT scalar 2-byte stores, which
// sat on the state passes' chains.
template <class E, int NT>
__device__ __forceinline__ void stage_token_rows(const float (&acc)[1][NT][4], Tile<E, 8 * NT, 16> staging) {
  __syncwarp();  // the previous store has read the staging tile
  store_accumulator(acc, transposed(staging), 0, 0);
  __syncwarp();
}
template <class E, int NT>
__device__ __forceinline__ void store_token_rows(const float (&acc)[1][NT][4], Tile<E, 8 * NT, 16> staging, E* dst,
                                                 std::int64_t stride, int rows_valid) {
  stage_token_rows(acc, staging);
  store_rows<32>(staging, dst, stride, rows_valid, threadIdx.x & 31);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// The sum of `x` over the block, in a fixed order (warp trees, then warps in index order); every thread
// gets it. `scratch` holds one float per warp.
template <int NTHREADS>
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  x = warp_sum(x);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < NTHREADS / 32; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// Row sums of acc(r, c) * tile(r, c) over the warp tile's columns (see row_sums; the same order of sums),
// without a second accumulator-sized array.
template <int MT, int NT, class TileT>
__device__ __forceinline__ void row_dots(float (&acc)[MT][NT][4], TileT tile, int m0, int n0, float (&sums)[2 * MT]) {
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) {
    const int top = m0 + 16 * mi + g;
    float lo = 0.f, hi = 0.f;
    for_each_pair_with(row_block(acc, mi), plain(tile), m0 + 16 * mi, n0,
                       [&](int r, int, float& x0, float& x1, float2 y) {
                         (r == top ? lo : hi) += x0 * y.x + x1 * y.y;
                       });
    sums[2 * mi] = quad_sum(lo);
    sums[2 * mi + 1] = quad_sum(hi);
  }
}

// Per-row values of a 64-row matrix held by 8 warps as 16 x 32 accumulators (warp w: rows m0 = 16 (w % 4),
// columns n0 = 32 (w / 4)), one per column half: rows[0] and rows[1] (rows m0 + g and m0 + g + 8, equal
// across the lane quad) go to sums[n0 / 32][64].
__device__ __forceinline__ void store_row_pair(const float (&rows)[2], float* sums, int m0, int n0) {
  const int lane = threadIdx.x & 31;
  if ((lane & 3) == 0) {
    sums[2 * n0 + m0 + (lane >> 2)] = rows[0];
    sums[2 * n0 + m0 + (lane >> 2) + 8] = rows[1];
  }
}

// One halving step of store_column_sums: of the first 2 kHalf values, the lanes with bit `offset` set keep the
// upper half and the others the lower, each adding its partner's copy of the half it keeps. The indices are
// constants of the unrolled loop, so the values stay in registers (a loop bound from an outer loop put them in
// local memory).
template <int kHalf, int N>
__device__ __forceinline__ void keep_half(float (&v)[N], int offset) {
  static_assert(2 * kHalf <= N);
  const bool upper = (threadIdx.x & offset) != 0;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float kept = upper ? v[i + kHalf] : v[i], given = upper ? v[i] : v[i + kHalf];
    v[i] = kept + __shfl_xor_sync(0xffffffffu, given, offset);
  }
}

// The in-chunk decay terms of dgamma: a factor e^(gamma_i - gamma_j) on entry (i, j) of a 64 x 64 matrix X
// gives X(i, j) to dgamma_i and -X(i, j) to dgamma_j, so row r gets rowsum(X)_r - colsum(X)_r. X is held by
// 8 warps as 16 x 32 accumulators (NT = 4; warp w: rows m0 = 16 (w % 4), columns n0 = 32 (w / 4)), or by one
// warpgroup's 4 warps as 16 x 64 ones (NT = 8; rows m0 = 16 w, n0 = 0); each warp writes its partial sums to
// `parts` (row sums per block of columns, then column sums per block of 16 rows: 6 x 64 floats for NT = 4,
// 5 x 64 for NT = 8), and decay_balance<NT> adds them up in a fixed order once the warps have synchronised.
template <int NT>
inline constexpr int kColumnBlocks = kChunk / (8 * NT);
// The sums over the 16 rows of a warp's 16 x 8 NT accumulator, per column: columns[n0 + c] = sum_r x(r, c).
// The 8 lanes of a column pair (lane bits 2-4) reduce its 2 NT values by halving, each keeping a quarter of
// them: 7 NT / 4 shuffles, against 6 NT for a butterfly per value, and lane group g ends with values
// [g NT / 4, (g + 1) NT / 4).
template <int NT>
__device__ __forceinline__ void store_column_sums(const float (&x)[1][NT][4], float* columns, int n0) {
  static_assert(NT % 4 == 0, "three halvings of 2 NT values");
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float v[2 * NT];  // v[2 ni]: column 8 ni + 2 t, v[2 ni + 1] the next
#pragma unroll
  for (int ni = 0; ni < NT; ++ni) {
    v[2 * ni] = x[0][ni][0] + x[0][ni][2];
    v[2 * ni + 1] = x[0][ni][1] + x[0][ni][3];
  }
  keep_half<NT>(v, 16);
  keep_half<NT / 2>(v, 8);
  keep_half<NT / 4>(v, 4);
#pragma unroll
  for (int i = 0; i < NT / 4; ++i) {
    const int at = g * (NT / 4) + i;
    columns[n0 + 8 * (at >> 1) + 2 * t + (at & 1)] = v[i];
  }
}
template <int NT>
__device__ __forceinline__ void store_row_column_sums(const float (&x)[1][NT][4], int m0, int n0, float* parts) {
  float rows[2];
  row_sums(x, rows);
  store_row_pair(rows, parts, m0, n0);
  store_column_sums(x, parts + kColumnBlocks<NT> * kChunk + m0 * 4, n0);  // m0 / 16 * kChunk
}
// The sum of parts[(kFirst + i) * 64 + r] over i < kBlocks, left to right.
template <int kFirst, int... kBlock>
__device__ __forceinline__ float sum_of_blocks(const float* parts, int r, std::integer_sequence<int, kBlock...>) {
  return (... + parts[(kFirst + kBlock) * kChunk + r]);
}
template <int NT = 4>
__device__ __forceinline__ float decay_balance(const float* parts, int r) {
  constexpr int kColumns = kColumnBlocks<NT>;
  return sum_of_blocks<0>(parts, r, std::make_integer_sequence<int, kColumns>{}) -
         sum_of_blocks<kColumns>(parts, r, std::make_integer_sequence<int, kChunk / 16>{});
}

// The WY inverse's backward from -dA = X T^T (X = T^T dT), by warps holding 16 x 8 NT blocks (rows m0, columns
// n0) of the chunk's 64 x 64 matrices (decay_balance's two layouts): F = dA * diag(beta) Gamma (strictly lower) into
// f_tile (dK gets F K + F^T K); E = dA * (K K^T) * Gamma, whose row sums (dbeta) go to e_sums (per block of columns)
// and beta E's row and column sums (dgamma: beta E = dA * A) to e_parts. minus_da and kk (the warp's blocks of -dA
// and K K^T) are consumed; decays are the blocks' chunk_decay, as for_each_decay forms them (masked here), for a
// caller that has them from another product over the same blocks.
template <int NT, class SquareT>
__device__ __forceinline__ void inverse_backward(float (&minus_da)[1][NT][4], float (&kk)[1][NT][4],
                                                 const float (&decays)[1][NT][4], SquareT f_tile, const float* beta,
                                                 int m0, int n0, float* e_sums, float* e_parts) {
  float f[1][NT][4];
  for_each_index<1, NT>(m0, n0, [&](int r, int c, FragmentIndex at) {
    const float decay = r > c ? at(decays) : 0.f;
    float &x = at(minus_da), &kdot = at(kk);
    at(f) = -x * beta[r] * decay;
    x = -x * kdot * decay;  // E
    kdot = beta[r] * x;     // beta E
  });
  store_accumulator(f, plain(f_tile), m0, n0);
  float sums[2];
  row_sums(minus_da, sums);
  store_row_pair(sums, e_sums, m0, n0);
  store_row_column_sums(kk, m0, n0, e_parts);
}
// The same with the decays formed here from gamma.
template <int NT, class SquareT>
__device__ __forceinline__ void inverse_backward(float (&minus_da)[1][NT][4], float (&kk)[1][NT][4], SquareT f_tile,
                                                 const float2* gamma, const float* beta, int m0, int n0,
                                                 float* e_sums, float* e_parts) {
  float decays[1][NT][4];
  for_each_decay<1, NT>(gamma, m0, n0, [&](int, int, float decay, FragmentIndex at) { at(decays) = decay; });
  inverse_backward(minus_da, kk, decays, f_tile, beta, m0, n0, e_sums, e_parts);
}

// Starts copying a chunk's rows of a token-major tensor [tokens, heads, width] (head `head`, columns from
// `column`) into `tile`; rows past the chunk are zero-filled.
template <int NTHREADS, class TileT>
__device__ __forceinline__ void load_chunk_rows(TileT tile, const void* base, int heads, int head, int width, int column,
                                                const ChunkInfo& chunk, int thread) {
  using E = typename TileT::Element;
  const std::int64_t row = (static_cast<std::int64_t>(chunk.start) * heads + head) * width + column;
  load_rows_async<NTHREADS>(tile, static_cast<const E*>(base) + row, static_cast<std::int64_t>(heads) * width,
                            chunk.length, thread);
}

// A chunk's lower-triangular matrices (P and T: [tokens, HV, C] tensors) are kept in
// memory as their 16 x 16 blocks on and below the diagonal: prepare writes only those, and each reader zero-fills the
// others in shared memory without reading them, so 6 of a tile's 16 blocks never move (bench/NOTES.md, "The lower
// blocks only"). Row r's blocks end at column lower_blocks_end(r).
// (Shifts, not divisions: rows and columns are not negative, and a signed division costs a kernel at its register cap
// the instructions and registers of its rounding toward zero.)
__device__ __forceinline__ constexpr int lower_blocks_end(int row) { return ((row >> 4) + 1) << 4; }
struct LowerBlocks {
  __device__ __forceinline__ constexpr bool operator()(int row, int column) const { return column >> 4 <= row >> 4; }
};

// Starts copying a chunk's C x C tile of such a matrix into `tile`: its lower blocks from memory, zeros elsewhere
// (also on rows past the chunk).
template <int NTHREADS, class TileT>
__device__ __forceinline__ void load_lower_chunk_tile(TileT tile, const void* base, int heads, int head,
                                                      const ChunkInfo& chunk, int thread) {
  static_assert(TileT::kRows == kChunk && TileT::kCols == kChunk);
  using E = typename TileT::Element;
  const std::int64_t row = (static_cast<std::int64_t>(chunk.start) * heads + head) * kChunk;
  load_rows_async<NTHREADS>(tile, static_cast<const E*>(base) + row, static_cast<std::int64_t>(heads) * kChunk,
                            chunk.length, thread, LowerBlocks{});
}

// A region of dynamic shared memory: `bytes` from offset `at`, 16-byte aligned.
template <class T>
__device__ __forceinline__ T* smem_at(char* base, int at) {
  return reinterpret_cast<T*>(base + at);
}

}  // namespace deltatrain::gdn::cuda
