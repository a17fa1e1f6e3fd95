// The fused backward split by role (sm_90a; plan.h's role_split): the same math as fused_backward.cu, from the same
// inputs (prepare's P and T, the recompute pass's S and Delta), per (sequence, segment, value head), but its three
// warpgroups take the chunk's work by role, FlashQLA's way, instead of each running the whole chain over its rows of
// V. bench/prototypes/role_split_backward.py is the math, checked in float64 against the recurrence's reverse; a role
// reads another's values only from shared memory, after a hand-over.
//
//   state (warpgroup 0)            | chain (warpgroup 1)                  | square (warpgroup 2)
//   waits for the chunk's copies;  |                                      | dP = dO Delta^T, M, G; K S and
//   dS' to its tile, sum(S dS'),   | dDelta^T = dO^T P + (dS'^T K^T) diag(D)| corr = V - diag(E) K S (in V's tile);
//   dS = E_n dS' -> chain;         |   -> square;                         | K K^T, dT = dDelta corr^T diag(beta),
//   the last chunk's dgamma, dbeta;| tdd^T = dDelta^T T, dcorr = beta tdd;| X = T^T dT; E dcorr . K S; -dA, the
//   dS += scale Q^T diag(E) dO;    |   -E dcorr, dV to tiles -> state,    |   inverse's backward, F -> chain;
//   dS -= K^T diag(E) dcorr;       |   square;                            | dQ = scale diag(E) dO S^T + M K; dq
//   the next chunk's copies once   | dK = diag(D) Delta dS'^T + M^T Q     |
//   their readers are done         |   - diag(E) dcorr S^T, dV out;       |
//                                  | dK += F K + F^T K; dk                |
//
// Each hand-over is a named barrier that the value's producer arrives at and only its readers wait on (Barrier
// below): bench/prototypes/role_split_sync.py's second form is these programs, checked against a model of their
// order (every read sees its own chunk's value, no barrier is over-arrived or needless) and timed with the busy times
// the first form's profile measured (bench/NOTES.md, "The role split's second form"). The first form met at five
// barriers of all three roles a chunk, so that each stage lasted as long as its slowest role.
//
// dS' (128 x 128 float32) lives in the state warpgroup's registers alone (two 64-row halves of S^T's layout, 128 a
// thread). Tiles are single-buffered: the next chunk's inputs are copied by the state warpgroup once every reader of
// this chunk's has said so, P's and V's early (their readers are done mid-chunk), the rest at the chunk's end. dq and
// dk are finished as in fused_backward.cu (InputGrads): the CTA's own for a GVA group of one, a cluster pair's for a
// group of two (rank 0 sums dQ, rank 1 dK, each with the partner's partial, handed over through the sender's -E dcorr
// and dV tiles and an mbarrier of the receiver), else per value head in float32 for input_grad_kernel; the L2 norm's
// backward reads the normalised rows from global memory, since the next chunk's copies may already fill the tiles.
// dV, dg, dbeta and dh0 are final here. Every sum runs in a fixed order: bitwise deterministic, as fused_backward.cu.
#include <type_traits>

#include "dispatch.cuh"
#include "launch.h"
#include "state_hopper.cuh"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kRoles = 3;  // state, chain, square
constexpr int kThreads = kRoles * kWarpgroup;
constexpr int kKeys = 128, kValues = 128;  // K and V (plan.h's fused backward)
// Registers a thread after setmaxnreg. The launch gives each 168 (65536 / 384 in steps of 8); raises wait for the
// lower to give back what they take, so the three must fit 3 x 168. ptxas serialises every wgmma of the kernel (C7512)
// where one role's cap is short of what its products hold in flight: the state role holds dS' (128) and dO^T's scaled
// fragments (32), and serialised at 184; the chain, at most dDelta^T and K dS' of one half (64) and dDelta^T's
// fragments (32), at 128; the square role K S (64) beside K K^T and X (64), and would beside dQ (64), which therefore
// comes after E dcorr . K S. At these caps each kernel spills 184-212 bytes, spread over the roles' copy addresses and
// the finishing of dq and dk.
constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
constexpr int kStateRegisters = 192;
constexpr int kSquareRegisters = 160;
constexpr int kChainRegisters = 152;
static_assert(kStateRegisters + kSquareRegisters + kChainRegisters <= kRoles * kLaunchRegisters);
// A role's registers from the launch's count: setmaxnreg's raise where it takes more, its lower where it gives some
// back (a raise to fewer than a warp holds is not one).
template <int kRegisters>
__device__ __forceinline__ void take_registers() {
  if constexpr (kRegisters > kLaunchRegisters) {
    raise_registers<kRegisters>();
  } else if constexpr (kRegisters < kLaunchRegisters) {
    lower_registers<kRegisters>();
  }
}

// Named barriers (0, __syncthreads', is not used): each role's own, where its warps read what its other warps wrote,
// and one a hand-over, arrived at by the value's producer and waited on (bar.sync) by its readers. Threads: 128 a role.
enum Barrier : int {
  kStateOnly = 1,
  kChainOnly,
  kSquareOnly,
  kInputs,           // state -> square: the chunk's copies have landed (the chain learns it from kStateStaged)
  kStateStaged,      // state -> chain: dS' in its tile
  kSumsRead,         // state -> chain, square: the last chunk's partial sums are summed (and the chain learns from
                     // the square role's arrival that corr and M are formed)
  kDdeltaReady,      // chain -> square: dDelta in its tile
  kEdcorrToState,    // chain -> state: -E dcorr in its tile
  kEdcorrToSquare,   // chain -> square: the same (a barrier of its own, so that neither reader waits for the other)
  kFReady,           // square -> chain: F in its tile
  kPvFree,           // chain, square -> state: P and V (corr) read
  kChunkDone,        // chain, square -> state: every input tile read
  kExchangeFree,     // state and the role that does not send -> a cluster pair's sender (rank 0's chain, rank 1's
                     // square role): the -E dcorr and dV tiles read
};
// The threads that meet at a barrier: a role's own 128, two roles' 256, or all three's.
__host__ __device__ constexpr int meeting_threads(Barrier id) {
  switch (id) {
    case kStateOnly:
    case kChainOnly:
    case kSquareOnly:
      return kWarpgroup;
    case kSumsRead:
    case kPvFree:
    case kChunkDone:
    case kExchangeFree:
      return kThreads;
    default:
      return 2 * kWarpgroup;
  }
}
static_assert(kExchangeFree < 16, "16 named barriers a CTA");

