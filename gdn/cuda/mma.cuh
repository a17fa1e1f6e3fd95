// Warp-level tensor-core matrix products over shared-memory tiles, the one building block of every GDN
// kernel. A product is written as acc += A * B where A and B are views of padded shared-memory tiles,
// each possibly transposed; the element type E picks the instruction:
//   bf16, fp16: mma.sync m16n8k16 with fragments from ldmatrix (.trans where the tile is stored k-major);
//   float:      three TF32 products (split into high and low parts) per m16n8k8, about float32 accuracy, or
//               where the caller asks (Tf32Products::one) a single product of operands rounded to TF32.
// Accumulators are float32 in the mma "C" layout: lane (g = lane / 4, t = lane % 4) holds rows g and g + 8,
// columns 2t and 2t + 1 of each 16 x 8 tile.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "tf32_rounding.h"
#include "vector_walk.h"

namespace deltatrain::gdn::cuda {

template <class E>
__device__ __forceinline__ float to_float(E x) {
  if constexpr (std::is_same_v<E, float>) {
    return x;
  } else if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    return __half2float(x);
  }
}

template <class E>
__device__ __forceinline__ E from_float(float x) {
  if constexpr (std::is_same_v<E, float>) {
    return x;
  } else if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return __float2half_rn(x);
  }
}

// A tile of ROWS x COLS elements in shared memory, rows padded by 16 bytes so that the eight rows one
// ldmatrix phase (or one quad of scalar fragment loads) touches fall in distinct banks.
template <class E, int ROWS, int COLS>
struct Tile {
  static constexpr int kRows = ROWS;
  static constexpr int kCols = COLS;
  static constexpr int kLd = COLS + 16 / static_cast<int>(sizeof(E));
  static constexpr int kBytes = ROWS * kLd * static_cast<int>(sizeof(E));
  using Element = E;
  E* ptr;
  __device__ __forceinline__ E& operator()(int r, int c) const { return ptr[r * kLd + c]; }
  __device__ __forceinline__ E* row(int r) const { return ptr + r * kLd; }
};

// A tile seen as a matrix operand: element (i, j) is tile(i, j), or tile(j, i) when kTransposed.
template <class TileT, bool kTransposed>
struct View {
  TileT tile;
  __device__ __forceinline__ float at(int i, int j) const {
    return to_float(kTransposed ? tile(j, i) : tile(i, j));
  }
};
template <class TileT>
__device__ __forceinline__ View<TileT, false> plain(TileT t) {
  return {t};
}
template <class TileT>
__device__ __forceinline__ View<TileT, true> transposed(TileT t) {
  return {t};
}

// ---- 16-bit path -------------------------------------------------------------------------------------

__device__ __forceinline__ std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}
// ldmatrix's inverse (sm_90): four 8 x 8 matrices from registers in the same layout, lanes 8q..8q+7 giving the
// addresses of matrix q's rows (.trans: of its columns).
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void stmatrix_x4(const std::uint32_t (&r)[4], const void* p) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n"
               :
               : "r"(smem_address(p)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}
__device__ __forceinline__ void stmatrix_x4_trans(const std::uint32_t (&r)[4], const void* p) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n"
               :
               : "r"(smem_address(p)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}
#endif

template <class E>
__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                          std::uint32_t b1) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// A fragment (16 x 16 at rows m0, columns k0).
template <class TileT, bool kT>
__device__ __forceinline__ void load_a16(std::uint32_t (&a)[4], const View<TileT, kT>& v, int m0, int k0) {
  const int lane = threadIdx.x & 31;
  if constexpr (!kT) {  // tile[m][k]
    ldmatrix_x4(a, &v.tile(m0 + (lane & 15), k0 + (lane >> 4) * 8));
  } else {  // tile[k][m]
    ldmatrix_x4_trans(a, &v.tile(k0 + (lane & 7) + (lane >> 4) * 8, m0 + ((lane >> 3) & 1) * 8));
  }
}

