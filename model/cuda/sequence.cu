// Ops along packed sequences: the causal depthwise convolution with SiLU and partial NeoX RoPE, and their decode
// forms (the conv over a cached history, RoPE at given positions). Rows find their sequence in cu_seqlens on the
// device (a binary search, or a cursor along a strip of rows), so launches need no host work.
#include <array>
#include <numeric>
#include <utility>
#include <string>

#include "common.cuh"
#include "deltatrain/core/error.h"
#include "gdn/cuda/mma.cuh"

namespace deltatrain::model::cuda {
namespace {

// The causal conv over a strip of rows: each thread takes N consecutive channels (one access of 2N bytes per
// row) down a strip of rows, keeping the channels' taps and the last W inputs in registers, so each input is
// read from memory once per strip and no row searches for its sequence (a cursor follows the strip's rows).
// The strips are latency-bound (ncu: ~8 cycles between a warp's instructions, half of them waiting on loads), so
// occupancy rules: the forward takes 4 channels a thread, the backward, which also keeps W rows of dpre and W
// weight-gradient sums per channel, 2 (4 took 142 registers: 12 warps a SM), and fetches its rows ahead through
// shared memory (StagedRowPair) rather than registers. The decode step, one row a thread, takes 8.
constexpr int kConvThreads = 128;
constexpr int kForwardChannels = 4, kBackwardChannels = 2, kStepChannels = 8;

// A thread's channels [c0, c0 + N) of a matrix in column parts, which the launch keeps inside one part: that part,
// and c0 as its column there.
struct PartColumns {
  Matrix m;
  Index c0;
};
// (Constant indices into the parts: a loop indexing them by a variable put the kernels' parameters in local memory.)
__device__ PartColumns locate(const MatrixParts& parts, Index c0) {
  Matrix m = parts.part[0];
#pragma unroll
  for (int p = 1; p < MatrixParts::kMaxParts; ++p) {
    if (p < parts.count && c0 >= m.cols) {
      c0 -= m.cols;
      m = parts.part[p];
    }
  }
  return {m, c0};
}

// taps[j][k] = weight[c0 + k, j] ([C, W]); zeros past the last channel. A dense weight's N x W taps of a thread are
// one contiguous run: 16-byte loads where it divides into them (W = 4: 8 channels in four loads, where 32 scalar
// loads, 64 bytes apart across a warp, kept the decode step's load units busy: 9.5 us for 64 rows on the H200).
template <int W, int N>
__device__ void load_taps(Matrix weight, Index c0, float (&taps)[W][N]) {
  constexpr int kBytes = N * W * static_cast<int>(sizeof(bf16));
  if constexpr (kBytes % 16 == 0) {
    const bf16* run = row_of<const bf16>(weight, c0);
    if (weight.ld == W && c0 + N <= weight.rows && reinterpret_cast<std::uintptr_t>(run) % 16 == 0) {
      unsigned words[kBytes / 4];  // two bfloat16 each, the first in the low half
#pragma unroll
      for (int i = 0; i < kBytes / 16; ++i) {
        const uint4 q = reinterpret_cast<const uint4*>(run)[i];
        words[4 * i] = q.x, words[4 * i + 1] = q.y, words[4 * i + 2] = q.z, words[4 * i + 3] = q.w;
      }
#pragma unroll
      for (int k = 0; k < N; ++k)
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const int e = k * W + j;  // a bfloat16's bits are a float's upper half
          taps[j][k] = __uint_as_float(e % 2 == 0 ? words[e / 2] << 16 : words[e / 2] & 0xffff0000u);
        }
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const bool inside = c0 + k < weight.rows;
#pragma unroll
    for (int j = 0; j < W; ++j) taps[j][k] = inside ? to_float(row_of<const bf16>(weight, c0 + k)[j]) : 0.f;
  }
}

// The packed sequence [start, end) holding row u, for rows visited in increasing order (u < the last end).
struct SequenceCursor {
  const std::int32_t* cu;
  int n;
  Index start, end;
  __device__ SequenceCursor(const Sequences& s, Index t)
      : cu(s.cu), n(sequence_of(s, t)), start(s.cu[n]), end(s.cu[n + 1]) {}
  __device__ void advance_to(Index u) {
    while (u >= end) {  // empty sequences are skipped
      ++n;
      start = cu[n];
      end = cu[n + 1];
    }
  }
};

// The next kPrefetchRows rows of a thread's channels, fetched ahead unconverted (RawBf16) so that that many
// loads travel at once (one row ahead left the conv kernels at half the memory bandwidth: too few bytes in
// flight at their occupancy). pop() hands over the oldest as floats and fetches the row kPrefetchRows on; rows
// at or past the matrix's end read as zeros. The row loops unroll by a multiple of kPrefetchRows, so the
// queue's shifts become register renames.
constexpr int kPrefetchRows = 4;

template <int N, bool V>
struct RowQueue {
  RawBf16<N> rows[kPrefetchRows];
  Matrix m;
  Index c0;

