// The sequential state passes on Hopper (sm_90a), used on sm_90 devices for 16-bit inputs with K <= 128 in
// place of state.cu's: the forward (and its recompute for the backward) and the backward. One warpgroup per
// 64 columns of V of a (sequence, value head) holds S^T or dS^T (64 x K) in float32 registers, warp w rows
// 16w..16w+15 with all K keys, so no partial sums are exchanged (state.cu splits keys between the warps of
// a pair); a CTA holds one such warpgroup, or two on adjacent columns (plan_execution says when). Every
// product is a wgmma with A in registers (the state, Delta^T, dO^T or D^T, rounded to 16 bits in the A
// layout) and B read by the tensor cores from 128-byte-swizzled chunk tiles. Forward, per chunk:
//   Delta^T = (V^T diag(beta)) T^T - S^T W^T     (the first term is U^T, formed here rather than read)
//   O^T     = scale e^gamma (S^T Q^T) + Delta^T P^T
//   S^T     = e^gamma_last S^T + (Delta^T diag(e^(gamma_last - gamma))) K
// Pass::recompute (for the backward) stores S^T entering each chunk and Delta instead of O. The backward
// (state_backward_hopper_kernel) walks the chunks in reverse with the transposed map.
// Where each warpgroup takes 64 keys (plan.h's wgmma_pass_forms_w), the passes form W = T diag(beta e^gamma) K
// themselves, a chunk ahead in their walk, from the K tile the stage holds anyway: W does not depend on the state, so
// its product runs behind the step's state update, and prepare neither forms nor stores W for them. All but the
// backward's reverse pass proper do (the reverse segment ends pass among them, with T and beta copied for it). The
// forward-direction ones form it from the T, beta and gates they hold for U: the forward pass, whose registers O's
// accumulators make the tightest, scales T into a shared tile of T diag(beta e^gamma) once the copies have landed
// and takes both operands from shared memory (held in registers, that operand spilled); the others, bound by their
// copies more than by their chain, scale it in registers. The other passes (the reverse pass proper, and those of one
// warpgroup over all 128 keys) read prepare's W. The passes read T, not T diag(beta), and
// scale V^T's fragments by beta for U: T is what the backward reads too, so that prepare writes one 64 x 64 tile a
// chunk and head for both, not two.
//
// Few long sequences over few heads leave most SMs idle while the chain of chunks is long, so such calls
// split each sequence into p.segments runs of chunks (docs/gdn-algorithm.md section 3: the chunk map is affine,
// S^T' = S^T A + B with A = e^gamma_last I - W^T diag(e^(gamma_last - gamma)) K, B = U^T diag(..) K):
//   1. Pass::segment_ends, every segment but the last in parallel: its end state from a zero start (segment
//      0 from h0), R_s, and, with more than two segments, the product M_s of its chunks' A, computed as K more
//      state rows that start at the identity with U = 0 (the same step: Delta^T = -X W^T, X' = e^gamma_last X +
//      Delta^T diag(..) K). Where the plan says maps_apart, M's rows are a launch of their own beside the ends
//      pass (Pass::segment_maps), with only the tiles they read (W and K; no V or dO, Q or P), so that a CTA of
//      each fits an SM; elsewhere they are more row blocks of the ends pass's launch. Where prepare bounds each chunk's
//      map (p.chunk_log_norms, every segmented call: warmup.h), a segment whose last chunks forget all but 2^-24 of
//      the state entering them warms up instead: R_s is the walk of those chunks alone from a zero start (segment 0
//      too: it forgets h0), and its M_s is stored as zero: the next segment starts from R_s alone; a
//      segment whose chunks do not forget enough (gates near 0) is walked whole, exactly;
//   2. segment_starts_kernel, per (sequence, head): start_1 = R_0, start_(s+1) = start_s M_s + R_s (sums
//      in float32, product operands rounded to 16 bits as in every chunk step); segment 0 starts from the
//      true state, so M_0 is never formed, and with two segments there is nothing to compose; where every
//      segment warmed up (every M zero) nothing chains and it stores nothing;
//   3. the pass proper of every segment in parallel from its true start: the previous segment's end R where
//      that segment is the first or warmed up, else step 2's (segment_start_rows, sequential.cuh).
// The backward segments the same way in its own order (the last segment is its first run): its chunk map is
// dS^T' = dS^T (e^gamma_last I - K^T diag(..) W) + (terms of dO), so M's rows there carry no dO, and a segment's
// warm-up walks its first chunks (the reverse walk's last), bounded by the same B_c.
// bench/prototypes/segmented_state.py checks this algebra in float64 against the token recurrence.
#include <cuda_runtime_api.h>

#include <algorithm>

#include "deltatrain/core/cuda_check.h"
#include "dispatch.cuh"
#include "launch.h"
#include "plan.h"
#include "state_hopper.cuh"
#include "warmup.h"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kColumns = kWgmmaColumns;  // of V per warpgroup: the wgmma row count

// segment_ends walks a segment's rows of the state (or its gradient), segment_maps its rows of M (step 1 above).
enum class Pass { forward, recompute, backward, segment_ends, segment_maps };

