// The parallel start of the chunked algorithm: the chunk schedule, the optional L2 norm of q and k, and
// per (chunk, value head) the WY/UT transform (gdn-kernels.md section 2):
//   gamma = in-chunk cumsum of g,  A = strict_tril(diag(beta) (K K^T) * Gamma),  T = (I + A)^-1 (float32),
//   W = T diag(beta e^gamma) K,  U = T diag(beta) V,  P = scale * tril(Q K^T) * Gamma.
#include "chunk.cuh"
#include "dispatch.cuh"
#include "launch.h"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kStartThreads = 256;

// The chunks of every sequence, in order: sequence_chunks[n] is the first chunk of sequence n. One block.
__device__ void schedule(const Params& p) {
  __shared__ int first_chunk[kStartThreads];
  const int per_thread = (p.sequences + kStartThreads - 1) / kStartThreads;
  const int begin = min(p.sequences, static_cast<int>(threadIdx.x) * per_thread);
  const int end = min(p.sequences, begin + per_thread);
  int count = 0;
  for (int n = begin; n < end; ++n) {
    count += static_cast<int>((sequence_start(p, n + 1) - sequence_start(p, n) + kChunk - 1) / kChunk);
  }
  first_chunk[threadIdx.x] = count;
  __syncthreads();
  if (threadIdx.x == 0) {
    int total = 0;
    for (int i = 0; i < kStartThreads; ++i) {
      const int c = first_chunk[i];
      first_chunk[i] = total;
      total += c;
    }
    p.sequence_chunks[p.sequences] = total;
  }
  __syncthreads();
  int chunk = first_chunk[threadIdx.x];
  for (int n = begin; n < end; ++n) {
    p.sequence_chunks[n] = chunk;
    const std::int64_t start = sequence_start(p, n), stop = sequence_start(p, n + 1);
    for (std::int64_t s = start; s < stop; s += kChunk) {
      const auto length = static_cast<std::int32_t>(stop - s < kChunk ? stop - s : kChunk);
      p.chunk_table[chunk++] = ChunkInfo{static_cast<std::int32_t>(s), length, n, 0};
    }
  }
}

// One warp per (token, head) row of q and of k, 8 rows per block: x / sqrt(sum x^2 + eps), and
// 1 / sqrt(...) for the backward.
template <class E, int K>
__device__ void l2norm_rows(const Params& p, std::int64_t block) {
  const std::int64_t row = block * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= static_cast<std::int64_t>(p.tokens) * p.H) return;
  constexpr int kPerLane = K / 32;
  for (int which = 0; which < 2; ++which) {
    const E* src = static_cast<const E*>(which == 0 ? p.q : p.k) + row * K;
    E* dst = static_cast<E*>(which == 0 ? p.q_normed : p.k_normed) + row * K;
    float x[kPerLane];
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      x[i] = to_float(src[lane + 32 * i]);
      sum += x[i] * x[i];
    }
    const float rstd = 1.f / sqrtf(warp_sum(sum) + 1e-6f);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) dst[lane + 32 * i] = from_float<E>(x[i] * rstd);
    if (lane == 0) (which == 0 ? p.q_rstd : p.k_rstd)[row] = rstd;
  }
}

// The first launch of both chunked passes: the chunk schedule in block 0 and, when the norm is on, the L2
// norm of q and k in the other blocks. The two are independent, and one launch costs the host less.
template <class E, int K>
__global__ void __launch_bounds__(kStartThreads) start_kernel(Params p) {
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
  static constexpr int q = 0;
  static constexpr int k = q + KeyTile::kBytes;
  static constexpr int a = k + KeyTile::kBytes;
  static constexpr int t_beta_decay = a;
  static constexpr int t_beta = a + ChunkTile::kBytes;
  // V comes in blocks of up to 128 columns (at most K, so that U's staging fits in q's region).
  static constexpr int kMaxVBlock = K < 128 ? K : 128;
  using VTile = Tile<E, kChunk, kMaxVBlock>;
  static constexpr int t = a + (FloatTile::kBytes > 2 * ChunkTile::kBytes ? FloatTile::kBytes : 2 * ChunkTile::kBytes);
  static constexpr int gamma = t + (FloatTile::kBytes > VTile::kBytes ? FloatTile::kBytes : VTile::kBytes);
  static constexpr int beta = gamma + kChunk * 4;
  static constexpr int beta_decay = beta + kChunk * 4;  // beta e^gamma
  static constexpr int solve = beta_decay + kChunk * 4;  // 3 blocks of 16 x 16
  static constexpr int bytes = solve + 3 * 256 * 4;
};

