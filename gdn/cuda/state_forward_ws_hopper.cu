// The forward state pass with its output on a warpgroup of its own (sm_90a): K = 128, each sequence in one run (plan.h's
// forward_warp_specialised). state_hopper.cu's forward CTA forms, per chunk, Delta, the state's update and the output in
// the same warpgroups, and reads P from prepare. Here, per (sequence, value head, 64 G columns of V), G + 1 warpgroups
// share the chunk (FlashQLA's fused forward splits its CTA the same way), G = 2 or 1 as the plan's warpgroups:
//   chain (warpgroups 0..G-1, 64 columns of V each, S^T in float32 registers as in state_hopper.cu):
//     Delta^T = V^T (T diag(beta))^T - S^T W^T,   S^T = e^gamma_last S^T + (Delta^T diag(e^(gamma_last - gamma))) K;
//     with G = 2 each warpgroup also forms 64 keys of the next chunk's W = T diag(beta e^gamma) K behind the update
//     (from T diag(beta) and the gates), with G = 1 (all 128 keys would spill) it reads prepare's W; -S^T as it
//     enters the chunk and Delta^T, rounded to 16 bits, go to shared memory for
//   output (warpgroup G): P = scale tril(Q K^T) * Gamma in registers (prepare forms none), then
//     O = scale diag(e^gamma) Q S + P Delta, token-major, with Q, S^T and Delta^T read from shared memory. Where a
//     saved buffer keeps them for the backward (kSaved), it also writes P and, from the two tiles, the state entering
//     each chunk and Delta, so that the backward runs neither prepare nor its recompute pass. Each is the bits the
//     backward would form itself: P by prepare's own products (mma.sync, the same k order) and rounding, S and Delta
//     by the recompute pass's steps (the chain's are the same instructions). The states and Delta are written where
//     the buffer has room for them (plan.h's forward_keeps_states).
// The chain's step keeps only its own products (the chain itself and W's), and prepare loses Q K^T and P's stores (and
// with G = 2 T diag(beta e^gamma)'s). The roles meet at named barriers, per chunk: the state tile full and free, the
// Delta tile full and free; the output warpgroup runs up to a step behind the chain and holds it up only where it
// falls further behind. Each role copies its own chunk tiles (cp.async, two stages; the output's K tile one, free once P
// is formed) behind a barrier of its own. With G = 2, setmaxnreg moves registers from the output warpgroup (P's operand
// and a 64-column half of O) to the chain's; with G = 1 every thread may take 255.
#include <cuda_runtime_api.h>

#include "dispatch.cuh"
#include "launch.h"
#include "plan.h"
#include "state_hopper.cuh"