  __device__ RawBf16<N> fetch(Index u) const {
    return u < m.rows ? fetch_n<N, V>(row_of<const bf16>(m, u), c0, m.cols) : RawBf16<N>{};
  }
  // Rows first, first + 1, ... (those before `end`).
  __device__ RowQueue(Matrix matrix, Index column, Index first, Index end) : m(matrix), c0(column) {
#pragma unroll
    for (int j = 0; j < kPrefetchRows; ++j) rows[j] = fetch(first + j < end ? first + j : m.rows);
  }
  // The oldest row; `next` (the row kPrefetchRows after it, or one at or past m.rows for none) joins the queue.
  __device__ void pop(float (&v)[N], Index next) {
    unpack(rows[0], v);
#pragma unroll
    for (int j = 0; j + 1 < kPrefetchRows; ++j) rows[j] = rows[j + 1];
    rows[kPrefetchRows - 1] = fetch(next);
  }
};

// The backward's two matrices (dout and x, rows [first, end)) row by row from registers: RowQueue for each.
template <int N, bool V>
struct QueuedRowPair {
  RowQueue<N, V> dout, x;
  Index u, end;
  __device__ QueuedRowPair(PartColumns d, Matrix xm, Index c0, Index first, Index last)
      : dout(d.m, d.c0, first, last), x(xm, c0, first, last), u(first), end(last) {}
  __device__ void pop(float (&d)[N], float (&row)[N]) {
    const Index next = u + kPrefetchRows < end ? u + kPrefetchRows : x.m.rows;
    dout.pop(d, next);
    x.pop(row, next);
    ++u;
  }
};

// The same rows staged in shared memory by cp.async, where a thread's channels are one aligned 4-byte word: each
// thread copies its own column of a ring of kStageSlots chunks of kStageRows rows, kStageSlots - 1 chunks ahead of
// the row it walks, so ~2 x 16 rows of both matrices travel per thread without holding registers (a register queue
// 8 rows deep cost more warps than it hid: bench/NOTES.md, Model). A thread reads back only the words it copied, so
// no barrier is needed; rows at or past the matrix's end read as zeros, as RowQueue's do.
namespace tiles = gdn::cuda;  // cp.async
constexpr int kStageRows = 16, kStageSlots = 3;
constexpr int kStageWords = 2 * kStageSlots * kStageRows * kConvThreads;  // 48 KiB: both matrices' rings

struct StagedRowPair {
  static_assert(kBackwardChannels * sizeof(bf16) == sizeof(std::uint32_t), "a thread's channels are one word");
  static constexpr int kRing = kStageSlots * kStageRows;
  std::uint32_t* ring;  // [2][kRing][kConvThreads]: dout's rows, then x's
  const bf16 *dout, *x;
  Index dout_ld, x_ld, first, valid_end;
  int read = 0;