// Per stage: W and K, with Q and P when the pass reads them, T where it forms U or forms W from it, and
// T diag(beta e^gamma) where it forms W from a shared tile (the forward pass), as swizzled tiles (wgmma operands);
// where its rows are of the state (kReadsColumns), the CTA's columns of V or dO (64 per warpgroup) as a padded tile
// (read into registers); the gate vectors, and beta where the pass reads T. Then, where the pass stores rows per
// chunk (kStaging), per warp the staging tile of its token-major stores.
template <class E, int K, bool kQueries, bool kValues, bool kDecayedT, int kGroups, bool kStaging, bool kReadsColumns>
struct HopperSmem {
  using KeyTile = SwizzledTile<E, kChunk, K>;          // W, K (, Q): [token][key]
  using ChunkTile = SwizzledTile<E, kChunk, kChunk>;   // P, T: [token][token]
  using ColumnTile = Tile<E, kChunk, kColumns * kGroups>;  // V or dO: [token][column of V]
  using TokenTile = Tile<E, kChunk, 16>;                // 64 tokens x a warp's 16 columns of V
  using StateRowsTile = Tile<E, 16, K>;                 // a warp's 16 rows of S^T or dS^T
  static constexpr int kWarpStaging =
      TokenTile::kBytes > StateRowsTile::kBytes ? TokenTile::kBytes : StateRowsTile::kBytes;
  static constexpr int kKeyTiles = kQueries ? 3 : 2;
  static constexpr int p_at = kKeyTiles * KeyTile::kBytes;
  static constexpr int t_at = p_at + (kQueries ? ChunkTile::kBytes : 0);
  static constexpr int t_beta_decay_at = t_at + (kValues ? ChunkTile::kBytes : 0);
  static constexpr int columns_at = t_beta_decay_at + (kDecayedT ? ChunkTile::kBytes : 0);
  static constexpr int gates_at = columns_at + (kReadsColumns ? ColumnTile::kBytes : 0);
  static constexpr int stage_bytes = round_up(gates_at + (kValues ? 3 : 2) * kChunk * 4, 1024);  // e^gamma, D, beta
  static constexpr int stages = 2;
  static constexpr int staging_at = stages * stage_bytes;
  // The swizzled blocks need 1024-byte alignment, which dynamic shared memory does not promise.
  static constexpr int bytes = staging_at + (kStaging ? 4 * kGroups * kWarpStaging : 0) + 1024;
  static_assert(bytes <= kSmemLimit);
};

// What the forward and the backward kernels share: the CTA's place, its chunks, its tiles and their copies,
// and the segmented pass's start and end rows. The grid is (sequences x runs, HV, row blocks of 64 kGroups,
// one warpgroup per 64 rows): runs are the sequence's segments in the order the pass walks them (the
// backward walks the last one first); step 1 has one run fewer (the last walked needs no end), and its K / 64
// blocks of 64 rows of M (after V's in the kernels' numbering: Pass::segment_maps's, or the segment ends pass's
// past V) start at the identity and carry no U or dO. The forward passes form U^T = (V^T diag(beta)) T^T per chunk from
// V's columns rather than read U: those four products do not wait on the state, and prepare then neither computes nor
// stores U.
template <class E, int K, Pass kPass, bool kReverse, int kGroups>
struct HopperPass {
  static constexpr bool kEnds = kPass == Pass::segment_ends || kPass == Pass::segment_maps;  // step 1
  static constexpr bool kMapsOnly = kPass == Pass::segment_maps;                            // rows of M alone
  static constexpr bool kFormsW = !wgmma_pass_reads_w(kPass == Pass::backward, K, kGroups);
  // T and beta: U (the forward-direction state rows), or W from them
  static constexpr bool kValues = (!kReverse && !kMapsOnly) || kFormsW;
  static constexpr bool kWFromDecayedT = kFormsW && kPass == Pass::forward;  // from a shared T diag(beta e^gamma)
  static constexpr int kThreads = kWarpgroup * kGroups;
  // Step 1 stores nothing per chunk, so it has no staging tiles: that lets two of its forward CTAs share an SM (99
  // KB each at K = 128, 115 KB with them). M's rows read neither Q and P nor V or dO: 67 KB at K = 128 (83 where
  // they form W), so that one of them shares an SM with a CTA of any pass's state rows (the reverse ones take 133).
  using L = HopperSmem<E, K, kPass != Pass::recompute && !(kEnds && !kReverse) && !kMapsOnly, kValues,
                       kWFromDecayedT, kGroups, !kEnds, !kMapsOnly>;
  static_assert(kPass != Pass::segment_ends || kReverse || kGroups > 1 || 2 * (L::bytes + 1024) <= kSmemPerSm,
                "two forward segment ends CTAs of one warpgroup (as segments run) an SM");
  static_assert(!kMapsOnly || L::bytes + 1024 + 134 * 1024 <= kSmemPerSm,
                "a CTA of M's rows beside one of the reverse segment ends pass");
  char* smem;
  std::uint32_t smem_base;
  const Params& p;
  int runs, n, run, hv, h, row_block, tid, m0;
  // Rows of M, which have no U or dO: segment_maps's, and the segment ends pass's past V (constant elsewhere, so that
  // the other passes carry no branch around their products).
  bool transition_rows;
  StateRows at;
  SequenceChunks chunks;
  // Step 1: whether the run warms up (walks only the chunks nearest the next run, from zero) or is walked whole.
  bool warms_up = false;

  __device__ HopperPass(char* smem_raw, const Params& params, int column_block)
      : p(params), runs(kEnds ? params.segments - 1 : params.segments),
        n(blockIdx.x / runs), run(blockIdx.x % runs), hv(blockIdx.y), h(hv / params.group),
        row_block((kMapsOnly ? params.V : 0) + column_block * kColumns * kGroups), tid(threadIdx.x),
        m0(16 * (threadIdx.x / 32)),
        transition_rows(kMapsOnly || (kPass == Pass::segment_ends && row_block >= params.V)), at{row_block + m0, 0},
        chunks(run_chunks<kReverse>(params, n, run)) {
    const int raw = static_cast<int>(smem_address(smem_raw));
    smem = smem_raw + (round_up(raw, 1024) - raw);
    smem_base = round_up(raw, 1024);
    if constexpr (kEnds) choose_warmup();
  }

  // Step 1's choice (warmup_chunks). Rows of M of a run that warms up walk nothing: they store M as zero
  // (walks_nothing).
  __device__ void choose_warmup() {
    const int walked = warmup_chunks<kReverse>(p, chunks, hv);
    warms_up = walked > 0;
    if (!warms_up || transition_rows) return;
    chunks = kReverse ? chunks.before(walked) : chunks.from(chunks.count - walked);
  }