// B fragments of two adjacent 16 x 8 tiles (rows k0, columns n0 and n0 + 8).
template <class TileT, bool kT>
__device__ __forceinline__ void load_b16(std::uint32_t (&b)[4], const View<TileT, kT>& v, int k0, int n0) {
  const int lane = threadIdx.x & 31;
  if constexpr (kT) {  // tile[n][k]
    ldmatrix_x4(b, &v.tile(n0 + (lane & 7) + (lane >> 4) * 8, k0 + ((lane >> 3) & 1) * 8));
  } else {  // tile[k][n]
    ldmatrix_x4_trans(b, &v.tile(k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n0 + (lane >> 4) * 8));
  }
}

// ---- float path (3xTF32) -----------------------------------------------------------------------------

__device__ __forceinline__ void mma_tf32(float (&c)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  asm(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// How many TF32 products a float product takes: three (each operand split into a high part and a remainder: about
// float32, 2^-22 relative) or one (the operands rounded to TF32: 2^-11 relative, for results that are stored in 16 bits
// anyway; a third of the tensor-core instructions and no split).
enum class Tf32Products { three, one };

// The TF32 operands of x: with three products, a high part and a remainder, x ~ hi + lo to about 2^-22 relative; with
// one, x rounded (lo unused). For finite x the tensor core reads the same operands as from cvt.rna.tf32.f32 of x and of
// x - hi, in 4 instructions an element instead of 7 (1 for one product): ptxas guards each cvt against inf and NaN
// with a compare and a select, which these operands never need (tf32_rounding.h).
template <Tf32Products kProducts>
__device__ __forceinline__ void tf32_parts(float x, std::uint32_t& hi, std::uint32_t& lo) {
  if constexpr (kProducts == Tf32Products::one) {
    hi = tf32_operand(__float_as_uint(x));
  } else {
    hi = tf32_value(__float_as_uint(x));
    lo = tf32_operand(__float_as_uint(x - __uint_as_float(hi)));
  }
}

// ---- the warp product ---------------------------------------------------------------------------------

// acc (MT x NT tiles of 16 x 8 at rows m0, columns n0) += A[m0.., k_begin..k_end) * B[k_begin..k_end), n0..).
// kProducts applies to float tiles only.
template <Tf32Products kProducts = Tf32Products::three, int MT, int NT, class VA, class VB>
__device__ __forceinline__ void warp_mma(float (&acc)[MT][NT][4], const VA& a, int m0, const VB& b, int n0,
                                         int k_begin, int k_end) {
  static_assert(NT % 2 == 0, "B fragments are loaded two n-tiles at a time");
  using E = typename decltype(a.tile)::Element;
  static_assert(std::is_same_v<E, float> || kProducts == Tf32Products::three, "16-bit tiles take one mma a product");
  if constexpr (!std::is_same_v<E, float>) {
    // All fragments of a k-step are loaded before its products: ldmatrix is ordered (volatile) and a warp
    // often has its scheduler to itself, so a load right before its use would stall every product. Two
    // k-steps at a time for one row block; two row blocks already give each fragment twice the products.
    constexpr int kStepsUnrolled = MT == 1 ? 2 : 1;
#pragma unroll kStepsUnrolled
    for (int k = k_begin; k < k_end; k += 16) {
      std::uint32_t af[MT][4], bf[NT / 2][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) load_a16(af[mi], a, m0 + 16 * mi, k);
#pragma unroll
      for (int nj = 0; nj < NT / 2; ++nj) load_b16(bf[nj], b, k, n0 + 16 * nj);
#pragma unroll
      for (int nj = 0; nj < NT / 2; ++nj) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          mma_16816<E>(acc[mi][2 * nj], af[mi], bf[nj][0], bf[nj][1]);
          mma_16816<E>(acc[mi][2 * nj + 1], af[mi], bf[nj][2], bf[nj][3]);
        }
      }
    }
  } else {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int k = k_begin; k < k_end; k += 8) {
      std::uint32_t ahi[MT][4], alo[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        const int m = m0 + 16 * mi + g;
        tf32_parts<kProducts>(a.at(m, k + t), ahi[mi][0], alo[mi][0]);
        tf32_parts<kProducts>(a.at(m + 8, k + t), ahi[mi][1], alo[mi][1]);
        tf32_parts<kProducts>(a.at(m, k + t + 4), ahi[mi][2], alo[mi][2]);
        tf32_parts<kProducts>(a.at(m + 8, k + t + 4), ahi[mi][3], alo[mi][3]);
      }
#pragma unroll
      for (int ni = 0; ni < NT; ++ni) {
        std::uint32_t bhi[2], blo[2];
        tf32_parts<kProducts>(b.at(k + t, n0 + 8 * ni + g), bhi[0], blo[0]);
        tf32_parts<kProducts>(b.at(k + t + 4, n0 + 8 * ni + g), bhi[1], blo[1]);
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          if constexpr (kProducts == Tf32Products::three) {
            mma_tf32(acc[mi][ni], alo[mi], bhi);
            mma_tf32(acc[mi][ni], ahi[mi], blo);
          }
          mma_tf32(acc[mi][ni], ahi[mi], bhi);
        }
      }
    }
  }
}