  __device__ StagedRowPair(std::uint32_t* shared, PartColumns d, Matrix xm, Index c0, Index first_row, Index last)
      : ring(shared + threadIdx.x),
        dout(static_cast<const bf16*>(d.m.data) + d.c0),
        x(static_cast<const bf16*>(xm.data) + c0),
        dout_ld(d.m.ld),
        x_ld(xm.ld),
        first(first_row),
        valid_end(min(last, xm.rows)) {
#pragma unroll
    for (int chunk = 0; chunk + 1 < kStageSlots; ++chunk) issue(chunk);
  }
  // The chunks issued past the walk's end must land before the block's shared memory can go to another block.
  __device__ ~StagedRowPair() { tiles::cp_async_wait<0>(); }
  // Copies chunk `chunk`'s rows into its slot (one commit group, empty past the rows).
  __device__ void issue(int chunk) {
    const int slot_row = chunk % kStageSlots * kStageRows;
#pragma unroll
    for (int i = 0; i < kStageRows; ++i) {
      const Index u = first + Index{chunk} * kStageRows + i;
      const bool valid = u < valid_end;
      const Index r = valid ? u : 0;
      tiles::cp_async_4(ring + (slot_row + i) * kConvThreads, dout + r * dout_ld, valid);
      tiles::cp_async_4(ring + (kRing + slot_row + i) * kConvThreads, x + r * x_ld, valid);
    }
    tiles::cp_async_commit();
  }
  __device__ void pop(float (&d)[2], float (&row)[2]) {
    if (read % kStageRows == 0) {
      tiles::cp_async_wait<kStageSlots - 2>();  // this chunk has landed; the next stays in flight
      issue(read / kStageRows + kStageSlots - 1);  // into the slot of the chunk just walked
    }
    const int slot_row = read % kRing;
    RawBf16<2> raw;
    *reinterpret_cast<std::uint32_t*>(&raw) = ring[slot_row * kConvThreads];
    unpack(raw, d);
    *reinterpret_cast<std::uint32_t*>(&raw) = ring[(kRing + slot_row) * kConvThreads];
    unpack(raw, row);
    ++read;
  }
};

// The unroll of the row loops: the window's W and the queue's kPrefetchRows shifts both become renames.
template <int W>
constexpr int kRowUnroll = std::lcm(W, kPrefetchRows);

// Moves a window of W rows one row on, `row` becoming its newest.
template <int W, int N>
__device__ void shift_in(float (&window)[W][N], const float (&row)[N]) {
#pragma unroll
  for (int j = 0; j + 1 < W; ++j)
#pragma unroll
    for (int k = 0; k < N; ++k) window[j][k] = window[j + 1][k];
#pragma unroll
  for (int k = 0; k < N; ++k) window[W - 1][k] = row[k];
}

// pre[u, c0 + k] from window[j] = row u - (W - 1) + j, over the taps at or after the sequence's first row
// `start` (every tap when not Masked: the window lies inside the sequence), oldest first (the order the CPU
// kernel sums them).
template <int W, int N, bool Masked = true>
__device__ float conv_pre(const float (&taps)[W][N], const float (&window)[W][N], int k, Index u, Index start) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < W; ++j)
    if (!Masked || u - (W - 1) + j >= start) sum += taps[j][k] * window[j][k];
  return sum;
}

// Whether rows [first, end) all lie in one packed sequence: then a strip needs no per-row sequence checks, and
// its rows' loop is one block of straight-line code that the compiler interleaves across the unrolled rows
// (with the checks, each row's dependent chain ran alone: the kernels were latency-bound).
__device__ bool in_one_sequence(const Sequences& s, Index first, Index end) {
  if (first < 0) return false;
  return end <= s.cu[sequence_of(s, first) + 1];
}

// The window before a strip's first row t0: rows t0 - W .. t0 - 1 (zeros before row 0).
template <int W, int N, bool V>
__device__ void load_history(float (&window)[W][N], Matrix x, Index t0, Index c0) {
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const Index r = t0 - W + j;
    if (r >= 0) {
      load_n<N, V>(row_of<const bf16>(x, r), c0, x.cols, window[j]);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) window[j][k] = 0.f;
    }
  }
}