// A producer's hand-over: its shared stores (and landed copies) visible to wgmma too, then its arrival.
template <Barrier kId>
__device__ __forceinline__ void hand_over() {
  fence_for_wgmma();
  named_barrier_arrive_unaligned(kId, meeting_threads(kId));
}
// A reader's wait for a hand-over (it arrives and waits); a role's own barrier likewise, where the fence makes the
// role's own stores visible to the wgmma of its other warps.
template <Barrier kId>
__device__ __forceinline__ void wait_for() {
  fence_for_wgmma();
  named_barrier_sync_unaligned(kId, meeting_threads(kId));
}

template <class E>
struct RoleSplitSmem {
  // a chunk's rows: K, Q, V, dO, Delta, dDelta, -E dcorr, dV
  using Rows = AddressableSwizzledTile<E, kChunk, 128>;
  using State = AddressableSwizzledTile<E, kValues, kKeys>;   // S^T, dS'^T
  using Square = AddressableSwizzledTile<E, kChunk, kChunk>;  // P, T, M, dT^T, X, F
  static constexpr int k = 0;  // each tile starts 1024-byte aligned
  static constexpr int q = k + Rows::kBytes;
  static constexpr int v_then_corr = q + Rows::kBytes;  // corr = V - diag(E) K S, written over V by the square role
  static constexpr int d_o = v_then_corr + Rows::kBytes;
  static constexpr int delta = d_o + Rows::kBytes;
  static constexpr int p = delta + Rows::kBytes;
  static constexpr int t = p + Square::kBytes;
  static constexpr int s = t + Square::kBytes;
  static constexpr int ds = s + State::kBytes;
  // dDelta (from the chain to the square role's dT), then dT^T and X side by side, then F in dT^T's place (to the
  // chain's F K + F^T K)
  static constexpr int ddelta = ds + State::kBytes;
  static constexpr int dt_then_f = ddelta;
  static constexpr int x = ddelta + Square::kBytes;
  static constexpr int m = ddelta + Rows::kBytes;
  static constexpr int edcorr = m + Square::kBytes;  // -diag(E) dcorr, token-major
  static constexpr int dv = edcorr + Rows::kBytes;    // dV, token-major, for 16-byte row stores
  // A cluster pair's float32 partial for the partner (rank 1's dQ, rank 0's dK), over the -E dcorr and dV tiles once
  // their readers are done (kExchangeFree), until the chain writes them again for the next chunk (PairExchange).
  static constexpr int partner_partial = edcorr;
  static_assert(dv == edcorr + Rows::kBytes && 2 * Rows::kBytes == kChunk * kKeys * 4, "64 x 128 float32 in the two");
  // The gates of the chunk: single-buffered, copied with the rest once every reader is done (kChunkDone).
  static constexpr int gamma = dv + Rows::kBytes;  // hi + lo (chunk.cuh)
  static_assert(gamma % 16 == 0, "for_each_decay reads two columns' gamma as one float4");
  static constexpr int gate_in = gamma + kChunk * 8;    // E
  static constexpr int gate_out = gate_in + kChunk * 4;  // D
  static constexpr int beta = gate_out + kChunk * 4;
  // Per-token partial sums, each written by one role and summed by the state role while the next chunk begins.
  static constexpr int state_dots = beta + kChunk * 4;        // [warp]: E_n sum(S * dS') over the warp's rows
  static constexpr int delta_parts = state_dots + 4 * 4;      // [half][warp][64]: D rowsum(Delta * K dS')
  static constexpr int beta_parts = delta_parts + 8 * kChunk * 4;  // [half][warp][64]: rowsum(corr * tdd)
  static constexpr int g_parts = beta_parts + 8 * kChunk * 4;      // store_row_column_sums of G (NT = 8: 5 x 64)
  static constexpr int e_parts = g_parts + 5 * kChunk * 4;         // the same of beta E
  static constexpr int e_sums = e_parts + 5 * kChunk * 4;          // rowsum(E)
  static constexpr int q_dots = e_sums + kChunk * 4;               // rowdot(scale E dO S^T, Q)
  static constexpr int corr_dots = q_dots + kChunk * 4;            // rowdot(-E dcorr, K S)
  static constexpr int dgamma = corr_dots + kChunk * 4;
  static constexpr int scratch = dgamma + kChunk * 4;  // the state role's two warp sums of the D terms
  // A cluster pair's mbarriers (PairExchange): the partner's partial received here, this CTA's partial released.
  static constexpr int mbarriers = scratch + 2 * 4 + 8;  // 8-byte aligned: scratch is 16-byte aligned
  // Dynamic shared memory is not promised 1024-byte alignment: the kernel rounds its start up.
  static constexpr int bytes = mbarriers + 2 * 8 + 1024;
  static_assert(mbarriers % 8 == 0);
  static_assert(bytes <= kSmemLimit);
};

// x made opaque at this point of the program, so that what is computed from it (the copies' addresses from the
// thread's index and the strides, the tiles' descriptors and element addresses from their shared address) is formed
// where it is used, not hoisted out of the chunk loop into registers (the state role's hold dS').
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}
__device__ __forceinline__ char* opaque(char* x) {
  asm volatile("" : "+l"(x));
  return x;
}

// Columns 64 nb.. of a warp's 16 x 128 accumulator, as the 16 x 64 one a wgmma of N = 64 takes.
__device__ __forceinline__ float (&columns_of(float (&acc)[1][16][4], int nb))[8][4] {
  return *reinterpret_cast<float(*)[8][4]>(&acc[0][8 * nb]);
}