template <int MT, int NT>
__device__ __forceinline__ void zero(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mi][ni][r] = 0.f;
}

// Row block mi (rows 16 mi..) of a warp's accumulator tiles, as an accumulator of its own: the same registers.
template <int MT, int NT>
__device__ __forceinline__ float (&row_block(float (&acc)[MT][NT][4], int mi))[1][NT][4] {
  return *reinterpret_cast<float(*)[1][NT][4]>(&acc[mi]);
}
// Tiles ni0 .. ni0 + N - 1 (columns 8 ni0 ..) of a warp's one row block, as an accumulator of their own.
template <int N, int NT>
__device__ __forceinline__ float (&column_block(float (&acc)[1][NT][4], int ni0))[1][N][4] {
  return *reinterpret_cast<float(*)[1][N][4]>(&acc[0][ni0]);
}

// Calls f(row, col, lo&, hi&) for every pair of adjacent accumulator elements (columns col and col + 1) of
// a warp tile placed at (m0, n0).
template <int MT, int NT, class F>
__device__ __forceinline__ void for_each_pair(float (&acc)[MT][NT][4], int m0, int n0, F&& f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        f(m0 + 16 * mi + g + 8 * half, n0 + 8 * ni + 2 * t, acc[mi][ni][2 * half], acc[mi][ni][2 * half + 1]);
}

// Calls f(row, col, value&) for every accumulator element of a warp tile placed at (m0, n0).
template <int MT, int NT, class F>
__device__ __forceinline__ void for_each(float (&acc)[MT][NT][4], int m0, int n0, F&& f) {
  for_each_pair(acc, m0, n0, [&](int r, int c, float& lo, float& hi) {
    f(r, c, lo);
    f(r, c + 1, hi);
  });
}

// An element of a warp's mma accumulator tiles (the fragment layout above): at(acc) is acc's value there.
struct FragmentIndex {
  int mi, ni, e;
  template <int MT, int NT>
  __device__ __forceinline__ float& operator()(float (&acc)[MT][NT][4]) const {
    return acc[mi][ni][e];
  }
  template <int MT, int NT>
  __device__ __forceinline__ float operator()(const float (&acc)[MT][NT][4]) const {
    return acc[mi][ni][e];
  }
};

// Calls f(r, c, at) for every element `at` of a warp's MT x NT accumulator tiles at rows m0.., columns n0.., row
// block by row block, then 8-column block by block, then the fragment's four in register order.
template <int MT, int NT, class F>
__device__ __forceinline__ void for_each_index(int m0, int n0, F&& f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        f(m0 + 16 * mi + g + 8 * (e >> 1), n0 + 8 * ni + 2 * t + (e & 1), FragmentIndex{mi, ni, e});
}