  __device__ typename L::KeyTile key_tile(int stage, int i) const {
    return {smem_base + stage * L::stage_bytes + i * L::KeyTile::kBytes};
  }
  __device__ typename L::ChunkTile p_tile(int stage) const { return {smem_base + stage * L::stage_bytes + L::p_at}; }
  __device__ typename L::ChunkTile t_tile(int stage) const { return {smem_base + stage * L::stage_bytes + L::t_at}; }
  __device__ typename L::ChunkTile t_beta_decay_tile(int stage) const {
    return {smem_base + stage * L::stage_bytes + L::t_beta_decay_at};
  }
  __device__ typename L::ColumnTile column_tile(int stage) const {
    return {smem_at<E>(smem, stage * L::stage_bytes + L::columns_at)};
  }
  __device__ float* gate_in(int stage) const { return smem_at<float>(smem, stage * L::stage_bytes + L::gates_at); }
  __device__ float* beta(int stage) const { return gate_in(stage) + 2 * kChunk; }  // where kValues
  __device__ typename L::TokenTile staging() const {
    return {smem_at<E>(smem, L::staging_at + (tid / 32) * L::kWarpStaging)};
  }
  // Stores the warp's rows of a state, rounded to E, as chunk j's block of a per-chunk [chunks, HV, V, K]
  // tensor: through the warp's staging area, so that the global stores are whole 16-byte pieces of rows.
  // Staged first and stored later (store_staged_state), so that the stores can run beside products:
  // ptxas serialises the products when registers a product wrote are read while another one runs.
  __device__ typename L::StateRowsTile state_staging() const {
    return {smem_at<E>(smem, L::staging_at + (tid / 32) * L::kWarpStaging)};
  }
  template <int NT>
  __device__ void stage_state(float (&state)[1][NT][4]) const {
    __syncwarp();  // the previous store has read the staging area
    store_pairs(state, state_staging().ptr, L::StateRowsTile::kLd);
    __syncwarp();
  }
  __device__ void store_staged_state(void* base, int j) const {
    store_rows<32>(state_staging(), chunk_state_block<E>(base, p, chunks.first + j, hv, at), K, 16, tid & 31);
  }
  template <int NT>
  __device__ void store_chunk_state(float (&state)[1][NT][4], void* base, int j) const {
    stage_state(state);
    store_staged_state(base, j);
  }
  // The warp's rows of a token-major [tokens, HV, V] tensor at the chunk's first token.
  __device__ E* token_rows(void* base, const ChunkInfo& info) const {
    return static_cast<E*>(base) + (static_cast<std::int64_t>(info.start) * p.HV + hv) * p.V + at.v0;
  }

  // Walks the run's chunks in the pass's order with their tiles copied ahead: body(j, stage) once chunk j's
  // tiles, with U or dO (`columns`), are in the stage. Where the pass forms W a chunk ahead, its step has already
  // awaited the next chunk's copies (await_next_chunk), so the walk adds no barrier of its own after the first step.
  template <class Body>
  __device__ void walk(const void* columns, Body&& body) const {
    sequential_pass<2, kReverse, true, kFormsW>(chunks.count, [&](int j, int stage) { issue(j, stage, columns); }, body);
  }
  // Elements between consecutive tokens of a token-major [tokens, HV, V] tensor.
  __device__ std::int64_t token_stride() const { return static_cast<std::int64_t>(p.HV) * p.V; }

  // The walk's first step (the first chunk it takes), and whether a step has another after it.
  __device__ bool first_step(int j) const { return j == (kReverse ? chunks.count - 1 : 0); }
  __device__ bool has_next_step(int j) const { return kReverse ? j > 0 : j + 1 < chunks.count; }

  // Starts copying chunk j's tiles into a stage: W unless the pass forms it, K (, Q, P, T and beta), and V or dO
  // (`columns`) for rows of S^T.
  __device__ void issue(int j, int stage, const void* columns) const {
    const ChunkInfo info = chunks[j];
    if constexpr (!kFormsW) {
      load_chunk_rows<kThreads>(key_tile(stage, 0), static_cast<const E*>(p.w), p.HV, hv, K, 0, info, tid);
    }
    load_chunk_rows<kThreads>(key_tile(stage, 1), keys<E>(p), p.H, h, K, 0, info, tid);
    if constexpr (L::kKeyTiles == 3) {
      load_chunk_rows<kThreads>(key_tile(stage, 2), queries<E>(p), p.H, h, K, 0, info, tid);
      load_lower_chunk_tile<kThreads>(p_tile(stage), p.p, p.HV, hv, info, tid);
    }
    if constexpr (kValues) {
      load_lower_chunk_tile<kThreads>(t_tile(stage), p.t, p.HV, hv, info, tid);
      load_head_vector_async(p.beta_by_head, beta(stage), p, hv, info, tid);
    }
    if (!transition_rows) load_chunk_rows<kThreads>(column_tile(stage), columns, p.HV, hv, p.V, row_block, info, tid);
    load_gates_async(p, gate_in(stage), gate_in(stage) + kChunk, hv, info, tid);
  }