// acc (64 x 128, a warp's 16 rows) (+)= A * B over kSteps steps of 16 along k, B the 128 columns of an MN-major tile
// (two wgmma of N = 64 a step): a(k0) gives A's descriptor, tile() the tile, formed at each use.
template <class E, bool kTransposeA, int kSteps, class DescriptorA, class TileOf>
__device__ __forceinline__ void product_over_128_columns(float (&acc)[1][16][4], DescriptorA&& a, TileOf&& tile,
                                                         bool accumulate) {
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
    wgmma_ss_product<E, kTransposeA, true, kSteps>(
        columns_of(acc, nb), a, [&](int k0) { return mn_major(tile(), k0, 64 * nb); }, accumulate);
  }
}

// acc = A B^T (a warp's 16 rows of 64 x 8 NT), A's rows from a_row0 and B's from b_row0 of K-major tiles that a() and
// b() form at each use, over the tiles' kCols / 16 steps of 16 along k.
template <class E, int NT, class TileA, class TileB>
__device__ __forceinline__ void rows_product(float (&acc)[NT][4], TileA&& a, TileB&& b, int a_row0 = 0,
                                             int b_row0 = 0) {
  constexpr int kSteps = std::remove_reference_t<decltype(a())>::kCols / 16;
  wgmma_ss_product<E, false, false, kSteps>(
      acc, [&](int k0) { return k_major(a(), k0, a_row0); }, [&](int k0) { return k_major(b(), k0, b_row0); }, false);
}

// The cluster pair's hand-over of partial sums (InputGrads::cluster_pair; nothing otherwise), by mbarriers rather than
// cluster barriers, so that it couples only the roles it concerns: the sender (rank 0's chain with dK's partial, rank
// 1's square role with dQ's) stores its partial over its -E dcorr and dV tiles once their readers are done
// (kExchangeFree) and arrives at the partner's `received`; the receiver (rank 1's chain, rank 0's square role) waits
// there, adds the partial through distributed shared memory and arrives at the sender's `released`, which the
// sender's chain waits for before it writes -E dcorr into those tiles again, and before the CTA exits. Each mbarrier
// completes one phase a chunk, on a warpgroup's 128 arrivals.
template <InputGrads kInputGrads>
struct PairExchange {
  static constexpr bool kActive = kInputGrads == InputGrads::cluster_pair;
  enum : int { kReceived = 0, kReleased = 1 };
  // Before the walk, every thread: the mbarriers set up (by thread 0) and visible to the partner.
  __device__ static void begin(std::uint64_t* barriers) {
    if constexpr (kActive) {
      if (threadIdx.x == 0) {
        cluster_mbarrier_init(&barriers[kReceived], kWarpgroup);
        cluster_mbarrier_init(&barriers[kReleased], kWarpgroup);
      }
      cluster_arrive();
      cluster_wait();
    }
  }
  // The chain, before it writes -E dcorr into the tiles of the walk's chunk `walked` (counted from 0), and with
  // walked = the chunk count after the walk: the partner has read the partial they carried a chunk before.
  __device__ static void before_overwrite(std::uint64_t* barriers, int walked) {
    if constexpr (kActive) {
      if (walked > 0) cluster_mbarrier_wait(&barriers[kReleased], (walked - 1) & 1);
    }
  }
  // The sender: this thread's values of its 64 x 128 partial over the exchange tiles, announced to the partner.
  __device__ static void send(const float (&acc)[1][16][4], float4* partial, std::uint64_t* barriers, int tid) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      partial[i * kWarpgroup + tid] = float4{acc[0][i][0], acc[0][i][1], acc[0][i][2], acc[0][i][3]};
    }
    cluster_mbarrier_arrive(&barriers[kReceived], cluster_rank() ^ 1);
  }
  // The receiver, at the walk's chunk `walked`: the partner's partial added to acc (two terms commute exactly: the sum
  // does not depend on the rank that forms it), then released.
  __device__ static void receive(float (&acc)[1][16][4], const float4* partial, std::uint64_t* barriers, int tid,
                                 int walked) {
    cluster_mbarrier_wait(&barriers[kReceived], walked & 1);
    const unsigned partner = cluster_rank() ^ 1;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float4 x = load_from_cluster_rank(&partial[i * kWarpgroup + tid], partner);
      acc[0][i][0] += x.x;
      acc[0][i][1] += x.y;
      acc[0][i][2] += x.z;
      acc[0][i][3] += x.w;
    }
    cluster_mbarrier_arrive(&barriers[kReleased], partner);
  }
};

// A warp's 16 rows (all 128 keys) of a chunk's dq or dk from row m0, summed over the GVA group where it is: through the
// L2 norm's backward dx = rstd (dx_hat - x_hat (x_hat . dx_hat)) where there is one (x_hat: the normalised rows the
// products used, [tokens, H, K], read from global memory: the chunk's Q or K tile may already hold the next chunk's;
// rstd: [tokens, H]), cast and stored as rows of out [tokens, H, K]. A warp holds whole rows, so the dots need no
// other warp's; they add in row_dots' order.
template <class E>
__device__ __forceinline__ void finish_input_grad(const Params& p, float (&grad)[1][16][4], const E* normalised,
                                                  const float* rstd, void* out, std::int64_t t0, int rows, int m0,
                                                  int h) {
  const std::int64_t stride = static_cast<std::int64_t>(p.H) * kKeys;
  if (p.l2norm) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // x_hat at this thread's row m0 + g + 8 half, columns c and c + 1 (zero past the chunk)
    auto x_hat = [&](int half, int c) {
      const int r = m0 + g + 8 * half;
      if (r >= rows) return float2{0.f, 0.f};
      return unpack2<E>(*reinterpret_cast<const std::uint32_t*>(normalised + (t0 + r) * stride + h * kKeys + c));
    };
    float dots[2] = {0.f, 0.f}, scale[2];
#pragma unroll
    for (int ni = 0; ni < 16; ++ni) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float2 x = x_hat(half, 8 * ni + 2 * t);
        dots[half] += grad[0][ni][2 * half] * x.x + grad[0][ni][2 * half + 1] * x.y;
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      dots[half] = quad_sum(dots[half]);
      const int r = m0 + g + 8 * half;
      scale[half] = r < rows ? rstd[(t0 + r) * p.H + h] : 0.f;
    }