namespace deltatrain::gdn::cuda {
namespace {

constexpr int kKeys = 128;  // K

// The CTA of a chain of G warpgroups and the output warpgroup after them.
template <int G>
struct WsShape {
  static constexpr int kBlockColumns = G * kWgmmaColumns;  // of V
  static constexpr int kChainThreads = G * kWarpgroup;
  static constexpr int kThreads = kChainThreads + kWarpgroup;
  static constexpr bool kFormsW = wgmma_pass_forms_w(kKeys, G);
  // G = 2: registers per thread after the hand-over. The launch gives each thread 168 (65536 / 384, in steps of 8),
  // and a raise waits until lowers have given back what it takes, so 2 x chain + output <= 3 x 168. At 200 a chain
  // thread's products serialise (ptxas C7512); at 88 the output's copy addresses spill, loop-invariant (~10 L1 loads
  // a chunk), where it holds one 64-column half of O (32) and P's operand (16).
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static constexpr int kChainRegisters = 208;
  static constexpr int kOutputRegisters = 88;
  static_assert(G == 1 || G * kChainRegisters + kOutputRegisters <= (G + 1) * kLaunchRegisters);
};

// Named barriers (0 is __syncthreads, which this kernel does not use once the roles part).
enum Barrier : int {
  kChainStage = 1,   // the chain's warps: a stage's tiles landed, or read
  kOutputStage = 2,  // the output warpgroup's: the same for its tiles
  kStateFull = 3,    // the chain stored -S^T entering the chunk
  kStateFree = 4,    // the output warpgroup's products have read it
  kDeltaFull = 5,
  kDeltaFree = 6,
};

// Offsets from a 1024-byte aligned base (the swizzled tiles' alignment). Chain stage: W (formed there a chunk ahead, or
// prepare's), K, T diag(beta), the CTA's columns of V and the gates e^gamma, e^(gamma_last - gamma). Output stage: Q,
// gamma and the gates. Then the output's K tile, -S^T ([column of V][key]) and Delta^T ([column of V][token]), each
// the B operand of one of O's products (K-major).
template <class E, int G>
struct WsSmem {
  static constexpr int kBlockColumns = WsShape<G>::kBlockColumns;
  using KeyTile = SwizzledTile<E, kChunk, kKeys>;  // [token][key]
  using ChunkTile = SwizzledTile<E, kChunk, kChunk>;
  using ColumnTile = Tile<E, kChunk, kBlockColumns>;
  using StateTile = SwizzledTile<E, kBlockColumns, kKeys>;
  using DeltaTile = SwizzledTile<E, kBlockColumns, kChunk>;
  static constexpr int chain_k = KeyTile::kBytes;
  static constexpr int chain_t_beta = 2 * KeyTile::kBytes;
  static constexpr int chain_columns = chain_t_beta + ChunkTile::kBytes;
  static constexpr int chain_gates = chain_columns + ColumnTile::kBytes;
  static constexpr int chain_stage_bytes = round_up(chain_gates + 2 * kChunk * 4, 1024);
  static constexpr int output_gamma = KeyTile::kBytes;
  static constexpr int output_gates = output_gamma + kChunk * 8;
  static constexpr int output_stage_bytes = round_up(output_gates + 2 * kChunk * 4, 1024);
  static constexpr int stages = 2;
  static constexpr int outputs_at = stages * chain_stage_bytes;
  static constexpr int output_k_at = outputs_at + stages * output_stage_bytes;
  static constexpr int state_at = output_k_at + KeyTile::kBytes;
  static constexpr int delta_at = state_at + StateTile::kBytes;
  static constexpr int bytes = delta_at + DeltaTile::kBytes + 1024;  // + the alignment
  static_assert(bytes <= kSmemLimit);
};

// What both roles share: the CTA's place and shared memory.
template <class E, int G>
struct WsCta {
  using L = WsSmem<E, G>;
  using Shape = WsShape<G>;
  char* smem;
  const Params& p;
  int n, hv, h, column0;
  SequenceChunks chunks;

  __device__ WsCta(char* smem_raw, const Params& params)
      : p(params), n(blockIdx.x), hv(blockIdx.y), h(blockIdx.y / params.group),
        column0(blockIdx.z * Shape::kBlockColumns),
        chunks(params, blockIdx.x) {
    const int raw = static_cast<int>(smem_address(smem_raw));
    smem = smem_raw + (round_up(raw, 1024) - raw);
  }
  template <int ROWS, int COLS>
  __device__ AddressableSwizzledTile<E, ROWS, COLS> swizzled(int at) const {
    return swizzled_tile<E, ROWS, COLS>(smem + at);
  }
  __device__ auto state_tile() const { return swizzled<Shape::kBlockColumns, kKeys>(L::state_at); }
  __device__ auto delta_tile() const { return swizzled<Shape::kBlockColumns, kChunk>(L::delta_at); }
};

// Warpgroups 0..G-1: the state's chain, thread `tid` of 128 G; warp w holds rows 16 w.. of the CTA's S^T.
template <class E, int G>
struct Chain : WsCta<E, G> {
  using L = WsSmem<E, G>;
  using Shape = WsShape<G>;
  static constexpr int kChainThreads = Shape::kChainThreads, kThreads = Shape::kThreads;
  using WsCta<E, G>::smem, WsCta<E, G>::p, WsCta<E, G>::hv, WsCta<E, G>::h, WsCta<E, G>::chunks;
  int tid, m0;
  StateRows at;

  __device__ Chain(char* smem_raw, const Params& params)
      : WsCta<E, G>(smem_raw, params), tid(threadIdx.x), m0(16 * (threadIdx.x / 32)), at{this->column0 + m0, 0} {}