  // Where kFormsW, W = (T diag(beta e^gamma)) K of the chunk in `stage`, the warpgroup's 64 key columns, is formed
  // by issue_w (one group of products) into `w` and, once waited for, put in the stage's W tile by store_w; the next
  // chunk's first products read it after the walk's fence and barrier.
  using WAccumulator = float[1][kColumns / 8][4];
  __device__ __forceinline__ int w_key0() const { return tid / kWarpgroup * kColumns; }
  __device__ __forceinline__ void issue_w(int stage, WAccumulator& w) const {
    if constexpr (kWFromDecayedT) {
      wgmma_fence();
      wgmma_ss_product<E, false, true, kChunk / 16>(
          w[0], [&](int k0) { return k_major(t_beta_decay_tile(stage), k0); },
          [&](int k0) { return mn_major(key_tile(stage, 1), k0, w_key0()); }, false);
    } else {
      issue_w_from_t(w[0], swizzled_tile<E, kChunk, kChunk>(smem + stage * L::stage_bytes + L::t_at), gate_in(stage),
                     beta(stage), key_tile(stage, 1), w_key0(), 16 * (tid / 32 % 4));
    }
    wgmma_commit();
  }
  __device__ __forceinline__ void store_w(int stage, WAccumulator& w) const {
    hold(w[0]);
    const auto w_tile = swizzled_tile<E, kChunk, K>(smem + stage * L::stage_bytes);  // key_tile(stage, 0)
    store_accumulator(w, plain(w_tile), 16 * (tid / 32 % 4), w_key0());
  }
  // T diag(beta e^gamma) of the chunk in `stage`, formed in its tile from the stage's T, beta and e^gamma: each
  // 16-byte piece of a row (the two tiles share the swizzle) scaled by its eight columns' beta e^gamma, rounded as
  // the other passes round the operand they scale in registers. Upper pieces are zero in both.
  __device__ __forceinline__ void decay_t_beta(int stage) const {
    using Tile = typename L::ChunkTile;
    constexpr int kPieces = kChunk * kChunk / 8;
    static_assert(kPieces % kThreads == 0 && kThreads % 8 == 0, "each thread scales pieces of the same eight columns");
    const char* from = smem + stage * L::stage_bytes + L::t_at;
    char* to = smem + stage * L::stage_bytes + L::t_beta_decay_at;
    // The thread's eight columns' beta e^gamma, read once. The eight threads of a quarter warp take columns 0, 8, ..,
    // 56, so in column order each 16-byte load of a half was a two-way bank conflict (halves 32 bytes apart); threads
    // 4-7 read their upper half first, and each load's eight halves then lie in distinct banks.
    const int c = tid % 8 * 8, first = tid % 8 < 4 ? 0 : 4;
    const float *gates = gate_in(stage) + c, *betas = beta(stage) + c;
    const float4 g_first = *reinterpret_cast<const float4*>(gates + first);
    const float4 g_second = *reinterpret_cast<const float4*>(gates + (4 - first));
    const float4 b_first = *reinterpret_cast<const float4*>(betas + first);
    const float4 b_second = *reinterpret_cast<const float4*>(betas + (4 - first));
    const float4 x_first{g_first.x * b_first.x, g_first.y * b_first.y, g_first.z * b_first.z, g_first.w * b_first.w};
    const float4 x_second{g_second.x * b_second.x, g_second.y * b_second.y, g_second.z * b_second.z,
                          g_second.w * b_second.w};
    const float4 lo = first == 0 ? x_first : x_second, hi = first == 0 ? x_second : x_first;
    const float g[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int k = 0; k < kPieces / kThreads; ++k) {
      const int at = Tile::offset((tid + k * kThreads) / 8, c);
      uint4 x = *reinterpret_cast<const uint4*>(from + at);
      std::uint32_t* words = &x.x;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 v = unpack2<E>(words[i]);
        words[i] = pack2<E>(v.x * g[2 * i], v.y * g[2 * i + 1]);
      }
      *reinterpret_cast<uint4*>(to + at) = x;
    }
  }
  // The next chunk's copies, landed and visible to every thread's wgmma: its W is formed during this step.
  __device__ __forceinline__ void await_next_chunk(int next_stage) const {
    cp_async_wait<0>();
    if constexpr (kWFromDecayedT) {
      __syncthreads();
      decay_t_beta(next_stage);
    }
    fence_for_wgmma();
    __syncthreads();
  }
  // Every product of a step waited for, the state (or its gradient) they updated among them. Where the pass forms W,
  // the next chunk's is queued first, behind the step's products (it needs the next chunk's copies, not the state),
  // and stored for the next step after them.
  template <int NT>
  __device__ __forceinline__ void finish_step(int j, int stage, float (&state)[1][NT][4]) const {
    WAccumulator next_w;
    const bool next = kFormsW && has_next_step(j);
    const int next_stage = (stage + 1) % L::stages;
    if (next) {
      await_next_chunk(next_stage);
      issue_w(next_stage, next_w);
    }
    wgmma_wait();
    hold(state[0]);
    if (next) {
      store_w(next_stage, next_w);
      fence_for_wgmma();  // for the next step's products, behind the walk's barrier
    }
  }
  // W of the run's first chunk, before its first step: nothing formed it a step ahead.
  __device__ __forceinline__ void form_first_w(int stage) const {
    if constexpr (kWFromDecayedT) {
      decay_t_beta(stage);
      fence_for_wgmma();
      __syncthreads();
    }
    WAccumulator w;
    issue_w(stage, w);
    wgmma_wait();
    store_w(stage, w);
    fence_for_wgmma();
    __syncthreads();
  }

  // The rows at the start of the run: the identity (rows of M), the caller's state (h0 or dht) for the
  // first run unless it warms up, zero for a warm-up and the other runs of segment_ends, else the start step 2
  // computed (for the second run that is the first run's end, R_0, which step 1 stored).
  template <int NT>
  __device__ void start_rows(float (&state)[1][NT][4], const float* initial) const {
    if (transition_rows) {
      const int first_row = at.v0 - p.V;
      for_each(state, 0, 0, [&](int r, int c, float& x) { x = first_row + r == c ? 1.f : 0.f; });
    } else if (run == 0 && !warms_up) {
      load_state(state, initial, p, n, hv, at);
    } else if constexpr (kEnds) {
      zero(state);
    } else {
      load_pairs(state, segment_start_rows<kReverse>(p, n, run, hv) + at.v0 * K, K, 16);
    }
  }
  // Whether the CTA has no walk to make: rows of M of the first run (it starts from the true state, so no step uses
  // its M), or of a run that warms up (the next start is the warm-up's end alone, so M is stored as zero here: step
  // 2's start M + R then gives R).
  __device__ bool walks_nothing() const {
    if (!transition_rows) return false;
    if (run == 0) return true;
    if (!warms_up) return false;
    float zeros[1][K / 8][4];
    zero(zeros);
    store_end_rows(zeros);
    return true;
  }
  // Step 1: the run's end rows, R in float32 and M in the io type (the B operand of step 2's products, as the
  // chunk tiles are of the steps).
  template <int NT>
  __device__ void store_end_rows(float (&state)[1][NT][4]) const {
    if (transition_rows) {
      store_pairs(state, segment_rows<E>(p.segment_maps, p, n, run, runs, hv, K) + (at.v0 - p.V) * K, K);
    } else {
      store_pairs(state, segment_rows<float>(p.segment_ends[kReverse], p, n, run, runs, hv, p.V) + at.v0 * K, K);
    }
  }
};