// The same for two accumulators of one shape: f(row, col, a, b).
template <int MT, int NT, class F>
__device__ __forceinline__ void for_each(float (&a)[MT][NT][4], float (&b)[MT][NT][4], int m0, int n0, F&& f) {
  for_each_index<MT, NT>(m0, n0, [&](int r, int c, FragmentIndex at) { f(r, c, at(a), at(b)); });
}

// The sum over the four lanes of a quad (the lanes holding one accumulator row), in every lane of it.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Sums over the columns a warp tile holds, per row: returns, for this lane, the partial sums of rows
// m0 + 16 mi + g (index 2 mi) and + 8 (index 2 mi + 1), complete over the warp's columns.
template <int MT, int NT>
__device__ __forceinline__ void row_sums(const float (&values)[MT][NT][4], float (&sums)[2 * MT]) {
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) {
    float lo = 0.f, hi = 0.f;
#pragma unroll
    for (int ni = 0; ni < NT; ++ni) {
      lo += values[mi][ni][0] + values[mi][ni][1];
      hi += values[mi][ni][2] + values[mi][ni][3];
    }
    sums[2 * mi] = quad_sum(lo);
    sums[2 * mi + 1] = quad_sum(hi);
  }
}

// ---- register operands ---------------------------------------------------------------------------------

// Two values as one 32-bit register of the 16-bit type E (the lower column in the low half), and back.
template <class E>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  }
}
template <class E>
__device__ __forceinline__ float2 unpack2(std::uint32_t bits) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    // A bfloat16 is the high half of the float it widens to: one shift and one mask. (__bfloat1622float2 moves the
    // high element down and back up, a PRMT and a shift where the mask is one LOP3.)
    return float2{__uint_as_float(bits << 16), __uint_as_float(bits & 0xFFFF0000u)};
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  }
}

// load_a16's inverse: a 16 x 16 block at rows m0, columns k0 of a view from A-fragment registers. On sm_90 one
// stmatrix (.trans for a transposed view), whose four 8 x 8 blocks are the fragment's registers; before, element
// by element.
template <class TileT, bool kT>
__device__ __forceinline__ void store_a16(const std::uint32_t (&a)[4], const View<TileT, kT>& v, int m0, int k0) {
  const int lane = threadIdx.x & 31;
#if __CUDA_ARCH__ >= 900
  // Register b holds rows 8 (b & 1), columns 8 (b >> 1) of the block; lane 8 b + i gives the address of its row i
  // (of its column i, transposed).
  const int b = lane >> 3, i = lane & 7, block_row = m0 + 8 * (b & 1), block_column = k0 + 8 * (b >> 1);
  if constexpr (kT) {
    stmatrix_x4_trans(a, &v.tile(block_column + i, block_row));
  } else {
    stmatrix_x4(a, &v.tile(block_row + i, block_column));
  }
#else
  using E = typename TileT::Element;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const float2 x = unpack2<E>(a[b]);
    const int r = m0 + g + 8 * (b & 1), c = k0 + 8 * (b >> 1) + 2 * t;
    (kT ? v.tile(c, r) : v.tile(r, c)) = from_float<E>(x.x);
    (kT ? v.tile(c + 1, r) : v.tile(r, c + 1)) = from_float<E>(x.y);
  }
#endif
}

// A 16 x COLS matrix one warp produced as an accumulator and uses next as the A operand of a product.
// For 16-bit E it stays in registers: the accumulator layout of two adjacent 16 x 8 tiles is the A
// fragment of one 16 x 16 block (FlashAttention-2's trick), so no shared-memory round trip is needed.
// For float (3xTF32, whose fragments do not line up) it goes through a warp-private shared tile of
// kSmemBytes at the address given to the constructor.
template <class E, int COLS>
struct WarpOperand {
  static constexpr int kSmemBytes = 0;
  std::uint32_t frag[COLS / 16][4];
  __device__ explicit WarpOperand(char*) {}