#pragma unroll
    for (int ni = 0; ni < 16; ++ni) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float2 x = x_hat(half, 8 * ni + 2 * t);
        float &lo = grad[0][ni][2 * half], &hi = grad[0][ni][2 * half + 1];
        lo = scale[half] * (lo - x.x * dots[half]);
        hi = scale[half] * (hi - x.y * dots[half]);
      }
    }
  }
  store_pairs(grad, static_cast<E*>(out) + (t0 + m0) * stride + h * kKeys, stride, rows - m0);
}

// What the roles share: the CTA's place in the grid and its tiles, each formed at its use (opaque).
template <class E>
struct Cta {
  using L = RoleSplitSmem<E>;
  using Rows = typename L::Rows;
  using Square = typename L::Square;
  using State = typename L::State;
  const Params& p;
  char* smem;
  int runs, run, n, hv, h;
  int tid, warp, m0;  // within the role's warpgroup; m0: the warp's first row of a 64-row block
  SequenceChunks chunks;

  __device__ Cta(char* smem_raw, const Params& params)
      : p(params), runs(params.segments), run(blockIdx.x % params.segments), n(blockIdx.x / params.segments),
        hv(blockIdx.y), h(blockIdx.y / params.group), tid(threadIdx.x % kWarpgroup), warp(tid / 32), m0(16 * warp),
        chunks(SequenceChunks(params, n).segment(runs - 1 - run, runs)) {
    const int raw = static_cast<int>(smem_address(smem_raw));
    smem = smem_raw + (round_up(raw, 1024) - raw);
  }
  template <int ROWS, int COLS>
  __device__ AddressableSwizzledTile<E, ROWS, COLS> tile(int at) const {
    return swizzled_tile<E, ROWS, COLS>(opaque(smem + at));
  }
  __device__ Rows rows(int at) const { return tile<kChunk, 128>(at); }
  __device__ Square square(int at) const { return tile<kChunk, kChunk>(at); }
  __device__ State state(int at) const { return tile<kValues, kKeys>(at); }
  template <class T>
  __device__ T* vector(int at) const {
    return smem_at<T>(smem, at);
  }
  __device__ const float2* gamma() const { return vector<float2>(L::gamma); }
  __device__ const float* gate_in() const { return vector<float>(L::gate_in); }
  __device__ const float* gate_out() const { return vector<float>(L::gate_out); }
  __device__ const float* beta() const { return vector<float>(L::beta); }
  __device__ std::uint64_t* mbarriers() const { return vector<std::uint64_t>(L::mbarriers); }
  __device__ float* sums(int at) const { return vector<float>(at); }  // a per-token vector of partial sums

  // dq or dk of the chunk (the walk's chunk `walked`, counted from 0), a warp's 16 rows from m0, formed from
  // `normalised`'s rows: per value head in float32 into per_value_head ([tokens, HV, K]); or finished here into out (a
  // group of one); or by the cluster pair's rank `summing`, with the other rank's partial, which the other hands over
  // here once its own readers of the exchange tiles are done.
  template <InputGrads kInputGrads>
  __device__ void finish_input_rows(float (&grad)[1][kKeys / 8][4], const ChunkInfo& chunk, int m0, const E* normalised,
                                    float* per_value_head, const float* rstd, void* out, unsigned summing,
                                    int walked) const {
    const std::int64_t t0 = chunk.start;
    if constexpr (kInputGrads == InputGrads::per_value_head) {
      store_pairs(grad, per_value_head + ((t0 + m0) * p.HV + hv) * kKeys,
                  static_cast<std::int64_t>(opaque(p.HV)) * kKeys, chunk.length - m0);
    } else if constexpr (kInputGrads == InputGrads::this_cta) {
      finish_input_grad<E>(p, grad, normalised, rstd, out, t0, chunk.length, m0, h);
    } else {
      using Exchange = PairExchange<kInputGrads>;
      float4* partial = vector<float4>(L::partner_partial);
      if (cluster_rank() != summing) {
        wait_for<kExchangeFree>();
        Exchange::send(grad, partial, mbarriers(), tid);
      } else {
        Exchange::receive(grad, partial, mbarriers(), tid, walked);
        finish_input_grad<E>(p, grad, normalised, rstd, out, t0, chunk.length, m0, h);
      }
    }
  }
};

// Warpgroup 0: holds dS'^T (rows 16 w.. of each 64-row half for warp w) through the walk, issues every copy, and sums
// each chunk's dgamma and dbeta from the roles' partial sums while the next chunk begins.
template <class E, InputGrads kInputGrads>
struct StateRole : Cta<E> {
  using L = RoleSplitSmem<E>;
  using Cta<E>::p, Cta<E>::tid, Cta<E>::warp, Cta<E>::m0, Cta<E>::chunks, Cta<E>::hv, Cta<E>::h, Cta<E>::sums;
  __device__ StateRole(char* smem_raw, const Params& params) : Cta<E>(smem_raw, params) {}

  // Starts copying chunk j's rows of a token-major tensor [tokens, heads, COLS] (head `head`) into the tile at `at`.
  template <int COLS>
  __device__ void copy_rows(int at, const void* base, int heads, int head, int j) const {
    load_chunk_rows<kWarpgroup>(this->template tile<kChunk, COLS>(at), base, opaque(heads), head, COLS, 0,
                                chunks[j], opaque(tid));
  }
  // Starts copying chunk j's lower blocks of a [tokens, HV, C] lower-triangular matrix (P, T) into the square tile at
  // `at`, zeros above them (chunk.cuh's load_lower_chunk_tile).
  __device__ void copy_lower(int at, const void* base, int j) const {
    load_lower_chunk_tile<kWarpgroup>(this->square(at), base, opaque(p.HV), hv, chunks[j], opaque(tid));
  }
  // The copy groups: P and V once their readers are done (kPvFree), the rest once every reader is (kChunkDone).
  __device__ void issue_p_and_values(int j) const {
    copy_lower(L::p, p.p, j);
    copy_rows<kValues>(L::v_then_corr, p.v, p.HV, hv, j);
    cp_async_commit();
  }
  __device__ void issue_rest(int j) const {
    copy_rows<kKeys>(L::k, keys<E>(p), p.H, h, j);
    copy_rows<kKeys>(L::q, queries<E>(p), p.H, h, j);
    copy_rows<kValues>(L::d_o, p.d_o, p.HV, hv, j);
    copy_lower(L::t, p.t, j);
    copy_rows<kValues>(L::delta, p.delta, p.HV, hv, j);
    const std::int64_t state_row = (static_cast<std::int64_t>(chunks.first + j) * p.HV + hv) * kValues;
    load_rows_async<kWarpgroup>(this->state(L::s), static_cast<const E*>(p.states) + state_row * kKeys, kKeys, kValues,
                                opaque(tid));
    const ChunkInfo chunk = chunks[j];
    load_gamma_async(p, this->template vector<float2>(L::gamma), hv, chunk, opaque(tid));
    load_gates_async(p, this->template vector<float>(L::gate_in), this->template vector<float>(L::gate_out), hv,
                     chunk, opaque(tid));
    cp_async_commit();
    if (tid < kChunk) {  // beta's dtype varies: a plain load, visible to the others at kInputs and kStateStaged
      this->template vector<float>(L::beta)[tid] =
          tid < chunk.length ? load_gate<E>(p.beta, (chunk.start + tid) * p.HV + hv, p.beta_float) : 0.f;
    }
  }