// Forward (Pass::forward, recompute, segment_ends or segment_maps) of the CTA's column block: see the top of
// the file.
template <class E, int K, Pass kPass, int kGroups>
__device__ __forceinline__ void forward_pass(const Params& p, char* smem_raw, int column_block) {
  using Walk = HopperPass<E, K, kPass, false, kGroups>;
  const Walk pass(smem_raw, p, column_block);
  if (pass.walks_nothing()) return;
  constexpr bool kQueries = kPass == Pass::forward;
  const std::int64_t token_stride = pass.token_stride();
  const auto staging = pass.staging();  // (past the layout's end in step 1, which stores no rows)
  float state[1][K / 8][4];
  pass.start_rows(state, p.h0);

  pass.walk(p.v, [&](int j, int stage) {
    const ChunkInfo info = pass.chunks[j];
    const float *gates_in = pass.gate_in(stage), *gates_out = gates_in + kChunk;
    if constexpr (Walk::kFormsW) {
      if (pass.first_step(j)) pass.form_first_w(stage);
    }

    // The recompute's global stores run while a group of products does (a warp's stores stall it until they
    // have read the staging tile and their registers); what they store is staged before the group is issued.
    if constexpr (kPass == Pass::recompute) pass.stage_state(state);
    WarpOperand<E, K> neg_state(nullptr);  // -S^T, so that the W product lands on U^T
    neg_state.set(state, -1.f);
    float delta[1][kChunk / 8][4], out[1][kChunk / 8][4];
    WarpOperand<E, kChunk> values(nullptr);  // V^T, this warp's columns of V (rows of M have none)
    if (pass.transition_rows) {
      zero(delta);
    } else {
#pragma unroll
      for (int kb = 0; kb < kChunk / 16; ++kb) {
        load_a16(values.frag[kb], transposed(pass.column_tile(stage)), pass.m0, 16 * kb);
      }
      values.scale_columns(pass.beta(stage), 1.f);  // V^T diag(beta): U^T's operand against T
    }
    // Delta first and O's state term in a group of its own behind it: Delta's elementwise work (the decay,
    // its two operands) runs while the tensor cores form S^T Q^T, and O's scaling while they update S.
    wgmma_fence();
    issue_delta(delta[0], values, !pass.transition_rows, neg_state, pass.t_tile(stage), pass.key_tile(stage, 0));
    wgmma_commit();
    if constexpr (kQueries) {
#pragma unroll
      for (int kb = 0; kb < K / 16; ++kb) {
        wgmma_64x64x16<E, false>(out[0], neg_state.frag[kb], k_major(pass.key_tile(stage, 2), 16 * kb), kb > 0);
      }
      wgmma_commit();
    }
    if constexpr (kPass == Pass::recompute) pass.store_staged_state(p.states, j);
    wgmma_wait<kQueries ? 1 : 0>();
    hold(delta[0]);

    const float decay = gates_in[kChunk - 1];
    for_each(state, 0, 0, [&](int, int, float& x) { x *= decay; });
    WarpOperand<E, kChunk> update(nullptr), delta_operand(nullptr);
    update.set(delta, 1.f, gates_out);
    if constexpr (kQueries) delta_operand.set(delta, 1.f);
    if constexpr (kPass == Pass::recompute) stage_token_rows(delta, staging);
    wgmma_fence();
    update_state<E, K>(state, update, pass.key_tile(stage, 1));
    wgmma_commit();
    if constexpr (kQueries) {
      wgmma_wait<1>();
      hold(out[0]);
      scale_columns(out, gates_in, -p.scale);
      wgmma_fence();
#pragma unroll
      for (int kb = 0; kb < kChunk / 16; ++kb) {
        wgmma_64x64x16<E, false>(out[0], delta_operand.frag[kb], k_major(pass.p_tile(stage), 16 * kb));
      }
      wgmma_commit();
    }
    if constexpr (kPass == Pass::recompute) {
      store_rows<32>(staging, pass.token_rows(p.delta, info), token_stride, info.length, pass.tid & 31);
    }
    pass.finish_step(j, stage, state);
    if constexpr (kQueries) {
      hold(out[0]);
      store_token_rows(out, staging, pass.token_rows(p.o, info), token_stride, info.length);
    }
  });
  if constexpr (Walk::kEnds) {
    pass.store_end_rows(state);
  } else if constexpr (kPass == Pass::forward) {
    if (p.ht != nullptr && pass.run == p.segments - 1) store_state(state, p.ht, p, pass.n, pass.hv, pass.at);
  }
}