  __device__ int stage_at(int stage) const { return stage * L::chain_stage_bytes; }
  __device__ auto w_tile(int stage) const { return this->template swizzled<kChunk, kKeys>(stage_at(stage)); }
  __device__ auto k_tile(int stage) const { return this->template swizzled<kChunk, kKeys>(stage_at(stage) + L::chain_k); }
  __device__ auto t_beta_tile(int stage) const {
    return this->template swizzled<kChunk, kChunk>(stage_at(stage) + L::chain_t_beta);
  }
  __device__ typename L::ColumnTile column_tile(int stage) const {
    return {smem_at<E>(smem, stage_at(stage) + L::chain_columns)};
  }
  __device__ float* gate_in(int stage) const { return smem_at<float>(smem, stage_at(stage) + L::chain_gates); }
  __device__ int w_key0() const { return tid / kWarpgroup * kWgmmaColumns; }
  __device__ void sync() const { named_barrier_sync(kChainStage, kChainThreads); }

  __device__ void issue(int j, int stage) const {
    const ChunkInfo info = chunks[j];
    if constexpr (!Shape::kFormsW) {
      load_chunk_rows<kChainThreads>(w_tile(stage), static_cast<const E*>(p.w), p.HV, hv, kKeys, 0, info, tid);
    }
    load_chunk_rows<kChainThreads>(k_tile(stage), keys<E>(p), p.H, h, kKeys, 0, info, tid);
    load_chunk_rows<kChainThreads>(t_beta_tile(stage), static_cast<const E*>(p.t_beta), p.HV, hv, kChunk, 0, info, tid);
    load_chunk_rows<kChainThreads>(column_tile(stage), p.v, p.HV, hv, p.V, this->column0, info, tid);
    load_gates_async(p, gate_in(stage), gate_in(stage) + kChunk, hv, info, tid);
  }
  // W of the chunk in `stage`, this warpgroup's 64 key columns, into the stage's W tile: issued, then stored once
  // waited for (the next chunk's first products read it after the walk's fence and barrier).
  __device__ void issue_w(int stage, float (&w)[1][8][4]) const {
    issue_w_from_t_beta(w[0], t_beta_tile(stage), gate_in(stage), k_tile(stage), w_key0(), 16 * (tid / 32 % 4));
    wgmma_commit();
  }
  __device__ void store_w(int stage, float (&w)[1][8][4]) const {
    hold(w[0]);
    store_accumulator(w, plain(w_tile(stage)), 16 * (tid / 32 % 4), w_key0());
  }