  __device__ void walk() const {
    float ds[2][kKeys / 8][4];  // dS'^T, then dS^T: half b holds rows 64 b + m0..
    // The final state's gradient, or the gradient at the next segment's start that steps 1 and 2 left.
    const float* start = this->run == 0 ? nullptr : segment_start_rows<true>(p, this->n, this->run, hv);
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const StateRows at{64 * b + m0, 0};
      if (start == nullptr) {
        load_state(row_block(ds, b), p.dht, p, this->n, hv, at);
      } else {
        load_pairs(row_block(ds, b), start + at.v0 * kKeys, kKeys, 16);
      }
    }
    const int count = chunks.count;
    if (count > 0) {
      issue_p_and_values(count - 1);
      issue_rest(count - 1);
    }
#pragma unroll 1
    for (int j = count - 1; j >= 0; --j) {
      const int m0 = opaque(this->m0);
      cp_async_wait<0>();
      wait_for<kStateOnly>();  // every thread's copies have landed
      hand_over<kInputs>();
      float dot = 0.f;  // sum(S * dS') over this thread's elements, in float32 from the registers
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        store_accumulator(row_block(ds, b), plain(this->state(L::ds)), 64 * b + m0, 0);
        for_each_pair_with(row_block(ds, b), plain(this->state(L::s)), 64 * b + m0, 0,
                           [&](int, int, float& lo, float& hi, float2 s) { dot += lo * s.x + hi * s.y; });
      }
      const float decay = this->gate_in()[kChunk - 1];  // E_n
      for_each(ds, 0, 0, [&](int, int, float& x) { x *= decay; });
      hand_over<kStateStaged>();
      if (j < count - 1) per_token_sums(chunks[j + 1]);  // the last chunk's, while the chain forms dDelta
      dot = warp_sum(dot);
      if ((tid & 31) == 0) sums(L::state_dots)[warp] = decay * dot;
      hand_over<kSumsRead>();
      {  // dS^T += scale dO^T diag(E) Q, dO^T's fragments scaled by column
        WarpOperand<E, kChunk> d_o[2] = {WarpOperand<E, kChunk>(nullptr), WarpOperand<E, kChunk>(nullptr)};
#pragma unroll
        for (int b = 0; b < 2; ++b) {
#pragma unroll
          for (int kb = 0; kb < kChunk / 16; ++kb) {
            load_a16(d_o[b].frag[kb], transposed(this->rows(L::d_o)), 64 * b + m0, 16 * kb);
          }
          d_o[b].scale_columns(this->gate_in(), p.scale);
        }
        wgmma_fence();
#pragma unroll
        for (int b = 0; b < 2; ++b) {
#pragma unroll
          for (int kb = 0; kb < kChunk / 16; ++kb) {
#pragma unroll
            for (int nb = 0; nb < kKeys / 64; ++nb) {
              wgmma_64x64x16<E, true>(columns_of(row_block(ds, b), nb), d_o[b].frag[kb],
                                      mn_major(this->rows(L::q), 16 * kb, 64 * nb));
            }
          }
        }
        wgmma_commit_and_wait();
        hold(ds[0]);
        hold(ds[1]);
      }
      wait_for<kEdcorrToState>();  // dS^T += (-E dcorr)^T K: the next chunk's dS'^T
      wgmma_fence();
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        product_over_128_columns<E, true, kChunk / 16>(
            row_block(ds, b), [&](int k0) { return mn_major(this->rows(L::edcorr), k0, 64 * b); },
            [&] { return this->rows(L::k); }, true);
      }
      wgmma_commit_and_wait();
      hold(ds[0]);
      hold(ds[1]);
      if constexpr (kInputGrads == InputGrads::cluster_pair) hand_over<kExchangeFree>();
      wait_for<kPvFree>();
      if (j > 0) issue_p_and_values(j - 1);
      wait_for<kChunkDone>();
      if (j > 0) issue_rest(j - 1);
    }
    if (count > 0) per_token_sums(chunks[0]);
    if (p.dh0 != nullptr && this->run == this->runs - 1) {
#pragma unroll
      for (int b = 0; b < 2; ++b) store_state(row_block(ds, b), p.dh0, p, this->n, hv, StateRows{64 * b + m0, 0});
    }
  }

  // dgamma and dbeta of a chunk's rows from the roles' partial sums, in a fixed order; dg reverse-summed.
  __device__ void per_token_sums(const ChunkInfo& chunk) const {
    const std::int64_t t0 = chunk.start;
    const int rows = chunk.length, last_row = rows - 1, r = tid;
    auto over_parts = [&](int at, int r) {  // [half][warp][64], in that order
      const float* parts = sums(at);
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += parts[i * kChunk + r];
      return sum;
    };
    // The state path's own decay: each row's D term lands on the chunk's last row (less the last row's own, whose D
    // is 1 and cancels exactly), with E_n sum(S * dS').
    const float d_term = r < last_row ? over_parts(L::delta_parts, r) : 0.f;
    const float d_terms = warp_sum(d_term);  // rows 0-31 and 32-63, by warps 0 and 1
    float* scratch = sums(L::scratch);
    if ((tid & 31) == 0 && warp < 2) scratch[warp] = d_terms;
    wait_for<kStateOnly>();
    if (r < kChunk) {
      const float* state_dots = sums(L::state_dots);
      const float last_row_terms =
          scratch[0] + scratch[1] + (state_dots[0] + state_dots[1] + state_dots[2] + state_dots[3]);
      float dg = sums(L::q_dots)[r] + sums(L::corr_dots)[r] + decay_balance<8>(sums(L::g_parts), r) +
                 decay_balance<8>(sums(L::e_parts), r);
      dg += r == last_row ? last_row_terms : -d_term;
      sums(L::dgamma)[r] = r < rows ? dg : 0.f;
      const float db = sums(L::e_sums)[r] + over_parts(L::beta_parts, r);
      if (r < rows) store_gate<E>(p.dbeta, (t0 + r) * p.HV + hv, p.beta_float, db);
    }
    wait_for<kStateOnly>();  // dgamma
    store_chunk_dg<E>(p, sums(L::dgamma), t0, rows, hv, tid);
  }
};