// T = (I + A)^-1 for strictly lower-triangular A (64 x 64, float32), by 16 x 16 blocks: the diagonal blocks
// by forward substitution (one lane a column), then T_ij = -T_ii sum_{m=j}^{i-1} A_im T_mj by distance i - j,
// each thread producing four adjacent columns of a row (one broadcast and one 16-byte load per four FMAs).
template <int NTHREADS>
__device__ void invert_unit_lower(Tile<float, kChunk, kChunk> a, Tile<float, kChunk, kChunk> t, float* scratch) {
  for (int i = threadIdx.x; i < kChunk * kChunk; i += NTHREADS) t(i / kChunk, i % kChunk) = 0.f;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (warp < 4 && lane < 16) {
    const int base = 16 * warp;
    float column[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float x = i == lane ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < i; ++m) x -= a(base + i, base + m) * column[m];
      column[i] = x;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) t(base + i, base + lane) = column[i];
  }
  __syncthreads();
  using Quad = float4;
  for (int distance = 1; distance < 4; ++distance) {
    const int quads = (4 - distance) * 64;  // blocks x 16 rows x 4 column quads
    for (int e = threadIdx.x; e < quads; e += NTHREADS) {
      const int block = e / 64, bi = distance + block, bj = bi - distance, r = (e % 64) / 4, c = (e % 4) * 4;
      Quad x{0.f, 0.f, 0.f, 0.f};
      for (int m = 16 * bj; m < 16 * bi; ++m) {
        const float am = a(16 * bi + r, m);
        const Quad tm = *reinterpret_cast<const Quad*>(&t(m, 16 * bj + c));
        x.x += am * tm.x;
        x.y += am * tm.y;
        x.z += am * tm.z;
        x.w += am * tm.w;
      }
      *reinterpret_cast<Quad*>(&scratch[block * 256 + r * 16 + c]) = x;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < quads; e += NTHREADS) {
      const int block = e / 64, bi = distance + block, bj = bi - distance, r = (e % 64) / 4, c = (e % 4) * 4;
      Quad y{0.f, 0.f, 0.f, 0.f};
      for (int m = 0; m <= r; ++m) {
        const float tm = t(16 * bi + r, 16 * bi + m);
        const Quad xm = *reinterpret_cast<const Quad*>(&scratch[block * 256 + m * 16 + c]);
        y.x -= tm * xm.x;
        y.y -= tm * xm.y;
        y.z -= tm * xm.z;
        y.w -= tm * xm.w;
      }
      *reinterpret_cast<Quad*>(&t(16 * bi + r, 16 * bj + c)) = y;
    }
    __syncthreads();
  }
}

// Four values rounded to E at dst (8-byte aligned for 16-bit E), in one store.
template <class E>
__device__ __forceinline__ void store4(E* dst, float a, float b, float c, float d) {
  if constexpr (std::is_same_v<E, float>) {
    *reinterpret_cast<float4*>(dst) = float4{a, b, c, d};
  } else {
    *reinterpret_cast<uint2*>(dst) = uint2{pack2<E>(a, b), pack2<E>(c, d)};
  }
}

constexpr int kPrepareThreads = 256;  // 8 warps: 4 row blocks of 16 x 2 column halves

