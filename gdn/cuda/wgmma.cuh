// Hopper warpgroup products (wgmma, sm_90a only). A warpgroup of four warps computes acc += A * B for a
// 64 x 64 accumulator: warp w holds rows 16w..16w+15 in exactly the mma.sync "C" layout of eight 16 x 8
// tiles (acc[0][0..7] of mma.cuh), and gives A from registers in the mma.sync "A" layout, so WarpOperand's
// fragments and every accumulator helper of mma.cuh carry over. B is read from shared memory by the
// tensor cores through a descriptor; it must be stored in 128-byte-swizzled blocks (SwizzledTile), the
// layout TMA writes, here written by cp.async.
#pragma once

#include <cstdint>

#include "mma.cuh"
#include "smem_descriptor.h"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DELTATRAIN_WGMMA 1
#endif

namespace deltatrain::gdn::cuda {

// ROWS x COLS 16-bit elements as COLS / 64 blocks of ROWS rows x 128 bytes; in each block the 16-byte chunk
// c of row r sits at chunk position c ^ (r % 8), so that eight consecutive rows read at one column hit
// eight different bank groups. Blocks must start 1024-byte aligned (the swizzle's repeat).
template <class E, int ROWS, int COLS>
struct SwizzledTile {
  static_assert(sizeof(E) == 2 && COLS % 64 == 0 && ROWS % 8 == 0);
  using Element = E;
  static constexpr int kRows = ROWS;
  static constexpr int kCols = COLS;
  static constexpr int kBlockBytes = ROWS * 128;
  static constexpr int kBytes = COLS / 64 * kBlockBytes;
  std::uint32_t base;  // shared-window address