// Warpgroup 1: the chain after dS' (K dS', dDelta, T^T dDelta, dcorr) over all 128 rows of V in two 64-row halves, and
// dK.
template <class E, InputGrads kInputGrads>
struct ChainRole : Cta<E> {
  using L = RoleSplitSmem<E>;
  using Exchange = PairExchange<kInputGrads>;
  using Cta<E>::p, Cta<E>::tid, Cta<E>::warp, Cta<E>::m0, Cta<E>::chunks, Cta<E>::hv, Cta<E>::h;
  __device__ ChainRole(char* smem_raw, const Params& params) : Cta<E>(smem_raw, params) {}

  __device__ void walk() const {
    const int count = chunks.count;
#pragma unroll 1
    for (int j = count - 1; j >= 0; --j) {
      const int walked = count - 1 - j;
      const ChunkInfo chunk = chunks[j];
      const std::int64_t t0 = chunk.start;
      const int m0 = opaque(this->m0);
      wait_for<kStateStaged>();  // dDelta^T = dO^T P + (dS'^T K^T) diag(D), half by half
      WarpOperand<E, kChunk> ddelta_operand[2] = {WarpOperand<E, kChunk>(nullptr), WarpOperand<E, kChunk>(nullptr)};
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int v0 = 64 * b + m0;
        float ddelta[1][kChunk / 8][4], kds[1][kChunk / 8][4];
        wgmma_fence();
        wgmma_ss_product<E, true, true, kChunk / 16>(
            ddelta[0], [&](int k0) { return mn_major(this->rows(L::d_o), k0, 64 * b); },
            [&](int k0) { return mn_major(this->square(L::p), k0, 0); }, false);
        rows_product<E>(kds[0], [&] { return this->state(L::ds); }, [&] { return this->rows(L::k); }, 64 * b);
        wgmma_commit_and_wait();
        hold(ddelta[0]);
        hold(kds[0]);
        const float* gate_out = this->gate_out();
        for_each(ddelta, kds, v0, 0, [&](int, int c, float& x, float& kd) { x += gate_out[c] * kd; });
        // dgamma's D terms: D rowsum(Delta * K dS') per token, this warp's 16 rows of V
        for_each_pair_with(kds, transposed(this->rows(L::delta)), v0, 0,
                           [&](int, int c, float& lo, float& hi, float2 delta) {
                             lo *= gate_out[c] * delta.x;
                             hi *= gate_out[c + 1] * delta.y;
                           });
        // The state role has summed the last chunk's partial sums, and the square role has formed corr and M.
        if (b == 0) wait_for<kSumsRead>();
        store_column_sums(kds, this->sums(L::delta_parts) + (4 * b + warp) * kChunk, 0);
        store_accumulator(ddelta, transposed(this->rows(L::ddelta)), v0, 0);  // for the square role's dT
        ddelta_operand[b].set(ddelta, 1.f);
      }
      hand_over<kDdeltaReady>();
      Exchange::before_overwrite(this->mbarriers(), walked);
#pragma unroll
      for (int b = 0; b < 2; ++b) {  // tdd^T = dDelta^T T; dcorr^T = tdd^T diag(beta), half by half
        const int v0 = 64 * b + m0;
        float tdd[1][kChunk / 8][4];
        wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < kChunk / 16; ++kb) {
          wgmma_64x64x16<E, true>(tdd[0], ddelta_operand[b].frag[kb], mn_major(this->square(L::t), 16 * kb, 0),
                                  kb > 0);
        }
        wgmma_commit_and_wait();
        hold(tdd[0]);
        {  // dbeta's rowsum(corr * tdd), corr from the square role's tile
          float product[1][kChunk / 8][4];
          for_each(product, tdd, v0, 0, [](int, int, float& x, float& y) { x = y; });
          for_each_pair_with(product, transposed(this->rows(L::v_then_corr)), v0, 0,
                             [](int, int, float& lo, float& hi, float2 corr) {
                               lo *= corr.x;
                               hi *= corr.y;
                             });
          store_column_sums(product, this->sums(L::beta_parts) + (4 * b + warp) * kChunk, 0);
        }
        const float *beta = this->beta(), *gate_in = this->gate_in();
        for_each(tdd, v0, 0, [&](int, int c, float& x) { x *= beta[c]; });  // dcorr^T
        store_accumulator(tdd, transposed(this->rows(L::edcorr)), v0, 0,
                          [&](float x, int, int c) { return -gate_in[c] * x; });
        store_accumulator(tdd, transposed(this->rows(L::dv)), v0, 0);
      }
      wait_for<kChainOnly>();  // dK and dV's store read the whole -E dcorr and dV tiles
      hand_over<kPvFree>();
      hand_over<kEdcorrToState>();
      hand_over<kEdcorrToSquare>();
      // dK = diag(D) Delta dS'^T - diag(E) dcorr S^T + M^T Q
      float dk[1][kKeys / 8][4];
      wgmma_fence();
      product_over_128_columns<E, false, kValues / 16>(
          dk, [&](int k0) { return k_major(this->rows(L::delta), k0); }, [&] { return this->state(L::ds); }, false);
      wgmma_commit_and_wait();
      hold(dk[0]);
      const float* gate_out = this->gate_out();
      for_each(dk, m0, 0, [&](int r, int, float& x) { x *= gate_out[r]; });
      wgmma_fence();
      product_over_128_columns<E, false, kValues / 16>(
          dk, [&](int k0) { return k_major(this->rows(L::edcorr), k0); }, [&] { return this->state(L::s); }, true);
      product_over_128_columns<E, true, kChunk / 16>(
          dk, [&](int k0) { return mn_major(this->square(L::m), k0, 0); }, [&] { return this->rows(L::q); }, true);
      wgmma_commit();
      // dV's rows beside the products
      store_rows<kWarpgroup>(this->rows(L::dv), static_cast<E*>(p.dv) + (t0 * p.HV + hv) * kValues,
                             static_cast<std::int64_t>(opaque(p.HV)) * kValues, chunk.length, opaque(tid));
      wgmma_wait();
      hold(dk[0]);
      if constexpr (kInputGrads == InputGrads::cluster_pair) {
        if (cluster_rank() == 1) hand_over<kExchangeFree>();  // rank 1's square role sends dQ's partial over them
      }
      wait_for<kFReady>();  // dK += F K + F^T K
      wgmma_fence();
      product_over_128_columns<E, false, kChunk / 16>(
          dk, [&](int k0) { return k_major(this->square(L::dt_then_f), k0); }, [&] { return this->rows(L::k); }, true);
      product_over_128_columns<E, true, kChunk / 16>(
          dk, [&](int k0) { return mn_major(this->square(L::dt_then_f), k0, 0); },
          [&] { return this->rows(L::k); }, true);
      wgmma_commit_and_wait();
      hold(dk[0]);
      hand_over<kChunkDone>();
      this->template finish_input_rows<kInputGrads>(dk, chunk, m0, keys<E>(p), p.dk_head, p.k_rstd, p.dk, 1, walked);
    }
    Exchange::before_overwrite(this->mbarriers(), count);  // the partner's last read of this CTA's tiles
  }
};