  // this = factor * acc, times columns[c] on column c when columns is given (shared memory).
  __device__ __forceinline__ void set(const float (&acc)[1][COLS / 8][4], float factor,
                                      const float* columns = nullptr) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int ni = 0; ni < COLS / 8; ++ni) {
      float2 s{factor, factor};
      if (columns != nullptr) {
        const float2 c = *reinterpret_cast<const float2*>(&columns[8 * ni + 2 * t]);
        s = {factor * c.x, factor * c.y};
      }
      frag[ni / 2][2 * (ni & 1)] = pack2<E>(s.x * acc[0][ni][0], s.y * acc[0][ni][1]);
      frag[ni / 2][2 * (ni & 1) + 1] = pack2<E>(s.x * acc[0][ni][2], s.y * acc[0][ni][3]);
    }
  }

  // The warp's 16 rows into a view at rows m0, columns 0..COLS (the values this operand holds, already rounded).
  template <class TileT, bool kT>
  __device__ __forceinline__ void store(const View<TileT, kT>& v, int m0) const {
#pragma unroll
    for (int kb = 0; kb < COLS / 16; ++kb) store_a16(frag[kb], v, m0, 16 * kb);
  }

  // this(r, c) *= factor * columns[c] (times more[c] where given; both in shared memory), rounded to E again:
  // frag[kb][2 h + i] holds row g + 8 i at columns 16 kb + 8 h + 2 t and the one after.
  __device__ __forceinline__ void scale_columns(const float* columns, float factor, const float* more = nullptr) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int kb = 0; kb < COLS / 16; ++kb) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float2 c = *reinterpret_cast<const float2*>(&columns[16 * kb + 8 * h + 2 * t]);
        if (more != nullptr) {
          const float2 m = *reinterpret_cast<const float2*>(&more[16 * kb + 8 * h + 2 * t]);
          c = {c.x * m.x, c.y * m.y};
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float2 x = unpack2<E>(frag[kb][2 * h + i]);
          frag[kb][2 * h + i] = pack2<E>(factor * c.x * x.x, factor * c.y * x.y);
        }
      }
    }
  }
};
template <int COLS>
struct WarpOperand<float, COLS> {
  using TileT = Tile<float, 16, COLS>;
  static constexpr int kSmemBytes = TileT::kBytes;
  TileT tile;
  __device__ explicit WarpOperand(char* smem) : tile{reinterpret_cast<float*>(smem)} {}

  __device__ __forceinline__ void set(const float (&acc)[1][COLS / 8][4], float factor,
                                      const float* columns = nullptr) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    __syncwarp();  // earlier products have read the tile
#pragma unroll
    for (int ni = 0; ni < COLS / 8; ++ni) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int c = 8 * ni + 2 * t + (r & 1);
        tile(g + (r >> 1) * 8, c) = factor * (columns != nullptr ? columns[c] : 1.f) * acc[0][ni][r];
      }
    }
    __syncwarp();
  }
};

// The view of B's rows k0, k0 + 1, ... as rows 0, 1, ...
template <class TileT, bool kT>
__device__ __forceinline__ View<TileT, kT> from_row(const View<TileT, kT>& b, int k0) {
  return {TileT{kT ? b.tile.ptr + k0 : b.tile.ptr + k0 * TileT::kLd}};
}