  __device__ void run() const {
    float state[1][kKeys / 8][4];
    load_state(state, p.h0, p, this->n, hv, at);
    const int count = chunks.count;
    for (int s = 0; s < L::stages; ++s) {
      if (s < count) issue(s, s);
      cp_async_commit();
    }
#pragma unroll 1
    for (int j = 0; j < count; ++j) {
      const int stage = j % L::stages, next_stage = (j + 1) % L::stages;
      // Where the chain forms W, chunk j's copies landed and its W was stored and fenced before the previous step's last
      // barrier; the first chunk waits for its copies here and forms its W, which nothing formed a step ahead.
      if (j == 0 || !Shape::kFormsW) {
        cp_async_wait<L::stages - 1>();
        fence_for_wgmma();
        sync();
      }
      if (Shape::kFormsW && j == 0) {
        float w[1][8][4];
        issue_w(stage, w);
        wgmma_wait();
        store_w(stage, w);
        fence_for_wgmma();
        sync();
      }
      const float *gates_in = gate_in(stage), *gates_out = gates_in + kChunk;

      WarpOperand<E, kKeys> neg_state(nullptr);  // -S^T, so that the W product lands on U^T
      neg_state.set(state, -1.f);
      WarpOperand<E, kChunk> values(nullptr);  // V^T, this warp's columns
#pragma unroll
      for (int kb = 0; kb < kChunk / 16; ++kb) load_a16(values.frag[kb], transposed(column_tile(stage)), m0, 16 * kb);
      float delta[1][kChunk / 8][4];
      wgmma_fence();
      issue_delta(delta[0], values, true, neg_state, t_beta_tile(stage), w_tile(stage));
      wgmma_commit();
      // -S^T for the output's Q S while Delta's products run, rounded again from the state's registers (the same bits
      // as neg_state's): a wgmma's A registers must not be touched before the wait that covers it.
      named_barrier_sync(kStateFree, kThreads);
      store_accumulator(state, plain(this->state_tile()), m0, 0, [](float x, int, int) { return -x; });
      fence_for_wgmma();
      named_barrier_arrive(kStateFull, kThreads);
      wgmma_wait();
      hold(delta[0]);

      const float decay = gates_in[kChunk - 1];
      for_each(state, 0, 0, [&](int, int, float& x) { x *= decay; });
      WarpOperand<E, kChunk> update(nullptr), delta_operand(nullptr);
      update.set(delta, 1.f, gates_out);
      wgmma_fence();
      update_state<E, kKeys>(state, update, k_tile(stage));
      wgmma_commit();
      // Delta^T for the output's P Delta while the update runs.
      delta_operand.set(delta, 1.f);
      named_barrier_sync(kDeltaFree, kThreads);
      delta_operand.store(plain(this->delta_tile()), m0);
      fence_for_wgmma();
      named_barrier_arrive(kDeltaFull, kThreads);
      // The next chunk's W, queued behind the update: it needs the next chunk's copies, not the state.
      float next_w[1][8][4];
      const bool next = Shape::kFormsW && j + 1 < count;
      if (next) {
        cp_async_wait<0>();
        fence_for_wgmma();
        sync();
        issue_w(next_stage, next_w);
      }
      wgmma_wait();
      hold(state[0]);
      if (next) {
        store_w(next_stage, next_w);
        fence_for_wgmma();  // for the next step's products
      }
      sync();  // the stage is read, and the next W stored
      if (j + L::stages < count) issue(j + L::stages, stage);
      cp_async_commit();
    }
    if (p.ht != nullptr) store_state(state, p.ht, p, this->n, hv, at);
  }
};

// What the pass writes into the caller's saved buffer besides its outputs (a template argument, so that each kernel
// carries only its own stores): nothing, P (p.p), or P, the states and Delta (p.p, p.states, p.delta), as the buffer's
// layout holds them (layout.cpp's plan_saved: P wherever there is a buffer, the others where forward_keeps_states).
enum class Saved { nothing, p, p_and_states };

// Warpgroup G: P and O, thread `tid` of 128; warp w holds O's tokens 16 w...
template <class E, int G, Saved kSaved>
struct Output : WsCta<E, G> {
  using L = WsSmem<E, G>;
  using Shape = WsShape<G>;
  static constexpr int kBlockColumns = Shape::kBlockColumns;
  using WsCta<E, G>::smem, WsCta<E, G>::p, WsCta<E, G>::hv, WsCta<E, G>::h, WsCta<E, G>::chunks;
  int tid, m0;

  __device__ Output(char* smem_raw, const Params& params)
      : WsCta<E, G>(smem_raw, params), tid(threadIdx.x - Shape::kChainThreads), m0(16 * (tid / 32)) {}

  __device__ int stage_at(int stage) const { return L::outputs_at + stage * L::output_stage_bytes; }
  __device__ auto q_tile(int stage) const { return this->template swizzled<kChunk, kKeys>(stage_at(stage)); }
  __device__ auto k_tile() const { return this->template swizzled<kChunk, kKeys>(L::output_k_at); }
  __device__ float2* gamma(int stage) const { return smem_at<float2>(smem, stage_at(stage) + L::output_gamma); }
  __device__ float* gate_in(int stage) const { return smem_at<float>(smem, stage_at(stage) + L::output_gates); }
  __device__ void sync() const { named_barrier_sync(kOutputStage, kWarpgroup); }

  __device__ void issue(int j, int stage) const {
    const ChunkInfo info = chunks[j];
    load_chunk_rows<kWarpgroup>(q_tile(stage), queries<E>(p), p.H, h, kKeys, 0, info, tid);
    load_gamma_async(p, gamma(stage), hv, info, tid);
    load_gates_async(p, gate_in(stage), gate_in(stage) + kChunk, hv, info, tid);
  }
  __device__ void issue_keys(int j) const {
    load_chunk_rows<kWarpgroup>(k_tile(), keys<E>(p), p.H, h, kKeys, 0, chunks[j], tid);
  }