// The end of prepare, once T diag(beta e^gamma) and T diag(beta) are in shared memory:
//   W = (T diag(beta e^gamma)) K  and  U = (T diag(beta)) V,
// each staged in q's region and stored with 16-byte rows. V comes in blocks of kVBlock columns into T's
// (dead) region, the first block while W is computed. T is lower triangular, so rows m0.. need k < m0 + 16.
template <class E, int K, int kVBlock>
__device__ void write_w_u(const Params& p, char* smem, const ChunkInfo& chunk, int hv, int tid) {
  using L = PrepareSmem<E, K>;
  using VTile = Tile<E, kChunk, kVBlock>;
  static_assert(VTile::kBytes <= L::KeyTile::kBytes && kVBlock <= L::kMaxVBlock);
  const typename L::KeyTile k_tile{smem_at<E>(smem, L::k)}, w_stage{smem_at<E>(smem, L::q)};
  const typename L::ChunkTile tbd_tile{smem_at<E>(smem, L::t_beta_decay)}, tb_tile{smem_at<E>(smem, L::t_beta)};
  const VTile v_tile{smem_at<E>(smem, L::t)}, u_stage{smem_at<E>(smem, L::q)};
  const int warp = tid / 32, m0 = 16 * (warp % 4), n_half = warp / 4;
  const std::int64_t t0 = chunk.start;
  const int rows = chunk.length;
  const std::int64_t v_row = (t0 * p.HV + hv) * p.V, v_stride = static_cast<std::int64_t>(p.HV) * p.V;
  load_chunk_rows<kPrepareThreads>(v_tile, p.v, p.HV, hv, p.V, 0, chunk, tid);
  cp_async_commit();

#pragma unroll 1
  for (int n0 = 0; n0 < K; n0 += 64) {
    float acc[1][4][4];
    zero(acc);
    warp_mma(acc, plain(tbd_tile), m0, plain(k_tile), n0 + 32 * n_half, 0, m0 + 16);
    store(acc, w_stage, m0, n0 + 32 * n_half);
  }
  __syncthreads();
  store_rows<kPrepareThreads>(w_stage, static_cast<E*>(p.w) + (t0 * p.HV + hv) * K, static_cast<std::int64_t>(p.HV) * K,
                              rows, tid);

#pragma unroll 1
  for (int vb = 0; vb < p.V; vb += kVBlock) {
    __syncthreads();  // the previous staging is stored and its V read
    if (vb > 0) {
      load_chunk_rows<kPrepareThreads>(v_tile, p.v, p.HV, hv, p.V, vb, chunk, tid);
      cp_async_commit();
    }
    cp_async_wait<0>();
    __syncthreads();
    float acc[1][kVBlock / 16][4];
    zero(acc);
    warp_mma(acc, plain(tb_tile), m0, plain(v_tile), kVBlock / 2 * n_half, 0, m0 + 16);
    store(acc, u_stage, m0, kVBlock / 2 * n_half);
    __syncthreads();
    store_rows<kPrepareThreads>(u_stage, static_cast<E*>(p.u) + v_row + vb, v_stride, rows, tid);
  }
}