// A strip of rows [t0, t1); OneSequence: rows t0 - (W - 1) .. t1 - 1 lie in one sequence.
template <int W, bool V, bool OneSequence>
__device__ void conv_forward_strip(PartColumns out, Matrix x, const float (&taps)[W][kForwardChannels], Sequences seq,
                                   Index c0, Index t0, Index t1) {
  constexpr int N = kForwardChannels;
  float window[W][N];
  load_history<W, N, V>(window, x, t0, c0);
  RowQueue<N, V> queue(x, c0, t0, t1);
  SequenceCursor sequence(seq, t0);
#pragma unroll kRowUnroll<W>
  for (Index u = t0; u < t1; ++u) {
    if constexpr (!OneSequence) sequence.advance_to(u);
    float row[N];
    queue.pop(row, u + kPrefetchRows < t1 ? u + kPrefetchRows : x.rows);
    shift_in<W, N>(window, row);
    float y[N];
#pragma unroll
    for (int k = 0; k < N; ++k) y[k] = silu(conv_pre<W, N, !OneSequence>(taps, window, k, u, sequence.start));
    store_n<N, V>(row_of<bf16>(out.m, u), out.c0, out.m.cols, y);
  }
}

template <int W, bool V>
__global__ void __launch_bounds__(kConvThreads) conv1d_silu_forward_kernel(MatrixParts out, Matrix x, Matrix weight,
                                                                          Sequences seq, Index strip_rows) {
  constexpr int N = kForwardChannels;
  const Index c0 = (blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x) * N;
  if (c0 >= x.cols) return;
  const Index t0 = blockIdx.y * strip_rows, t1 = min(x.rows, t0 + strip_rows);
  float taps[W][N];
  load_taps<W, N>(weight, c0, taps);
  const PartColumns o = locate(out, c0);
  if (in_one_sequence(seq, t0 - (W - 1), t1)) {
    conv_forward_strip<W, V, true>(o, x, taps, seq, c0, t0, t1);
  } else {
    conv_forward_strip<W, V, false>(o, x, taps, seq, c0, t0, t1);
  }
}