  // Byte offset of element (r, c); c % 8 == 0 gives the start of its 16-byte chunk.
  __device__ __forceinline__ static int offset(int r, int c) {
    return c / 64 * kBlockBytes + r * 128 + ((((c % 64) / 8) ^ (r % 8)) << 4) + (c % 8) * 2;
  }
};

// A swizzled tile that the mma.sync helpers of mma.cuh can also address element by element (View's ldmatrix
// fragments, stores, the generic load_rows_async): the swizzle keeps each 16-byte chunk of a row whole, so
// the addresses ldmatrix takes per row stay valid. Made by swizzled_tile from a 1024-byte aligned pointer.
template <class E, int ROWS, int COLS>
struct AddressableSwizzledTile : SwizzledTile<E, ROWS, COLS> {
  E* ptr;
  __device__ __forceinline__ E& operator()(int r, int c) const {
    return *reinterpret_cast<E*>(reinterpret_cast<char*>(ptr) + SwizzledTile<E, ROWS, COLS>::offset(r, c));
  }
};
template <class E, int ROWS, int COLS>
__device__ __forceinline__ AddressableSwizzledTile<E, ROWS, COLS> swizzled_tile(char* at) {
  return {{smem_address(at)}, reinterpret_cast<E*>(at)};
}

// load_rows_async (mma.cuh) for a swizzled tile: starts copying rows [0, ROWS) of a row-major global matrix
// (row stride `stride` elements); rows at or past rows_valid, and the vectors `keep` declines, are zero-filled.
// Threads 0..NTHREADS-1 call it. NTHREADS covers whole groups of 8 rows per step, so a thread's row modulo 8, and
// with it its chunk permutation, is the same in every step: the offsets are the first step's plus constants.
template <int NTHREADS, class E, int ROWS, int COLS, class Keep = WholeRows>
__device__ __forceinline__ void load_rows_async(SwizzledTile<E, ROWS, COLS> tile, const E* src, std::int64_t stride,
                                                int rows_valid, int thread, Keep keep = {}) {
  constexpr int kPerRow = COLS / 8, kRowsPerStep = NTHREADS / kPerRow;
  static_assert(NTHREADS % kPerRow == 0 && kRowsPerStep % 8 == 0 && ROWS % kRowsPerStep == 0);
  const int r = thread / kPerRow, c = thread % kPerRow * 8;
  const std::uint32_t to = tile.base + tile.offset(r, c);
  const E* from = src + r * stride + c;
#pragma unroll
  for (int step = 0; step < ROWS / kRowsPerStep; ++step) {
    const int row = r + step * kRowsPerStep;
    cp_async_16(to + step * kRowsPerStep * 128, from + step * kRowsPerStep * stride, row < rows_valid && keep(row, c));
  }
}
// The same for a tile that is also addressed element by element: its copies take the constant offsets above rather than
// the element-addressed overload's swizzle of every vector.
template <int NTHREADS, class E, int ROWS, int COLS, class Keep = WholeRows>
__device__ __forceinline__ void load_rows_async(AddressableSwizzledTile<E, ROWS, COLS> tile, const E* src,
                                                std::int64_t stride, int rows_valid, int thread, Keep keep = {}) {
  load_rows_async<NTHREADS>(static_cast<SwizzledTile<E, ROWS, COLS>>(tile), src, stride, rows_valid, thread, keep);
}

// B = tile^T, k = tile columns k0..k0+15, n = tile rows n0..n0+8 NT (a tile stored [n][k]: K-major; n0 a
// multiple of 8). Within a 128-byte row the k step moves the start by 32 bytes; the hardware applies the
// swizzle to the final addresses, so the start stays inside the row's first chunk pattern.
template <class E, int ROWS, int COLS>
__device__ __forceinline__ std::uint64_t k_major(SwizzledTile<E, ROWS, COLS> tile, int k0, int n0 = 0) {
  return smem_descriptor(tile.base, k0 / 64 * tile.kBlockBytes + n0 * 128 + (k0 % 64) * 2, 16, 8 * 128);
}
// B = tile, k = tile rows k0..k0+15, n = tile columns n0..n0+63 (stored [k][n]: MN-major, transposed).
template <class E, int ROWS, int COLS>
__device__ __forceinline__ std::uint64_t mn_major(SwizzledTile<E, ROWS, COLS> tile, int k0, int n0) {
  return smem_descriptor(tile.base, n0 / 64 * tile.kBlockBytes + k0 * 128, tile.kBlockBytes, 8 * 128);
}

// Makes this thread's earlier writes of shared memory (its stores and completed cp.async copies) visible to
// wgmma, which reads its operands through the async proxy; a barrier after it publishes them to the block.
__device__ __forceinline__ void fence_for_wgmma() {
#ifdef DELTATRAIN_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Orders the warpgroup's earlier register writes (accumulators, A fragments) before the next wgmma.
__device__ __forceinline__ void wgmma_fence() {
#ifdef DELTATRAIN_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
// Closes the group of the wgmma issued so far; wgmma_wait<N> waits until at most the N groups committed
// last are incomplete (groups complete in order). Work between the two (global stores of values no
// product reads or writes, or elementwise work on the accumulators of a group already waited for)
// overlaps the products.
__device__ __forceinline__ void wgmma_commit() {
#ifdef DELTATRAIN_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int kPending = 0>
__device__ __forceinline__ void wgmma_wait() {
#ifdef DELTATRAIN_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit_and_wait() {
  wgmma_commit();
  wgmma_wait();
}

// Makes each accumulator register a fresh value at this point of the program, so that the compiler neither
// reads it before the wait that completes the asynchronous product nor moves its writes past the fence.
template <int NT>
__device__ __forceinline__ void hold(float (&acc)[NT][4]) {
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+f"(acc[i][r])::"memory");
}

// Moves registers between warpgroups of a warp-specialised kernel (setmaxnreg, sm_90a): every warp of a warpgroup
// executes one of these together; kRegisters is a multiple of 8 in [24, 256], and a raise waits until lowers have given
// back what it takes. ptxas allocates the code after each for that count.
template <int kRegisters>
__device__ __forceinline__ void raise_registers() {
#ifdef DELTATRAIN_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}
template <int kRegisters>
__device__ __forceinline__ void lower_registers() {
#ifdef DELTATRAIN_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}

// acc (64 x 64, this warp's rows) += A (64 x 16, this warp's fragment) * B (16 x 64 by descriptor), or
// acc = A * B when `accumulate` is false. kTransposeB: B is stored MN-major.
// The first product into a fresh accumulator should not accumulate rather than follow a zero fill: the
// compiler sinks the fill's register moves past wgmma_fence, and ptxas then serialises the warpgroup's
// products around them (warning C7517, "warpgroup.wait is injected").
template <class E, bool kTransposeB>
__device__ __forceinline__ void wgmma_64x64x16(float (&acc)[8][4], const std::uint32_t (&a)[4], std::uint64_t b,
                                               bool accumulate = true) {
#ifdef DELTATRAIN_WGMMA
  float* d = &acc[0][0];
#define DELTATRAIN_WGMMA_ASM(TYPE)                                                                                    \
  asm volatile(                                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                                   \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE                                                     \
      " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28," \
      "%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"                                                     \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),  \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),       \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),      \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                    \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate ? 1 : 0), "n"(kTransposeB ? 1 : 0))
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    DELTATRAIN_WGMMA_ASM("bf16");
  } else {
    DELTATRAIN_WGMMA_ASM("f16");
  }
#undef DELTATRAIN_WGMMA_ASM
#endif
}

// acc (64 x 8 NT, this warp's 16 rows as NT 16 x 8 tiles) += A (64 x 16) * B (16 x 8 NT), or = when `accumulate`
// is false, both operands read from shared memory through descriptors (NT = 4 or 8; the A descriptors are those
// of B for a 64-row tile: k_major, or mn_major with kTransposeA). kTransposeA / kTransposeB: stored MN-major.
template <class E, bool kTransposeA, bool kTransposeB, int NT>
__device__ __forceinline__ void wgmma_ss(float (&acc)[NT][4], std::uint64_t a, std::uint64_t b,
                                         bool accumulate = true) {
  static_assert(NT == 4 || NT == 8, "m64n32k16 or m64n64k16");
#ifdef DELTATRAIN_WGMMA
  float* d = &acc[0][0];
  constexpr int kTypeBf16 = std::is_same_v<E, __nv_bfloat16> ? 1 : 0;
#define DELTATRAIN_WGMMA_SS16(TYPE)                                                                                   \
  asm volatile(                                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                                   \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE                                                     \
      " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, %19, %20;\n}\n"                    \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),  \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])                     \
      : "l"(a), "l"(b), "r"(accumulate ? 1 : 0), "n"(kTransposeA ? 1 : 0), "n"(kTransposeB ? 1 : 0))