template <class E, int K>
__global__ void __launch_bounds__(kPrepareThreads) prepare_kernel(Params p) {
  const bool with_t = p.t != nullptr;  // the backward keeps T
  using L = PrepareSmem<E, K>;
  extern __shared__ __align__(16) char smem[];
  const typename L::KeyTile q_tile{smem_at<E>(smem, L::q)}, k_tile{smem_at<E>(smem, L::k)};
  const typename L::FloatTile a_tile{smem_at<float>(smem, L::a)}, t_tile{smem_at<float>(smem, L::t)};
  const typename L::ChunkTile tbd_tile{smem_at<E>(smem, L::t_beta_decay)}, tb_tile{smem_at<E>(smem, L::t_beta)};
  const typename L::ChunkTile p_staging{smem_at<E>(smem, L::t)};
  const typename L::ChunkTile staging{smem_at<E>(smem, L::q)};
  float* gamma = smem_at<float>(smem, L::gamma);
  float* beta = smem_at<float>(smem, L::beta);
  float* beta_decay = smem_at<float>(smem, L::beta_decay);

  const int hv = blockIdx.y, h = hv / p.group, tid = threadIdx.x, warp = tid / 32;
  const int m0 = 16 * (warp % 4), n_half = 32 * (warp / 4);
  const ChunkInfo chunk = p.chunk_table[blockIdx.x];
  const std::int64_t t0 = chunk.start;
  const int rows = chunk.length;

  load_chunk_rows<kPrepareThreads>(q_tile, queries<E>(p), p.H, h, K, 0, chunk, tid);
  load_chunk_rows<kPrepareThreads>(k_tile, keys<E>(p), p.H, h, K, 0, chunk, tid);
  cp_async_commit();

  // Gate cumsum: two warps scan 32 rows each; rows past the end add zero.
  if (tid < kChunk) {
    const std::int64_t index = (t0 + tid) * p.HV + hv;
    float x = tid < rows ? load_gate<E>(p.g, index, p.g_float) : 0.f;
    beta[tid] = tid < rows ? load_gate<E>(p.beta, index, p.beta_float) : 0.f;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, x, offset);
      if ((tid & 31) >= offset) x += y;
    }
    gamma[tid] = x;
  }
  __syncthreads();
  if (tid >= 32 && tid < kChunk) gamma[tid] += gamma[31];
  __syncthreads();
  if (tid < kChunk) {
    const float decay = __expf(gamma[tid]);
    beta_decay[tid] = beta[tid] * decay;
    if (tid < rows) {
      const std::int64_t at = static_cast<std::int64_t>(hv) * p.tokens + t0 + tid;
      p.gamma[at] = gamma[tid];
      p.gate_in[at] = decay;
      p.gate_out[at] = __expf(gamma[rows - 1] - gamma[tid]);
    }
  }

  cp_async_wait<0>();
  __syncthreads();

  {
    float kk[1][4][4], qk[1][4][4];
    zero(kk);
    zero(qk);
    warp_mma(kk, plain(k_tile), m0, transposed(k_tile), n_half, 0, K);
    warp_mma(qk, plain(q_tile), m0, transposed(k_tile), n_half, 0, K);
    for_each(kk, m0, n_half, [&](int r, int c, float& x) {
      a_tile(r, c) = r > c ? beta[r] * x * __expf(gamma[r] - gamma[c]) : 0.f;
    });
    for_each(qk, m0, n_half, [&](int r, int c, float& x) {
      p_staging(r, c) = from_float<E>(r >= c ? p.scale * x * __expf(gamma[r] - gamma[c]) : 0.f);
    });
  }
  __syncthreads();
  const std::int64_t chunk_row = (t0 * p.HV + hv) * kChunk, chunk_stride = static_cast<std::int64_t>(p.HV) * kChunk;
  store_rows<kPrepareThreads>(p_staging, static_cast<E*>(p.p) + chunk_row, chunk_stride, rows, tid);
  __syncthreads();  // P's staging is read before T overwrites it
  invert_unit_lower<kPrepareThreads>(a_tile, t_tile, smem_at<float>(smem, L::solve));

  // A is dead: its region takes T diag(beta e^gamma) and T diag(beta); Q is dead: its region stages T.
  // Each thread converts runs of four columns.
  for (int i = tid; i < kChunk * kChunk / 4; i += kPrepareThreads) {
    const int r = i / (kChunk / 4), c = i % (kChunk / 4) * 4;
    const float4 x = *reinterpret_cast<const float4*>(&t_tile(r, c));
    const float4 b = *reinterpret_cast<const float4*>(&beta[c]), bd = *reinterpret_cast<const float4*>(&beta_decay[c]);
    store4(&tbd_tile(r, c), x.x * bd.x, x.y * bd.y, x.z * bd.z, x.w * bd.w);
    store4(&tb_tile(r, c), x.x * b.x, x.y * b.y, x.z * b.z, x.w * b.w);
    if (with_t) store4(&staging(r, c), x.x, x.y, x.z, x.w);
  }
  __syncthreads();
  if (with_t) {
    store_rows<kPrepareThreads>(staging, static_cast<E*>(p.t) + chunk_row, chunk_stride, rows, tid);
    __syncthreads();  // T's staging is read before W's overwrites it
  }
  if (L::kMaxVBlock == 128 && p.V % 128 == 0) {
    write_w_u<E, K, L::kMaxVBlock>(p, smem, chunk, hv, tid);
  } else {
    write_w_u<E, K, 64>(p, smem, chunk, hv, tid);
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

void launch_start(const Params& p, DType io, KernelSequence& kernels) {
  dispatch(io, p.K, [&]<class E, int K>() {
    const std::int64_t norm_blocks = p.l2norm ? (static_cast<std::int64_t>(p.tokens) * p.H + 7) / 8 : 0;
    launch<start_kernel<E, K>>("gdn start_kernel", dim3(static_cast<unsigned>(1 + norm_blocks)), dim3(kStartThreads), 0,
                               kernels);
  });
}

void launch_prepare(const Params& p, DType io, KernelSequence& kernels) {
  dispatch(io, p.K, [&]<class E, int K>() {
    launch<prepare_kernel<E, K>>("gdn prepare_kernel", dim3(p.chunks, p.HV), dim3(kPrepareThreads),
           PrepareSmem<E, K>::bytes, kernels);
  });
}

}  // namespace deltatrain::gdn::cuda