// The backward of conv1d + SiLU in one pass: a thread walks its channels down the strip of rows [t0, t1) and
// the W - 1 rows after it, keeping the last W inputs and the last W values of dpre = dout silu'(pre) in
// registers. So each pre-activation is computed once (not once per tap of each gradient, 2W times), and the
// strip's weight-gradient sums go to partials[strip][c * W + j] for column_finish_kernel to add in strip order
// (deterministic). dx[t] = sum_j w[c, j] dpre[t + (W - 1) - j] over the rows of t's sequence;
// dweight[c, j] = sum_t dpre[t] x[t - (W - 1) + j] over the taps inside t's sequence.
// A strip of rows [t0, t1) and the W - 1 rows after it; OneSequence: rows t0 - (W - 1) .. t1 + W - 2 lie in one
// sequence (so every row is inside the matrix and every tap counts).
template <int W, bool V, bool OneSequence, class Rows>
__device__ void conv_backward_strip(Matrix dx, Rows& rows, Matrix x, const float (&taps)[W][kBackwardChannels],
                                    Sequences seq, Index c0, Index t0, Index t1,
                                    float (&dweight)[W][kBackwardChannels]) {
  constexpr int N = kBackwardChannels;
  const Index C = x.cols, T = x.rows;
  float window[W][N], dpre[W][N];
  int sequence_at[W];  // the sequence of the rows dpre holds (-1: past the last row)
  load_history<W, N, V>(window, x, t0, c0);
#pragma unroll
  for (int j = 0; j < W; ++j) {
    sequence_at[j] = -1;
#pragma unroll
    for (int k = 0; k < N; ++k) dpre[j][k] = 0.f;
  }
  const Index last = t1 + (W - 1);
  SequenceCursor sequence(seq, t0);
#pragma unroll kRowUnroll<W>
  for (Index u = t0; u < last; ++u) {
    const bool inside = OneSequence || u < T;
    if (!OneSequence && inside) sequence.advance_to(u);
    float d[N], row[N];
    rows.pop(d, row);
    shift_in<W, N>(window, row);
#pragma unroll
    for (int j = 0; j + 1 < W; ++j) {
      sequence_at[j] = sequence_at[j + 1];
#pragma unroll
      for (int k = 0; k < N; ++k) dpre[j][k] = dpre[j + 1][k];
    }
    sequence_at[W - 1] = inside ? sequence.n : -1;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      dpre[W - 1][k] =
          inside ? d[k] * silu_grad(conv_pre<W, N, !OneSequence>(taps, window, k, u, sequence.start)) : 0.f;
      if (u < t1) {
#pragma unroll
        for (int j = 0; j < W; ++j)
          if (OneSequence || u - (W - 1) + j >= sequence.start) dweight[j][k] += dpre[W - 1][k] * window[j][k];
      }
    }
    // Row t = u - (W - 1) now has every later row whose taps read it.
    const Index t = u - (W - 1);
    if (t >= t0 && t < t1) {
      float sum[N];
#pragma unroll
      for (int k = 0; k < N; ++k) {
        sum[k] = 0.f;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const int later = W - 1 - j;  // dpre[later] is row t + later, whose tap j reads row t
          if (OneSequence || sequence_at[later] == sequence_at[0]) sum[k] += taps[j][k] * dpre[later][k];
        }
      }
      store_n<N, V>(row_of<bf16>(dx, t), c0, C, sum);
    }
  }
}

template <int W, bool V>
__global__ void __launch_bounds__(kConvThreads) conv1d_silu_backward_kernel(Matrix dx, MatrixParts dout, Matrix x,
                                                                           Matrix weight, Sequences seq,
                                                                           Index strip_rows, float* partials) {
  constexpr int N = kBackwardChannels;
  const Index C = x.cols, T = x.rows;
  const Index c0 = (blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x) * N;
  if (c0 >= C) return;
  const Index t0 = blockIdx.y * strip_rows, t1 = min(T, t0 + strip_rows);
  float taps[W][N], dweight[W][N] = {};
  load_taps<W, N>(weight, c0, taps);
  const PartColumns d = locate(dout, c0);
  const bool one_sequence = in_one_sequence(seq, t0 - (W - 1), t1 + (W - 1));
  const auto walk = [&](auto& rows) {
    if (one_sequence) {
      conv_backward_strip<W, V, true>(dx, rows, x, taps, seq, c0, t0, t1, dweight);
    } else {
      conv_backward_strip<W, V, false>(dx, rows, x, taps, seq, c0, t0, t1, dweight);
    }
  };
  if constexpr (V) {  // a thread's two channels are one aligned word of each matrix
    __shared__ std::uint32_t ring[kStageWords];
    StagedRowPair rows(ring, d, x, c0, t0, t1 + (W - 1));
    walk(rows);
  } else {
    QueuedRowPair<N, V> rows(d, x, c0, t0, t1 + (W - 1));
    walk(rows);
  }
#pragma unroll
  for (int k = 0; k < N; ++k)
    if (c0 + k < C)
#pragma unroll
      for (int j = 0; j < W; ++j) partials[blockIdx.y * C * W + (c0 + k) * W + j] = dweight[j][k];
}