#define DELTATRAIN_WGMMA_SS32(TYPE)                                                                                   \
  asm volatile(                                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                                   \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE                                                     \
      " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28," \
      "%29,%30,%31}, %32, %33, p, 1, 1, %35, %36;\n}\n"                                                              \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),  \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),       \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),      \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                    \
      : "l"(a), "l"(b), "r"(accumulate ? 1 : 0), "n"(kTransposeA ? 1 : 0), "n"(kTransposeB ? 1 : 0))
  if constexpr (NT == 4 && kTypeBf16) {
    DELTATRAIN_WGMMA_SS16("bf16");
  } else if constexpr (NT == 4) {
    DELTATRAIN_WGMMA_SS16("f16");
  } else if constexpr (kTypeBf16) {
    DELTATRAIN_WGMMA_SS32("bf16");
  } else {
    DELTATRAIN_WGMMA_SS32("f16");
  }
#undef DELTATRAIN_WGMMA_SS16
#undef DELTATRAIN_WGMMA_SS32
#endif
}

// acc (+)= A * B over kSteps steps of 16 along k, both operands from shared memory: a(k0) and b(k0) give the
// descriptors of the step at k0; the first step overwrites acc unless `accumulate`.
template <class E, bool kTransposeA, bool kTransposeB, int kSteps, int NT, class DescriptorA, class DescriptorB>
__device__ __forceinline__ void wgmma_ss_product(float (&acc)[NT][4], DescriptorA&& a, DescriptorB&& b,
                                                 bool accumulate) {
#pragma unroll
  for (int step = 0; step < kSteps; ++step) {
    wgmma_ss<E, kTransposeA, kTransposeB>(acc, a(16 * step), b(16 * step), accumulate || step > 0);
  }
}

// ---- thread block clusters (sm_90) ----
// The cluster barrier: every thread of every CTA in the cluster arrives, then waits, in turn (a thread arrives
// again only after its wait). .aligned: all threads of a warp execute each together.
// Without memory ordering: for what an mbarrier or a later barrier already orders, or to say that reads whose values
// this thread has already used are done.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#ifdef DELTATRAIN_WGMMA
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}
// With release: this thread's earlier memory accesses are complete for the cluster's threads past their wait (which
// acquires). It compiles to a GPU-scope membar and waits for all of them, global stores and loads included, so
// issue those after it where they need no ordering.
__device__ __forceinline__ void cluster_arrive() {
#ifdef DELTATRAIN_WGMMA
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#ifdef DELTATRAIN_WGMMA
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// This CTA's rank in its cluster.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned rank = 0;
#ifdef DELTATRAIN_WGMMA
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
#endif
  return rank;
}
// `local`'s offset in the shared memory of the cluster's CTA `rank`, as a shared::cluster address.
__device__ __forceinline__ std::uint32_t cluster_shared_address(const void* local, unsigned rank) {
  std::uint32_t remote = 0;
#ifdef DELTATRAIN_WGMMA
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_address(local)), "r"(rank));
#endif
  return remote;
}
// The 16 bytes at `local`'s offset in the shared memory of the cluster's CTA `rank` (distributed shared memory).
__device__ __forceinline__ float4 load_from_cluster_rank(const void* local, unsigned rank) {
  float4 v{};
#ifdef DELTATRAIN_WGMMA
  const std::uint32_t remote = cluster_shared_address(local, rank);
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
#endif
  return v;
}

// ---- mbarriers across a cluster: one-way hand-overs between CTAs ----
// Sets up the mbarrier at `local` to complete a phase on `arrivals` arrivals, visible to the cluster once a cluster
// barrier (with release) has passed.
__device__ __forceinline__ void cluster_mbarrier_init(std::uint64_t* local, unsigned arrivals) {
#ifdef DELTATRAIN_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(local)), "r"(arrivals) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// Arrives, with release at cluster scope, at the mbarrier at `local`'s offset in CTA `rank`: this thread's earlier
// memory accesses are performed for the threads past that phase's wait.
__device__ __forceinline__ void cluster_mbarrier_arrive(const std::uint64_t* local, unsigned rank) {
#ifdef DELTATRAIN_WGMMA
  const std::uint32_t remote = cluster_shared_address(local, rank);
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
#endif
}
// Waits, with acquire at cluster scope, until the phase of this CTA's mbarrier whose parity is `parity` (its
// phase count's lowest bit) has completed.
__device__ __forceinline__ void cluster_mbarrier_wait(std::uint64_t* local, unsigned parity) {
#ifdef DELTATRAIN_WGMMA
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n"
      "}\n" ::"r"(smem_address(local)),
      "r"(parity)
      : "memory");
#endif
}

}  // namespace deltatrain::gdn::cuda