// Warpgroup 2: the chunk's square work (dP, M, G, dT, the inverse's backward, K K^T), K S and corr, dQ, and the
// per-token partial sums; warp w holds rows 16 w.. of each 64-row result.
template <class E, InputGrads kInputGrads>
struct SquareRole : Cta<E> {
  using L = RoleSplitSmem<E>;
  using Cta<E>::p, Cta<E>::tid, Cta<E>::warp, Cta<E>::m0, Cta<E>::chunks, Cta<E>::hv, Cta<E>::h, Cta<E>::sums;
  __device__ SquareRole(char* smem_raw, const Params& params) : Cta<E>(smem_raw, params) {}

  __device__ void walk() const {
    const int count = chunks.count;
#pragma unroll 1
    for (int j = count - 1; j >= 0; --j) {
      const int walked = count - 1 - j;
      const ChunkInfo chunk = chunks[j];
      const int m0 = opaque(this->m0);
      wait_for<kInputs>();  // dP = dO Delta^T; M; G
      float g[1][kChunk / 8][4];
      {
        float m[1][kChunk / 8][4];
        wgmma_fence();
        rows_product<E>(g[0], [&] { return this->rows(L::d_o); }, [&] { return this->rows(L::delta); });
        wgmma_commit_and_wait();
        hold(g[0]);
        for_each_decay<1, kChunk / 8>(this->gamma(), m0, 0, [&](int r, int c, float decay, FragmentIndex at) {
          at(m) = r >= c ? at(g) * p.scale * decay : 0.f;
        });
        store_accumulator(m, plain(this->square(L::m)), m0, 0);
        // G = dP * P below the diagonal (fused_backward.cu says why not on it); its sums are stored below
        for_each_pair_with(g, plain(this->square(L::p)), m0, 0, [](int r, int c, float& lo, float& hi, float2 pv) {
          lo = r > c ? lo * pv.x : 0.f;
          hi = r > c + 1 ? hi * pv.y : 0.f;
        });
      }
      float ks[1][kValues / 8][4];  // K S; corr = V - diag(E) K S over V
      wgmma_fence();
#pragma unroll
      for (int nb = 0; nb < kValues / 64; ++nb) {
        rows_product<E>(columns_of(ks, nb), [&] { return this->rows(L::k); }, [&] { return this->state(L::s); }, 0,
                        64 * nb);
      }
      wgmma_commit_and_wait();
      hold(ks[0]);
      {
        const float* gate_in = this->gate_in();
#pragma unroll
        for (int kb = 0; kb < kValues / 16; ++kb) {  // 16 columns at a time, K S kept for E dcorr . K S
          float block[1][2][4];
          for_each(block, column_block<2>(ks, 2 * kb), m0, 16 * kb, [](int, int, float& x, float& y) { x = y; });
          for_each_pair_with(block, plain(this->rows(L::v_then_corr)), m0, 16 * kb,
                             [&](int r, int, float& lo, float& hi, float2 v) {
                               lo = v.x - gate_in[r] * lo;
                               hi = v.y - gate_in[r] * hi;
                             });
          store_accumulator(block, plain(this->rows(L::v_then_corr)), m0, 16 * kb);
        }
      }
      // The state role has summed the last chunk's partial sums; this role's M and corr are whole (for the chain,
      // and for its own dQ and dT)
      wait_for<kSumsRead>();
      store_row_column_sums(g, m0, 0, sums(L::g_parts));
      wait_for<kDdeltaReady>();  // K K^T; dT = dDelta corr^T diag(beta), transposed into its tile
      float kk[1][kChunk / 8][4];
      {
        float dt[1][kChunk / 8][4];
        wgmma_fence();
        rows_product<E>(kk[0], [&] { return this->rows(L::k); }, [&] { return this->rows(L::k); });
        rows_product<E>(dt[0], [&] { return this->rows(L::ddelta); }, [&] { return this->rows(L::v_then_corr); });
        wgmma_commit_and_wait();
        hold(kk[0]);
        hold(dt[0]);
        const float* beta = this->beta();
        for_each(dt, m0, 0, [&](int, int c, float& x) { x *= beta[c]; });
        wait_for<kSquareOnly>();  // every warp's product has read dDelta, whose tile dT^T takes
        hand_over<kPvFree>();
        store_accumulator(dt, transposed(this->square(L::dt_then_f)), m0, 0);
      }
      wait_for<kSquareOnly>();  // X = T^T dT
      {
        float x[1][kChunk / 8][4];
        wgmma_fence();
        wgmma_ss_product<E, true, false, kChunk / 16>(
            x[0], [&](int k0) { return mn_major(this->square(L::t), k0, 0); },
            [&](int k0) { return k_major(this->square(L::dt_then_f), k0); }, false);
        wgmma_commit_and_wait();
        hold(x[0]);
        store_accumulator(x, plain(this->square(L::x)), m0, 0);
      }
      // E dcorr . K S (dg), once the chain has staged -E dcorr; the barrier also orders X's stores before -dA reads
      // them, and frees K S's registers for the inverse's backward
      wait_for<kEdcorrToSquare>();
      {
        float dots[2];
        row_dots(ks, this->rows(L::edcorr), m0, 0, dots);
        store_row_pair(dots, sums(L::corr_dots), m0, 0);
      }
      if constexpr (kInputGrads == InputGrads::cluster_pair) {
        if (cluster_rank() == 0) hand_over<kExchangeFree>();  // rank 0's chain sends dK's partial over them
      }
      {  // -dA = X T^T; the inverse's backward: F (for the chain's F K + F^T K) over dT^T, E's sums
        float minus_da[1][kChunk / 8][4];
        wgmma_fence();
        rows_product<E>(minus_da[0], [&] { return this->square(L::x); }, [&] { return this->square(L::t); });
        wgmma_commit_and_wait();
        hold(minus_da[0]);
        inverse_backward(minus_da, kk, this->square(L::dt_then_f), this->gamma(), this->beta(), m0, 0, sums(L::e_sums),
                         sums(L::e_parts));
      }
      hand_over<kFReady>();
      queries_grad(chunk, m0, walked);  // arrives at kChunkDone once it has read the chunk's inputs
    }
  }