// One token per sequence (row n of x, slot slots[n]): a thread takes 8 channels of a row, reads its slot's W - 1
// history rows and the new input as the window, and shifts the history by one row (no two threads touch one
// element). The taps are summed oldest first, as conv_pre sums them over a whole sequence. The threads past the
// conv's compute the gates, one element each.
template <int W, bool V>
__global__ void conv1d_silu_step_kernel(MatrixParts out, Matrix x, Matrix weight, Matrix state,
                                        const std::int32_t* slots, GatesForward gates) {
  start_after_previous_grid();
  constexpr int N = kStepChannels;
  const Index C = x.cols, per_row = (C + N - 1) / N;
  const Index index = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (index >= x.rows * per_row) {
    const Index gate = index - x.rows * per_row;
    if (gate < gates.a.rows * gates.a.cols) gates_forward_at(gates, gate);
    return;
  }
  const Index n = index / per_row, c0 = index % per_row * N, first = slots[n] * Index{W - 1};
  float taps[W][N], window[W][N];
  load_taps<W, N>(weight, c0, taps);
#pragma unroll
  for (int j = 0; j + 1 < W; ++j) load_n<N, V>(row_of<const bf16>(state, first + j), c0, C, window[j]);
  load_n<N, V>(row_of<const bf16>(x, n), c0, C, window[W - 1]);
  float y[N];
#pragma unroll
  for (int k = 0; k < N; ++k) y[k] = silu(conv_pre<W, N>(taps, window, k, W - 1, 0));
  const PartColumns o = locate(out, c0);
  store_n<N, V>(row_of<bf16>(o.m, n), o.c0, o.m.cols, y);
#pragma unroll
  for (int j = 0; j + 1 < W; ++j) store_n<N, V>(row_of<bf16>(state, first + j), c0, C, window[j + 1]);
}

// The kernels by conv width W (a template argument, so that the window stays in registers; 1 to kMaxConvWidth)
// and by whether the rows allow 16-byte accesses: table[vectorized][W - 1].
constexpr int kMaxConvWidth = 8;

template <template <int, bool> class Kernel, int... W>
constexpr auto conv_kernels(std::integer_sequence<int, W...>) {
  return std::array{std::array{Kernel<W + 1, false>::function...}, std::array{Kernel<W + 1, true>::function...}};
}
template <int W, bool V>
struct ForwardKernel {
  static constexpr auto function = conv1d_silu_forward_kernel<W, V>;
};
template <int W, bool V>
struct BackwardKernel {
  static constexpr auto function = conv1d_silu_backward_kernel<W, V>;
};
template <int W, bool V>
struct StepKernel {
  static constexpr auto function = conv1d_silu_step_kernel<W, V>;
};
constexpr auto kForwardKernels = conv_kernels<ForwardKernel>(std::make_integer_sequence<int, kMaxConvWidth>{});
constexpr auto kBackwardKernels = conv_kernels<BackwardKernel>(std::make_integer_sequence<int, kMaxConvWidth>{});
constexpr auto kStepKernels = conv_kernels<StepKernel>(std::make_integer_sequence<int, kMaxConvWidth>{});

template <class Table>
auto conv_kernel(const char* name, Index width, bool vectorized, const Table& table) {
  if (width < 1 || width > kMaxConvWidth) {
    throw Unavailable(name, "the CUDA kernel takes conv widths 1 to " + std::to_string(kMaxConvWidth) + ", got " +
                                std::to_string(width));
  }
  return table[vectorized][width - 1];
}

// Strips of 64 rows (more while the strips would pass gridDim.y's limit): enough threads to fill the GPU at a
// training batch, and the W - 1 rows a strip re-reads before its first stay a small share of its reads.
struct ConvGrid {
  dim3 grid;
  Index strip_rows;
};
ConvGrid conv_grid(Matrix x, int channels_per_thread) {
  constexpr Index kMaxStrips = 65535;  // gridDim.y
  const Index strip_rows = std::max<Index>(64, (x.rows + kMaxStrips - 1) / kMaxStrips);
  const Index strips = (x.rows + strip_rows - 1) / strip_rows;
  const Index threads = (x.cols + channels_per_thread - 1) / channels_per_thread;
  return {dim3(grid_for(threads, kConvThreads), static_cast<unsigned>(strips)), strip_rows};
}