  // The state entering chunk j as the CTA's rows of its block of the per-chunk [chunks, HV, V, K] states, from the
  // tile of -S^T (negating a 16-bit float, its sign bit, is exact), in 16-byte pieces of rows.
  __device__ void save_state(int j) const {
    constexpr std::uint32_t kSignBits = 0x80008000u;  // of both halves of a 32-bit word
    constexpr int kVectorsPerRow = kKeys / 8;
    const auto tile = this->state_tile();
    E* rows = static_cast<E*>(p.states) +
              ((static_cast<std::int64_t>(chunks.first + j) * p.HV + hv) * p.V + this->column0) * kKeys;
#pragma unroll 4
    for (int i = tid; i < kBlockColumns * kVectorsPerRow; i += kWarpgroup) {
      const int r = i / kVectorsPerRow, c = i % kVectorsPerRow * 8;
      uint4 x = *reinterpret_cast<const uint4*>(&tile(r, c));
      x = {x.x ^ kSignBits, x.y ^ kSignBits, x.z ^ kSignBits, x.w ^ kSignBits};
      *reinterpret_cast<uint4*>(rows + r * kKeys + c) = x;
    }
  }
  // Delta, token-major [tokens, HV, V], the warp's 16 tokens: the Delta^T tile read transposed by ldmatrix into A
  // fragments (rows g and g + 8, columns 2t, 2t + 1 and 8 more), a pair of columns a store.
  __device__ void save_delta(const ChunkInfo& info) const {
    const auto tile = this->delta_tile();
    const std::int64_t token_stride = static_cast<std::int64_t>(p.HV) * p.V;
    E* rows = static_cast<E*>(p.delta) + (static_cast<std::int64_t>(info.start + m0) * p.HV + hv) * p.V + this->column0;
    const int g = (tid & 31) >> 2, t = tid & 3;
#pragma unroll
    for (int block = 0; block < kBlockColumns / 16; ++block) {
      std::uint32_t a[4];
      load_a16(a, transposed(tile), m0, 16 * block);
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int r = g + 8 * (b & 1), c = 16 * block + 8 * (b >> 1) + 2 * t;
        if (m0 + r < info.length) *reinterpret_cast<std::uint32_t*>(rows + r * token_stride + c) = a[b];
      }
    }
  }