  // dQ = scale diag(E) dO S^T + M K, its first term's Q dots for dgamma, then dq: per value head, finished here (a
  // group of one), or summed by rank 0 of a cluster pair with rank 1's partial. It comes last, after the inverse's
  // backward: in a pair, rank 1 hands its partial over through -E dcorr's and dV's tiles, free only once this role has
  // read -E dcorr; and dQ's 64 registers beside K S's (held until E dcorr . K S) would make ptxas serialise the wgmma
  // at this role's cap. Its reads of the chunk's inputs end at kChunkDone; the L2 norm's backward reads the normalised
  // rows from global memory, while the next chunk's copies land.
  __device__ void queries_grad(const ChunkInfo& chunk, int m0, int walked) const {
    float dq[1][kKeys / 8][4];
    wgmma_fence();
    product_over_128_columns<E, false, kValues / 16>(
        dq, [&](int k0) { return k_major(this->rows(L::d_o), k0); }, [&] { return this->state(L::s); }, false);
    wgmma_commit_and_wait();
    hold(dq[0]);
    {
      const float* gate_in = this->gate_in();
      for_each(dq, m0, 0, [&](int r, int, float& x) { x *= p.scale * gate_in[r]; });
      float dots[2];
      row_dots(dq, this->rows(L::q), m0, 0, dots);
      store_row_pair(dots, sums(L::q_dots), m0, 0);
    }
    wgmma_fence();
    product_over_128_columns<E, false, kChunk / 16>(
        dq, [&](int k0) { return k_major(this->square(L::m), k0); }, [&] { return this->rows(L::k); }, true);
    wgmma_commit_and_wait();
    hold(dq[0]);
    hand_over<kChunkDone>();  // the last reads of this chunk's inputs are done
    this->template finish_input_rows<kInputGrads>(dq, chunk, m0, queries<E>(p), p.dq_head, p.q_rstd, p.dq, 0, walked);
  }
};

template <class E, InputGrads kInputGrads>
__device__ __forceinline__ void role_split_backward(const Params& p) {
#ifdef DELTATRAIN_WGMMA
  extern __shared__ __align__(16) char smem_raw[];
  PairExchange<kInputGrads>::begin(Cta<E>(smem_raw, p).mbarriers());
  switch (threadIdx.x / kWarpgroup) {
    case 0:
      take_registers<kStateRegisters>();
      StateRole<E, kInputGrads>(smem_raw, p).walk();
      break;
    case 1:
      take_registers<kChainRegisters>();
      ChainRole<E, kInputGrads>(smem_raw, p).walk();
      break;
    default:
      take_registers<kSquareRegisters>();
      SquareRole<E, kInputGrads>(smem_raw, p).walk();
  }
#endif
}

template <class E, InputGrads kInputGrads>
__global__ void __launch_bounds__(kThreads, 1) role_split_backward_kernel(Params p) {
  role_split_backward<E, kInputGrads>(p);
}
// A GVA group's two value heads (grid y 2h and 2h + 1) as one cluster.
template <class E>
__global__ void __cluster_dims__(1, 2, 1) __launch_bounds__(kThreads, 1) role_split_backward_pair_kernel(Params p) {
  role_split_backward<E, InputGrads::cluster_pair>(p);
}

}  // namespace

void launch_role_split_backward(const Params& p, DType io, KernelSequence& kernels) {
  dispatch(io, p.K, [&]<class E, int K>() {
    if constexpr (sizeof(E) == 2 && K == kKeys) {  // where plan_execution splits the fused backward by role
      const dim3 grid(p.sequences * p.segments, p.HV), block(kThreads);
      constexpr int smem = RoleSplitSmem<E>::bytes;
      launch_by_input_grads<role_split_backward_kernel<E, InputGrads::per_value_head>,
                            role_split_backward_kernel<E, InputGrads::this_cta>, role_split_backward_pair_kernel<E>>(
          p, "gdn role_split_backward_kernel", "gdn role_split_backward_pair_kernel", grid, block, smem, kernels);
    }
  });
}

}  // namespace deltatrain::gdn::cuda