// acc (16 x 8 NT tiles at column n0) += A * B[k0..k0 + COLS, n0..), A held by the warp.
template <int NT, class E, int COLS, class VB>
__device__ __forceinline__ void warp_mma(float (&acc)[1][NT][4], const WarpOperand<E, COLS>& a, const VB& b_all, int n0,
                                         int k0 = 0) {
  const VB b = from_row(b_all, k0);
  if constexpr (std::is_same_v<E, float>) {
    warp_mma(acc, plain(a.tile), 0, b, n0, 0, COLS);
  } else {
    static_assert(NT % 2 == 0, "B fragments are loaded two n-tiles at a time");
    constexpr int kPairsPerBatch = NT / 2 < 4 ? NT / 2 : 4;  // bounds the live B fragments
#pragma unroll
    for (int kb = 0; kb < COLS / 16; ++kb) {
#pragma unroll
      for (int batch = 0; batch < NT / 2; batch += kPairsPerBatch) {
        std::uint32_t bf[kPairsPerBatch][4];
#pragma unroll
        for (int j = 0; j < kPairsPerBatch; ++j) load_b16(bf[j], b, 16 * kb, n0 + 16 * (batch + j));
#pragma unroll
        for (int j = 0; j < kPairsPerBatch; ++j) {
          mma_16816<E>(acc[0][2 * (batch + j)], a.frag[kb], bf[j][0], bf[j][1]);
          mma_16816<E>(acc[0][2 * (batch + j) + 1], a.frag[kb], bf[j][2], bf[j][3]);
        }
      }
    }
  }
}

// f(r, c, lo&, hi&, y) for every pair of adjacent elements (columns c and c + 1) of a warp's 16 x 8 NT
// accumulator at rows m0, columns n0 of a view, y holding the view's two values there (16-bit: read 16 columns
// an ldmatrix, whose A fragment has the accumulator layout, rather than an element a load), in for_each_pair's
// order.
template <int NT, class TileT, bool kT, class F>
__device__ __forceinline__ void for_each_pair_with(float (&acc)[1][NT][4], const View<TileT, kT>& v, int m0, int n0,
                                                   F&& f) {
  using E = typename TileT::Element;
  if constexpr (std::is_same_v<E, float>) {
    for_each_pair(acc, m0, n0,
                  [&](int r, int c, float& lo, float& hi) { f(r, c, lo, hi, float2{v.at(r, c), v.at(r, c + 1)}); });
  } else {
    static_assert(NT % 2 == 0, "16 columns an ldmatrix");
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kb = 0; kb < NT / 2; ++kb) {
      std::uint32_t a[4];
      load_a16(a, v, m0, n0 + 16 * kb);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int ni = 2 * kb + half, c = n0 + 8 * ni + 2 * t;
        f(m0 + g, c, acc[0][ni][0], acc[0][ni][1], unpack2<E>(a[2 * half]));
        f(m0 + g + 8, c, acc[0][ni][2], acc[0][ni][3], unpack2<E>(a[2 * half + 1]));
      }
    }
  }
}

// acc = rows m0..m0+15, columns 0..8 NT of a view, in the accumulator layout (for_each_pair_with's reads).
template <int NT, class TileT, bool kT>
__device__ __forceinline__ void load_accumulator(float (&acc)[1][NT][4], const View<TileT, kT>& v, int m0) {
  for_each_pair_with(acc, v, m0, 0, [](int, int, float& lo, float& hi, float2 y) {
    lo = y.x;
    hi = y.y;
  });
}

// v(r, c) = f(acc(r, c), r, c) rounded to the view's element type, for a warp's 16 x 8 NT accumulator at rows
// m0, columns n0 of the view (16-bit: 16 columns a store_a16).
template <int NT, class TileT, bool kT, class F>
__device__ __forceinline__ void store_accumulator(const float (&acc)[1][NT][4], const View<TileT, kT>& v, int m0,
                                                  int n0, F&& f) {
  using E = typename TileT::Element;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (std::is_same_v<E, float>) {
#pragma unroll
    for (int ni = 0; ni < NT; ++ni) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + g + 8 * (e >> 1), c = n0 + 8 * ni + 2 * t + (e & 1);
        (kT ? v.tile(c, r) : v.tile(r, c)) = f(acc[0][ni][e], r, c);
      }
    }
  } else {
    static_assert(NT % 2 == 0, "16 columns a store_a16");
#pragma unroll
    for (int kb = 0; kb < NT / 2; ++kb) {
      std::uint32_t a[4];  // the A fragment's order: rows g, g + 8 of columns 16 kb + 2 t, then of 16 kb + 8 + 2 t
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int ni = 2 * kb + (b >> 1), half = b & 1, r = m0 + g + 8 * half, c = n0 + 8 * ni + 2 * t;
        a[b] = pack2<E>(f(acc[0][ni][2 * half], r, c), f(acc[0][ni][2 * half + 1], r, c + 1));
      }
      store_a16(a, v, m0, n0 + 16 * kb);
    }
  }
}
template <int NT, class TileT, bool kT>
__device__ __forceinline__ void store_accumulator(const float (&acc)[1][NT][4], const View<TileT, kT>& v, int m0,
                                                  int n0) {
  store_accumulator(acc, v, m0, n0, [](float x, int, int) { return x; });
}