  __device__ void run() const {
    const int count = chunks.count;
    if (count == 0) return;  // an empty sequence: the chain meets none of the barriers either
    const std::int64_t token_stride = static_cast<std::int64_t>(p.HV) * p.V;
    constexpr int kThreads = Shape::kThreads;
    constexpr bool kSavesP = kSaved != Saved::nothing, kSavesStates = kSaved == Saved::p_and_states;
    // The first chunk's tiles are free.
    named_barrier_arrive(kStateFree, kThreads);
    named_barrier_arrive(kDeltaFree, kThreads);
    // Copy groups, in order: Q_0 and K_0, Q_1, then per chunk j K_(j+1) once P_j is formed and Q_(j+2) once O_j is;
    // so waiting for all but the newest leaves chunk j's Q and K landed at its start.
    issue(0, 0);
    issue_keys(0);
    cp_async_commit();
    if (1 < count) issue(1, 1);
    cp_async_commit();
#pragma unroll 1
    for (int j = 0; j < count; ++j) {
      const int stage = j % L::stages;
      const ChunkInfo info = chunks[j];
      cp_async_wait<1>();
      fence_for_wgmma();
      sync();

      // P = scale tril(Q K^T) * Gamma as prepare forms it (the same products, k in order, and the same rounding), as the
      // A operand of O's P Delta.
      float qk[1][kChunk / 8][4];
      zero(qk);
      warp_mma(qk, plain(q_tile(stage)), m0, transposed(k_tile()), 0, 0, kKeys);
      sync();  // every warp has read K
      if (j + 1 < count) issue_keys(j + 1);
      cp_async_commit();
      for_each_decay<1, kChunk / 8>(gamma(stage), m0, 0, [&](int r, int c, float decay, FragmentIndex at) {
        at(qk) = r >= c ? p.scale * at(qk) * decay : 0.f;
      });
      if (kSavesP && this->column0 == 0) {  // P is per head: where a head has more CTAs, the first writes it
        const std::int64_t chunk_stride = static_cast<std::int64_t>(p.HV) * kChunk;
        store_pairs(qk, static_cast<E*>(p.p) + (static_cast<std::int64_t>(info.start + m0) * p.HV + hv) * kChunk,
                    chunk_stride, info.length - m0);
      }
      WarpOperand<E, kChunk> p_operand(nullptr);
      p_operand.set(qk, 1.f);

      // O in G pieces of 64 columns: -scale e^gamma (Q (-S)) + P Delta.
      const float* gates_in = gate_in(stage);
      E* o_rows = static_cast<E*>(p.o) + (static_cast<std::int64_t>(info.start + m0) * p.HV + hv) * p.V + this->column0;
      named_barrier_sync(kStateFull, kThreads);
#pragma unroll
      for (int half = 0; half < G; ++half) {
        float o[1][8][4];
        wgmma_fence();
        wgmma_ss_product<E, false, false, kKeys / 16>(
            o[0], [&](int k0) { return k_major(q_tile(stage), k0); },
            [&](int k0) { return k_major(this->state_tile(), k0, kWgmmaColumns * half); }, false);
        wgmma_commit();
        if (kSavesStates && half == 0) save_state(j);  // while the products read the same tile
        wgmma_wait();
        hold(o[0]);
        if (half == G - 1 && j + 1 < count) named_barrier_arrive(kStateFree, kThreads);
        for_each(o, m0, 0, [&](int r, int, float& x) { x *= -p.scale * gates_in[r]; });
        if (half == 0) named_barrier_sync(kDeltaFull, kThreads);
        wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < kChunk / 16; ++kb) {
          wgmma_64x64x16<E, false>(o[0], p_operand.frag[kb],
                                   k_major(this->delta_tile(), 16 * kb, kWgmmaColumns * half));
        }
        wgmma_commit();
        if (kSavesStates && half == 0) save_delta(info);
        wgmma_wait();
        hold(o[0]);
        if (half == G - 1 && j + 1 < count) named_barrier_arrive(kDeltaFree, kThreads);
        store_pairs(o, o_rows + kWgmmaColumns * half, token_stride, info.length - m0);
      }
      sync();  // every warp's products have read the stage's Q, and its gates
      if (j + L::stages < count) issue(j + L::stages, stage);
      cp_async_commit();
    }
  }
};

template <class E, int G, Saved kSaved>
__global__ void __launch_bounds__(WsShape<G>::kThreads, 1) state_forward_ws_hopper_kernel(Params p) {
#ifdef DELTATRAIN_WGMMA
  using Shape = WsShape<G>;
  extern __shared__ __align__(16) char smem_raw[];
  if (threadIdx.x < Shape::kChainThreads) {
    if constexpr (G == 2) raise_registers<Shape::kChainRegisters>();
    Chain<E, G>(smem_raw, p).run();
  } else {
    if constexpr (G == 2) lower_registers<Shape::kOutputRegisters>();
    Output<E, G, kSaved>(smem_raw, p).run();
  }
#endif
}

}  // namespace

bool launch_state_forward_ws_hopper(const Params& p, DType io, KernelSequence& kernels) {
  if (!p.warp_specialised) return false;  // the plan chooses it only for 16-bit inputs, K = 128, no segments
  dispatch(io, p.K, [&]<class E, int K>() {
    if constexpr (sizeof(E) == 2 && K == kKeys) {
      auto record = [&]<int G, Saved kSaved>() {
        using Shape = WsShape<G>;
        launch<state_forward_ws_hopper_kernel<E, G, kSaved>>(
            "gdn state_forward_ws_hopper_kernel", dim3(p.sequences, p.HV, p.V / Shape::kBlockColumns),
            dim3(Shape::kThreads), WsSmem<E, G>::bytes, kernels);
      };
      // The saved buffer's regions as its layout set them: P with any buffer, the states and Delta beside it or not.
      auto with_saved = [&]<int G>() {
        if (p.p == nullptr) return record.template operator()<G, Saved::nothing>();
        if (p.states == nullptr) return record.template operator()<G, Saved::p>();
        record.template operator()<G, Saved::p_and_states>();
      };
      p.warpgroups == 2 ? with_saved.template operator()<2>() : with_saved.template operator()<1>();
    }
  });
  return true;
}

}  // namespace deltatrain::gdn::cuda