// Where each row sits: inside its packed sequence (training, prefill), or given (decode).
struct InSequence {
  Sequences seq;
  __device__ Index operator()(Index t) const { return t - seq.cu[sequence_of(seq, t)]; }
};
struct Given {
  const std::int32_t* positions;
  __device__ Index operator()(Index t) const { return positions[t]; }
};

constexpr int kRopeHeads = 8;

template <class Position>
__global__ void rope_kernel(Matrix x, int heads, int head_dim, int rotary_dim, float theta, Position position,
                            bool inverse) {
  const int half = rotary_dim / 2;
  const Index index = blockIdx.x * static_cast<Index>(blockDim.x) + threadIdx.x;
  if (index >= x.rows * half) return;
  const Index t = index / half;
  const int i = static_cast<int>(index % half);
  const Rotation r = rope_rotation(i, rotary_dim, theta, position(t), inverse);
  bf16* row = row_of<bf16>(x, t);
  // kRopeHeads heads at a time, every load issued before the first store: a loop that stored each head before
  // loading the next waited on one load after another (the compiler cannot move a load above a store to the same
  // row), 4 us for decode's 64 rows on the H200.
  for (int h0 = 0; h0 < heads; h0 += kRopeHeads) {
    float x1[kRopeHeads], x2[kRopeHeads];
#pragma unroll
    for (int j = 0; j < kRopeHeads; ++j) {
      if (h0 + j < heads) {
        const bf16* p = row + static_cast<Index>(h0 + j) * head_dim;
        x1[j] = to_float(p[i]);
        x2[j] = to_float(p[i + half]);
      }
    }
#pragma unroll
    for (int j = 0; j < kRopeHeads; ++j) {
      if (h0 + j < heads) {
        bf16* p = row + static_cast<Index>(h0 + j) * head_dim;
        const float2 y = rotate(x1[j], x2[j], r);
        p[i] = to_bf16(y.x);
        p[i + half] = to_bf16(y.y);
      }
    }
  }
}

template <class Position>
void launch_rope(Matrix x, int heads, int head_dim, int rotary_dim, float theta, Position position, bool inverse,
                 cudaStream_t stream) {
  const Index n = x.rows * (rotary_dim / 2);
  if (n == 0) return;
  rope_kernel<<<grid_for(n, 256), 256, 0, stream>>>(x, heads, head_dim, rotary_dim, theta, position, inverse);
  check_launch("rope");
}

// Columns [first, first + count) of m, and rows [first, first + count).
Matrix columns(Matrix m, Index first, Index count, std::size_t element_size) {
  return {static_cast<char*>(m.data) + first * element_size, m.rows, count, m.ld};
}
Matrix rows(Matrix m, Index first, Index count, std::size_t element_size) {
  return {static_cast<char*>(m.data) + first * m.ld * element_size, count, m.cols, m.ld};
}

bool vectorizable(const MatrixParts& parts) {
  for (int p = 0; p < parts.count; ++p)
    if (!vectorizable(parts.part[p])) return false;
  return true;
}

// The conv kernels' launches over channels whose output (or its gradient) lies in column parts: one launch over
// all the channels when no thread's `channels` consecutive ones straddle two parts (every part but the last a
// multiple of `channels` wide, as q, k and v are), else one launch per part over its own columns of the other
// operands. launch(parts, first, count): the parts for channels [first, first + count).
template <class Launch>
void over_parts(const MatrixParts& parts, int channels, Launch launch) {
  bool straddles = false;
  Index all = 0;
  for (int p = 0; p < parts.count; ++p) {
    straddles = straddles || (p + 1 < parts.count && parts.part[p].cols % channels != 0);
    all += parts.part[p].cols;
  }
  if (!straddles) return launch(parts, Index{0}, all);
  Index first = 0;
  for (int p = 0; p < parts.count; ++p) {
    MatrixParts one;
    one.part[0] = parts.part[p];
    one.count = 1;
    launch(one, first, parts.part[p].cols);
    first += parts.part[p].cols;
  }
}

}  // namespace