// Backward (Pass::backward, segment_ends or segment_maps), chunks in reverse; dS^T is the warpgroup's
// block of the gradient of the state after the chunk:
//   D^T  = (dS^T K^T) diag(e^(gamma_last - gamma)) + dO^T P
//   dS^T = e^gamma_last dS^T + (dO^T diag(scale e^gamma)) Q - D^T W
// The gradient after each chunk and D are stored for the chunk-gradient kernels; what enters chunk 0 is dh0.
template <class E, int K, Pass kPass, int kGroups>
__device__ __forceinline__ void backward_pass(const Params& p, char* smem_raw, int column_block) {
  using Walk = HopperPass<E, K, kPass, true, kGroups>;
  const Walk pass(smem_raw, p, column_block);
  if (pass.walks_nothing()) return;
  const std::int64_t token_stride = pass.token_stride();
  const auto staging = pass.staging();
  float dstate[1][K / 8][4];
  pass.start_rows(dstate, p.dht);

  pass.walk(p.d_o, [&](int j, int stage) {
    const ChunkInfo info = pass.chunks[j];
    const float *gates_in = pass.gate_in(stage), *gates_out = gates_in + kChunk;
    if constexpr (Walk::kFormsW) {
      if (pass.first_step(j)) pass.form_first_w(stage);
    }
    if constexpr (kPass == Pass::backward) pass.store_chunk_state(dstate, p.dstates, j);

    WarpOperand<E, K> state_operand(nullptr);
    state_operand.set(dstate, 1.f);
    // dO^T as two operands, plain for D's dO^T P and scaled by scale e^gamma for dS's Q term, so that the
    // Q term (which does not wait on D) runs in a group of its own while D's elementwise work and stores do.
    WarpOperand<E, kChunk> do_operand(nullptr), do_scaled(nullptr), d_operand(nullptr);
    if (!pass.transition_rows) {
      float do_t[1][kChunk / 8][4];
      load_accumulator(do_t, transposed(pass.column_tile(stage)), pass.m0);
      do_operand.set(do_t, 1.f);
      do_scaled.set(do_t, p.scale, gates_in);
    }
    const float decay = gates_in[kChunk - 1];
    for_each(dstate, 0, 0, [&](int, int, float& x) { x *= decay; });
    float ddelta[1][kChunk / 8][4], from_do[1][kChunk / 8][4];
    wgmma_fence();
#pragma unroll
    for (int kb = 0; kb < K / 16; ++kb) {
      wgmma_64x64x16<E, false>(ddelta[0], state_operand.frag[kb], k_major(pass.key_tile(stage, 1), 16 * kb), kb > 0);
    }
    if (!pass.transition_rows) {
#pragma unroll
      for (int kb = 0; kb < kChunk / 16; ++kb) {
        wgmma_64x64x16<E, true>(from_do[0], do_operand.frag[kb], mn_major(pass.p_tile(stage), 16 * kb, 0), kb > 0);
      }
    }
    wgmma_commit();
    if (!pass.transition_rows) update_state<E, K>(dstate, do_scaled, pass.key_tile(stage, 2));
    wgmma_commit();
    wgmma_wait<1>();
    hold(ddelta[0]);
    hold(from_do[0]);
    scale_columns(ddelta, gates_out, 1.f);
    if (!pass.transition_rows) for_each(ddelta, from_do, 0, 0, [](int, int, float& d, float& x) { d += x; });
    d_operand.set(ddelta, -1.f);
    if constexpr (kPass == Pass::backward) {
      store_token_rows(ddelta, staging, pass.token_rows(p.ddelta, info), token_stride, info.length);
    }
    wgmma_fence();
    update_state<E, K>(dstate, d_operand, pass.key_tile(stage, 0));
    wgmma_commit();
    pass.finish_step(j, stage, dstate);
  });
  if constexpr (Walk::kEnds) {
    pass.store_end_rows(dstate);
  } else {
    if (p.dh0 != nullptr && pass.run == p.segments - 1) store_state(dstate, p.dh0, p, pass.n, pass.hv, pass.at);
  }
}

template <class E, int K, Pass kPass, int kGroups>
__global__ void __launch_bounds__(kWarpgroup * kGroups, 1) state_forward_hopper_kernel(Params p) {
#ifdef DELTATRAIN_WGMMA
  extern __shared__ __align__(16) char smem_raw[];
  forward_pass<E, K, kPass, kGroups>(p, smem_raw, blockIdx.z);
#endif
}

template <class E, int K, Pass kPass, int kGroups>
__global__ void __launch_bounds__(kWarpgroup * kGroups, 1) state_backward_hopper_kernel(Params p) {
#ifdef DELTATRAIN_WGMMA
  extern __shared__ __align__(16) char smem_raw[];
  backward_pass<E, K, kPass, kGroups>(p, smem_raw, blockIdx.z);
#endif
}

// The backward's recompute and its reverse pass do not depend on each other (the reverse pass needs no S),
// so where each has at most half the SMs' worth of units they run side by side in one launch: the first
// V / 64 column blocks of the grid recompute, the others walk back. See plan_execution for when this pays.
template <class E, int K>
__global__ void __launch_bounds__(kWarpgroup, 1) state_passes_paired_hopper_kernel(Params p) {
#ifdef DELTATRAIN_WGMMA
  extern __shared__ __align__(16) char smem_raw[];
  const int column_blocks = p.V / kColumns;
  if (static_cast<int>(blockIdx.z) < column_blocks) {
    forward_pass<E, K, Pass::recompute, 1>(p, smem_raw, blockIdx.z);
  } else {
    backward_pass<E, K, Pass::backward, 1>(p, smem_raw, blockIdx.z - column_blocks);
  }
#endif
}