// acc(r, c) *= factor * columns[c] (columns in shared memory).
template <int MT, int NT>
__device__ __forceinline__ void scale_columns(float (&acc)[MT][NT][4], const float* columns, float factor) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int ni = 0; ni < NT; ++ni) {
    const float2 c = *reinterpret_cast<const float2*>(&columns[8 * ni + 2 * t]);
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
      acc[mi][ni][0] *= factor * c.x;
      acc[mi][ni][1] *= factor * c.y;
      acc[mi][ni][2] *= factor * c.x;
      acc[mi][ni][3] *= factor * c.y;
    }
  }
}

// Stores a warp's accumulators, rounded to E, to a row-major global matrix (leading dimension ld) with
// one store per pair of adjacent columns; rows at or past rows_valid and columns at or past columns_valid (counted
// from the tile's first row and column) are left alone.
template <class E, int MT, int NT>
__device__ __forceinline__ void store_pairs(float (&acc)[MT][NT][4], E* dst, std::int64_t ld,
                                            int rows_valid = 16 * MT, int columns_valid = 8 * NT) {
  for_each_pair(acc, 0, 0, [&](int r, int c, float& lo, float& hi) {
    if (r >= rows_valid || c >= columns_valid) return;
    E* at = dst + r * ld + c;
    if constexpr (std::is_same_v<E, float>) {
      *reinterpret_cast<float2*>(at) = float2{lo, hi};
    } else {
      *reinterpret_cast<std::uint32_t*>(at) = pack2<E>(lo, hi);
    }
  });
}

// acc = a row-major float32 global matrix at the warp tile's positions (one load per pair of adjacent
// columns), zero on rows at or past rows_valid.
template <int MT, int NT>
__device__ __forceinline__ void load_pairs(float (&acc)[MT][NT][4], const float* src, std::int64_t ld,
                                           int rows_valid) {
  for_each_pair(acc, 0, 0, [&](int r, int c, float& lo, float& hi) {
    const float2 v = r < rows_valid ? *reinterpret_cast<const float2*>(src + r * ld + c) : float2{0.f, 0.f};
    lo = v.x;
    hi = v.y;
  });
}

// ---- asynchronous copies ------------------------------------------------------------------------------