void conv1d_silu_forward(MatrixParts out, Matrix x, Matrix weight, Sequences sequences, cudaStream_t stream) {
  if (x.rows == 0 || x.cols == 0) return;
  over_parts(out, kForwardChannels, [&](const MatrixParts& parts, Index first, Index count) {
    const Matrix xs = columns(x, first, count, sizeof(bf16)), ws = rows(weight, first, count, sizeof(bf16));
    const ConvGrid g = conv_grid(xs, kForwardChannels);
    const auto kernel = conv_kernel("conv1d_silu_forward", weight.cols, vectorizable(parts) && vectorizable(xs),
                                    kForwardKernels);
    kernel<<<g.grid, kConvThreads, 0, stream>>>(parts, xs, ws, sequences, g.strip_rows);
    check_launch("conv1d_silu_forward");
  });
}

void conv1d_silu_backward(Matrix dx, Matrix dweight, MatrixParts dout, Matrix x, Matrix weight, Sequences sequences,
                          Workspace& workspace, cudaStream_t stream) {
  const Index W = weight.cols;
  if (x.rows == 0 || x.cols == 0) return;
  over_parts(dout, kBackwardChannels, [&](const MatrixParts& parts, Index first, Index count) {
    const Matrix xs = columns(x, first, count, sizeof(bf16)), dxs = columns(dx, first, count, sizeof(bf16));
    const ConvGrid g = conv_grid(xs, kBackwardChannels);
    const auto kernel = conv_kernel("conv1d_silu_backward", W,
                                    vectorizable(dxs) && vectorizable(parts) && vectorizable(xs), kBackwardKernels);
    auto* partials = reinterpret_cast<float*>(workspace.reserve(g.grid.y * count * W * sizeof(float)));
    kernel<<<g.grid, kConvThreads, 0, stream>>>(dxs, parts, xs, rows(weight, first, count, sizeof(bf16)), sequences,
                                                g.strip_rows, partials);
    check_launch("conv1d_silu_backward");
    // dweight is contiguous [C, W] (checked by the caller): the strips' partial sums, added in strip order.
    column_finish("conv1d_silu_backward (dweight)", partials, g.grid.y, count * W,
                  static_cast<float*>(dweight.data) + first * W, stream);
  });
}

void rope(Matrix x, int heads, int head_dim, int rotary_dim, float theta, Sequences sequences, bool inverse,
          cudaStream_t stream) {
  launch_rope(x, heads, head_dim, rotary_dim, theta, InSequence{sequences}, inverse, stream);
}

void rope_at_positions(Matrix x, int heads, int head_dim, int rotary_dim, float theta, const std::int32_t* positions,
                       cudaStream_t stream) {
  launch_rope(x, heads, head_dim, rotary_dim, theta, Given{positions}, false, stream);
}

void conv1d_silu_step(MatrixParts out, Matrix x, Matrix weight, Matrix state, const std::int32_t* slots,
                      const GatesForward& gates, cudaStream_t stream) {
  GatesForward pending = gates;  // to the first launch
  over_parts(out, kStepChannels, [&](const MatrixParts& parts, Index first, Index count) {
    const Matrix xs = columns(x, first, count, sizeof(bf16)), states = columns(state, first, count, sizeof(bf16));
    const Index threads = xs.rows * ((count + kStepChannels - 1) / kStepChannels) + pending.a.rows * pending.a.cols;
    if (threads == 0) return;
    const auto kernel = conv_kernel("conv1d_silu_step", weight.cols,
                                    vectorizable(parts) && vectorizable(xs) && vectorizable(states), kStepKernels);
    launch_after_previous("conv1d_silu_step", kernel, grid_for(threads, 256), 256, 0, stream, parts, xs,
                          rows(weight, first, count, sizeof(bf16)), states, slots, pending);
    pending = GatesForward{};
  });
}

}  // namespace deltatrain::model::cuda