// Step 2 of the segmented pass: the true state entering every segment from the third, start_(s+1) =
// start_s M_s + R_s with start_1 = R_0 (segment 0 started from h0); the sum is float32, the product's
// operands are rounded to E like those of every chunk step. It is a chain of segments - 2 dependent
// products per (sequence, value head) over only a few such heads (the calls that segment have few units),
// so its time is the chain's: a CTA takes 16 rows of start^T (one mma row block) and its K / 16 warps 16
// columns each, so that a warp's step is K / 16 mma per n-tile (not the whole 16 x K x K row block), and
// one barrier a step publishes the new rows (two buffers) and the next step's M and R. Every CTA reads a
// whole M (32 KB at K = 128) a step, so those are copied by cp.async three steps ahead, off the chain even
// for a step much shorter than today's ~1.1 us (on the H200 one step ahead measured the same at that length).
// Each n-tile accumulates over k in order, as warp_mma does.
template <class E, int K>
struct SegmentStartsSmem {
  static constexpr int kRows = 16;       // of start^T per CTA
  static constexpr int kWarps = K / 16;  // each on 16 of its K columns
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kSlots = 4;       // the step's M and R, and three steps' in flight
  using RowsTile = Tile<E, kRows, K>;    // start_s rounded to E: the A operand
  using MapTile = Tile<E, K, K>;
  using EndTile = Tile<float, kRows, K>;  // the CTA's rows of R_s
  static constexpr int slots_at = 2 * RowsTile::kBytes;
  static constexpr int slot_bytes = MapTile::kBytes + EndTile::kBytes;
  static constexpr int bytes = slots_at + kSlots * slot_bytes;
  static_assert(bytes <= kSmemLimit);
};

// A run that warmed up stored its M as zero, so start_(s+1) is its R_s alone, which its readers take from the ends
// (segment_start_rows): where every run from the second did, nothing chains and the kernel stores nothing. Each
// thread asks about its own runs, so that their bounds' loads are in flight together: asked one run after another,
// and with the ends copied into the starts, the kernel took nearly what the chain had (bwd 2/4 1x8192 on an H100:
// 0.038 -> 0.034 ms, session 44); asked together and read where they lie, 0.034 -> 0.004 ms, and bwd 2/4 1x32768
// 0.071 -> 0.004 (the cells -13.9% and -16.5%: bench/results/gdn-h100-starts-read-where-they-lie-ab.md).
template <class E, int K, bool kReverse>
__global__ void __launch_bounds__(SegmentStartsSmem<E, K>::kThreads) segment_starts_kernel(Params p) {
  using L = SegmentStartsSmem<E, K>;
  extern __shared__ __align__(16) char smem[];
  auto rows_tile = [&](int s) { return typename L::RowsTile{smem_at<E>(smem, s % 2 * L::RowsTile::kBytes)}; };
  auto slot = [&](int s) { return L::slots_at + s % L::kSlots * L::slot_bytes; };
  auto map_tile = [&](int s) { return typename L::MapTile{smem_at<E>(smem, slot(s))}; };
  auto end_tile = [&](int s) { return typename L::EndTile{smem_at<float>(smem, slot(s) + L::MapTile::kBytes)}; };
  const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * L::kRows;
  const int tid = threadIdx.x, n0 = 16 * (tid / 32);
  const int ends = p.segments - 1;
  auto end_rows = [&](int s) {
    return segment_rows<float>(p.segment_ends[kReverse], p, n, s, ends, hv, p.V) + v0 * K;
  };
  bool walked_whole = false;  // some run of this thread's, from the second, did not warm up
  for (int s = 1 + tid; s < ends; s += L::kThreads) {
    walked_whole = walked_whole || warmup_chunks<kReverse>(p, run_chunks<kReverse>(p, n, s), hv) == 0;
  }
  if (!__syncthreads_or(walked_whole)) return;
  auto load_step = [&](int s) {  // M_s and the CTA's rows of R_s
    if (s < ends) {
      load_rows_async<L::kThreads>(map_tile(s), segment_rows<const E>(p.segment_maps, p, n, s, ends, hv, K), K, K, tid);
      load_rows_async<L::kThreads>(end_tile(s), end_rows(s), K, L::kRows, tid);
    }
    cp_async_commit();
  };

  for (int s = 1; s < L::kSlots; ++s) load_step(s);
  {
    float start[1][2][4];  // start_1 = R_0, which the pass reads where step 1 left it
    load_pairs(start, end_rows(0) + n0, K, L::kRows);
    store_accumulator(start, plain(rows_tile(1)), 0, n0);
  }
  cp_async_wait<L::kSlots - 2>();
  __syncthreads();
#pragma unroll 1
  for (int s = 1; s < ends; ++s) {
    std::uint32_t a[K / 16][4], b[K / 16][4];
#pragma unroll
    for (int kb = 0; kb < K / 16; ++kb) {
      load_b16(b[kb], plain(map_tile(s)), 16 * kb, n0);
      load_a16(a[kb], plain(rows_tile(s)), 0, 16 * kb);
    }
    float start[1][2][4];
    load_pairs(start, &end_tile(s)(0, n0), L::EndTile::kLd, L::kRows);
#pragma unroll
    for (int kb = 0; kb < K / 16; ++kb) {
      mma_16816<E>(start[0][0], a[kb], b[kb][0], b[kb][1]);
      mma_16816<E>(start[0][1], a[kb], b[kb][2], b[kb][3]);
    }
    load_step(s + L::kSlots - 1);  // into the slot step s - 1 read, which every warp left at the last barrier
    store_pairs(start, segment_rows<float>(p.segment_starts[kReverse], p, n, s + 1, p.segments, hv, p.V) + v0 * K + n0,
                K);
    store_accumulator(start, plain(rows_tile(s + 1)), 0, n0);
    cp_async_wait<L::kSlots - 2>();  // this thread's copies of M_(s+1) and R_(s+1)
    __syncthreads();                 // everyone's, and the new rows
  }
}

// Records one run of kernels: the forward or (kReverse) backward kernel of pass kPass over `runs` runs of
// each sequence and `row_blocks` blocks of 64 rows, kGroups blocks per CTA, after kernel `after`.
template <class E, int K, Pass kPass, bool kReverse, int kGroups>
int launch_run(const Params& p, const char* name, int runs, int row_blocks, KernelSequence& kernels,
               int after = KernelSequence::kPrevious) {
  const dim3 grid(p.sequences * runs, p.HV, row_blocks / kGroups), block(kWarpgroup * kGroups);
  constexpr int kBytes = HopperPass<E, K, kPass, kReverse, kGroups>::L::bytes;
  if constexpr (kReverse) {
    return launch<state_backward_hopper_kernel<E, K, kPass, kGroups>>(name, grid, block, kBytes, kernels, after);
  } else {
    return launch<state_forward_hopper_kernel<E, K, kPass, kGroups>>(name, grid, block, kBytes, kernels, after);
  }
}