__device__ __forceinline__ void cp_async_16(std::uint32_t smem, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(global), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* global, bool valid) {
  cp_async_16(smem_address(smem), global, valid);
}
__device__ __forceinline__ void cp_async_4(void* smem, const void* global, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(smem)), "l"(global),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_8(void* smem, const void* global, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_address(smem)), "l"(global),
               "r"(valid ? 8 : 0));
}
// Named barriers (0 is __syncthreads'): `threads` of the block, a multiple of 32, meet at barrier `id` and wait until
// all have arrived. Orders this thread's earlier shared-memory accesses before the barrier completes.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same where the threads meet from different instructions (a warp-specialised kernel's roles, each at a barrier of
// its own code): bar.sync is barrier.sync.aligned, which promises one instruction for all of them.
__device__ __forceinline__ void named_barrier_sync_unaligned(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrives at barrier `id` without waiting (a producer's hand-over to the threads that wait there): this thread's
// earlier shared-memory accesses are performed for them once the barrier completes. Unaligned, as above.
__device__ __forceinline__ void named_barrier_arrive_unaligned(int id, int threads) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 16-byte groups between a tile's consecutive rows: its padded leading dimension's, or its row's (the swizzled tiles).
template <class TileT>
__host__ __device__ constexpr int row_groups() {
  constexpr int kElementBytes = static_cast<int>(sizeof(typename TileT::Element));
  if constexpr (requires { TileT::kLd; }) {
    return TileT::kLd * kElementBytes / 16;
  } else {
    return TileT::kCols * kElementBytes / 16;
  }
}

// Calls f(row, column) for the 16-byte vectors of a tile that thread `thread` of NTHREADS handles, in
// vector_walk.h's order, fully unrolled.
template <int NTHREADS, class TileT, class F>
__device__ __forceinline__ void for_each_vector(int thread, F&& f) {
  constexpr int kPerVec = 16 / static_cast<int>(sizeof(typename TileT::Element));
  using Walk = VectorWalk<NTHREADS, TileT::kRows, TileT::kCols / kPerVec, row_groups<TileT>()>;
#pragma unroll
  for (int j = 0; j < Walk::kSteps; ++j) {
    if (!Walk::active(thread, j)) break;
    const VectorAt at = Walk::at(thread, j);
    f(at.row, at.vector * kPerVec);
  }
}

// Which 16-byte vectors of a tile a copy reads (`keep(row, column)` of the vector's first element); the others it
// zero-fills in shared memory without reading. WholeRows reads them all.
struct WholeRows {
  __device__ __forceinline__ constexpr bool operator()(int, int) const { return true; }
};

// Starts copying rows [0, TileT::kRows) of a row-major global matrix (row stride `stride` elements,
// first row at `src`) into `tile`; rows at or past `rows_valid` are zero-filled, as are the vectors `keep` declines.
// Threads 0..NTHREADS-1 of the cooperating group call it, each with its index `thread`.
template <int NTHREADS, class TileT, class Keep = WholeRows>
__device__ __forceinline__ void load_rows_async(TileT tile, const typename TileT::Element* src, std::int64_t stride,
                                                int rows_valid, int thread, Keep keep = {}) {
  // A vector not read copies 0 bytes (zero fill) and reads nothing, so its address need not be valid.
  for_each_vector<NTHREADS, TileT>(thread, [&](int r, int c) {
    cp_async_16(&tile(r, c), src + r * stride + c, r < rows_valid && keep(r, c));
  });
}

// This thread's share of sum(a * b) over two tiles of one shape, read as 16-byte vectors; the shares of
// threads 0..NTHREADS-1 add up to the whole sum.
template <int NTHREADS, class TileT>
__device__ __forceinline__ float partial_tile_dot(TileT a, TileT b, int thread) {
  using E = typename TileT::Element;
  float sum = 0.f;
  for_each_vector<NTHREADS, TileT>(thread, [&](int r, int c) {
    const uint4 x = *reinterpret_cast<const uint4*>(&a(r, c)), y = *reinterpret_cast<const uint4*>(&b(r, c));
    const std::uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<E, float>) {
        sum += __uint_as_float(xs[i]) * __uint_as_float(ys[i]);
      } else {
        const float2 u = unpack2<E>(xs[i]), v = unpack2<E>(ys[i]);
        sum += u.x * v.x + u.y * v.y;
      }
    }
  });
  return sum;
}

// Copies rows [0, rows_valid) of `tile` to a row-major global matrix with 16-byte stores.
template <int NTHREADS, class TileT>
__device__ __forceinline__ void store_rows(TileT tile, typename TileT::Element* dst, std::int64_t stride,
                                           int rows_valid, int thread) {
  for_each_vector<NTHREADS, TileT>(thread, [&](int r, int c) {
    if (r < rows_valid) *reinterpret_cast<uint4*>(dst + r * stride + c) = *reinterpret_cast<const uint4*>(&tile(r, c));
  });
}

}  // namespace deltatrain::gdn::cuda