// f.template operator()<kGroups>() with the warpgroups per CTA that the plan chose (two only where K = 128).
template <int K, class F>
void with_warpgroups(const Params& p, F&& f) {
  if constexpr (K == 128) {
    if (p.warpgroups == 2) return f.template operator()<2>();
  }
  f.template operator()<1>();
}

// Steps 1 and 2 of a segmented pass, the true state (or its gradient) at each segment's start, where the call
// has segments and the pass is not a recompute whose starts the forward saved (p.recompute_starts_saved): the segment
// ends pass, with M's rows for more than two segments (two need no M) in its launch or,
// where p.maps_apart, beside it in one of their own, then segment_starts_kernel after both.
template <class E, int K, bool kReverse, int kGroups>
void launch_segment_starts(const Params& p, const char* ends_name, KernelSequence& kernels) {
  if (p.segments < 2 || (!kReverse && p.recompute_starts_saved)) return;
  const bool maps = p.segments > 2;
  const int before = kernels.last();
  const int ends = launch_run<E, K, Pass::segment_ends, kReverse, kGroups>(
      p, ends_name, p.segments - 1, (p.V + (maps && !p.maps_apart ? K : 0)) / kColumns, kernels);
  if (!maps) return;
  if (p.maps_apart) {
    constexpr const char* kMapsName =
        kReverse ? "gdn state_backward_hopper_kernel (segment maps)" : "gdn state_forward_hopper_kernel (segment maps)";
    launch_run<E, K, Pass::segment_maps, kReverse, kGroups>(p, kMapsName, p.segments - 1, K / kColumns, kernels,
                                                             before);
  }
  using Starts = SegmentStartsSmem<E, K>;
  const int starts = launch<segment_starts_kernel<E, K, kReverse>>("gdn segment_starts_kernel",
                                                         dim3(p.sequences, p.HV, p.V / Starts::kRows),
                                                         dim3(Starts::kThreads), Starts::bytes, kernels);
  if (p.maps_apart) kernels.join(starts, ends);  // it follows the maps' launch
}

// A pass of the forward or (kReverse) backward kernel with the warpgroups per CTA that the plan chose: steps 1 and 2
// first when the call has segments.
template <class E, int K, Pass kPass, bool kReverse>
void launch_pass(const Params& p, const char* name, const char* ends_name, KernelSequence& kernels) {
  with_warpgroups<K>(p, [&]<int kGroups>() {
    launch_segment_starts<E, K, kReverse, kGroups>(p, ends_name, kernels);
    launch_run<E, K, kPass, kReverse, kGroups>(p, name, p.segments, p.V / kColumns, kernels);
  });
}

}  // namespace

bool wgmma_device_ready() {
  static DeviceMemo known{};
  return once_per_device(known, [] {
    cudaFuncAttributes attributes{};
    cuda_check(cudaFuncGetAttributes(&attributes, state_forward_hopper_kernel<__nv_bfloat16, 128, Pass::forward, 1>),
               "cudaFuncGetAttributes (Hopper state pass)");
    return attributes.binaryVersion == 90;
  });
}

bool launch_state_forward_hopper(const Params& p, DType io, bool recompute, KernelSequence& kernels) {
  if (!p.wgmma) return false;
  dispatch(io, p.K, [&]<class E, int K>() {
    if constexpr (sizeof(E) == 2 && K <= 128) {
      constexpr const char* kEnds = "gdn state_forward_hopper_kernel (segment ends)";
      if (recompute) {
        launch_pass<E, K, Pass::recompute, false>(p, "gdn state_forward_hopper_kernel (recompute)", kEnds, kernels);
      } else {
        launch_pass<E, K, Pass::forward, false>(p, "gdn state_forward_hopper_kernel", kEnds, kernels);
      }
    }
  });
  return true;
}

bool launch_state_passes_paired_hopper(const Params& p, DType io, KernelSequence& kernels) {
  if (!p.paired) return false;  // the plan pairs the passes only where the wgmma ones run
  dispatch(io, p.K, [&]<class E, int K>() {
    if constexpr (sizeof(E) == 2 && K <= 128) {
      using Recompute = HopperPass<E, K, Pass::recompute, false, 1>;
      using Backward = HopperPass<E, K, Pass::backward, true, 1>;
      launch<state_passes_paired_hopper_kernel<E, K>>(
          "gdn state_passes_paired_hopper_kernel", dim3(p.sequences, p.HV, 2 * p.V / kColumns), dim3(kWarpgroup),
          std::max(Recompute::L::bytes, Backward::L::bytes), kernels);
    }
  });
  return true;
}

constexpr const char* kBackwardEnds = "gdn state_backward_hopper_kernel (segment ends)";

bool launch_state_backward_hopper(const Params& p, DType io, KernelSequence& kernels) {
  if (!p.wgmma) return false;
  dispatch(io, p.K, [&]<class E, int K>() {
    if constexpr (sizeof(E) == 2 && K <= 128) {
      launch_pass<E, K, Pass::backward, true>(p, "gdn state_backward_hopper_kernel", kBackwardEnds, kernels);
    }
  });
  return true;
}

void launch_backward_segment_starts(const Params& p, DType io, KernelSequence& kernels) {
  if (!p.wgmma) return;
  dispatch(io, p.K, [&]<class E, int K>() {
    if constexpr (sizeof(E) == 2 && K <= 128) {
      with_warpgroups<K>(p, [&]<int kGroups>() {
        launch_segment_starts<E, K, true, kGroups>(p, kBackwardEnds, kernels);
      });
    }
  });
}

}  // namespace deltatrain::gdn::cuda
