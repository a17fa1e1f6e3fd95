#include "cudnn_attention.h"

#include <cudnn.h>

#include <algorithm>
#include <array>
#include <bit>
#include <compare>
#include <limits>
#include <map>
#include <string>
#include <unordered_map>

#include "deltatrain/core/cuda_check.h"
#include "deltatrain/core/error.h"

// The frontend's JSON support (graph serialisation) is not used; without it the frontend needs no JSON header.
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn_frontend.h>

namespace deltatrain::model::cuda {
namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// The graphs' tensors by uid: the packed bfloat16 rows, then their ragged offsets (same order), then the rest.
enum Uid : std::int64_t { q = 1, k, v, o, dout, dq, dk, dv, offsets = 100, stats = 200, lengths };
constexpr std::array<Uid, 4> kForwardRows = {q, k, v, o};
constexpr std::array<Uid, 8> kBackwardRows = {q, k, v, o, dout, dq, dk, dv};

std::string uid_name(Uid uid) {
  constexpr const char* names[] = {"", "q", "k", "v", "o", "dout", "dq", "dk", "dv"};
  return names[uid];
}

// What a graph is built for: the padded batch and length, the heads, and the row strides baked into its
// tensors (in kBackwardRows order; the forward's last four are 0).
struct GraphKey {
  bool backward = false;
  AttentionBackward algorithm = AttentionBackward::deterministic;  // the backward's
  Index batch = 0, length = 0;
  int q_heads = 0, kv_heads = 0, head_dim = 0;
  float scale = 0.f;
  std::array<Index, kBackwardRows.size()> lds = {};
  auto operator<=>(const GraphKey&) const = default;
};

void check(fe::error_t status, const std::string& step) {
  if (status.is_bad()) {
    throw Unavailable("cuDNN's fused attention (" + step + ")",
                      status.get_message() + "; DELTATRAIN_CUDNN_ATTENTION=0 runs the unfused kernels instead");
  }
}

TensorPtr index_tensor(fe::graph::Graph& graph, std::int64_t uid, const std::string& name, Index count) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({count, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT32));
}

// Packed rows [T, heads * head_dim] of row stride ld as cuDNN's [batch, heads, length, head_dim] with a ragged
// offset per sequence.
void describe_rows(fe::graph::Graph& graph, const TensorPtr& t, Uid uid, const GraphKey& key, int heads, Index ld) {
  t->set_name(uid_name(uid))
      .set_uid(uid)
      .set_dim({key.batch, heads, key.length, key.head_dim})
      .set_stride({key.length * ld, key.head_dim, ld, 1})
      .set_data_type(fe::DataType_t::BFLOAT16)
      .set_ragged_offset(index_tensor(graph, offsets + uid, uid_name(uid) + " offsets", key.batch + 1));
}

TensorPtr input_rows(fe::graph::Graph& graph, Uid uid, const GraphKey& key, int heads, Index ld) {
  TensorPtr t = graph.tensor(fe::graph::Tensor_attributes());
  describe_rows(graph, t, uid, key, heads, ld);
  return t;
}

void output_rows(fe::graph::Graph& graph, const TensorPtr& t, Uid uid, const GraphKey& key, int heads, Index ld) {
  describe_rows(graph, t, uid, key, heads, ld);
  t->set_output(true);
}

TensorPtr stats_tensor(fe::graph::Graph& graph, const GraphKey& key) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name("stats")
                          .set_uid(stats)
                          .set_dim({key.batch, key.q_heads, key.length, 1})
                          .set_stride({key.q_heads * key.length, key.length, 1, 1})
                          .set_data_type(fe::DataType_t::FLOAT));
}

std::unique_ptr<fe::graph::Graph> build(const GraphKey& key, cudnnHandle_t handle) {
  auto graph = std::make_unique<fe::graph::Graph>();
  graph->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const auto ld = [&](Uid uid) { return key.lds[uid - q]; };
  const TensorPtr qt = input_rows(*graph, q, key, key.q_heads, ld(q));
  const TensorPtr kt = input_rows(*graph, k, key, key.kv_heads, ld(k));
  const TensorPtr vt = input_rows(*graph, v, key, key.kv_heads, ld(v));
  const TensorPtr length = index_tensor(*graph, lengths, "lengths", key.batch);
  if (!key.backward) {
    auto options = fe::graph::SDPA_attributes()
                       .set_name("attention")
                       .set_generate_stats(true)
                       .set_attn_scale(key.scale)
                       .set_causal_mask(true)
                       .set_padding_mask(true)
                       .set_seq_len_q(length)
                       .set_seq_len_kv(length);
    auto [ot, st] = graph->sdpa(qt, kt, vt, options);
    output_rows(*graph, ot, o, key, key.q_heads, ld(o));
    st->set_output(true)
        .set_uid(stats)
        .set_dim({key.batch, key.q_heads, key.length, 1})
        .set_stride({key.q_heads * key.length, key.length, 1, 1})
        .set_data_type(fe::DataType_t::FLOAT);
  } else {
    const TensorPtr ot = input_rows(*graph, o, key, key.q_heads, ld(o));
    const TensorPtr dot = input_rows(*graph, dout, key, key.q_heads, ld(dout));
    auto options = fe::graph::SDPA_backward_attributes()
                       .set_name("attention backward")
                       .set_attn_scale(key.scale)
                       .set_causal_mask(true)
                       .set_padding_mask(true)
                       .set_seq_len_q(length)
                       .set_seq_len_kv(length)
                       .set_deterministic_algorithm(key.algorithm == AttentionBackward::deterministic);
    auto [dqt, dkt, dvt] = graph->sdpa_backward(qt, kt, vt, ot, dot, stats_tensor(*graph, key), options);
    output_rows(*graph, dqt, dq, key, key.q_heads, ld(dq));
    output_rows(*graph, dkt, dk, key, key.kv_heads, ld(dk));
    output_rows(*graph, dvt, dv, key, key.kv_heads, ld(dv));
  }
  check(graph->validate(), "validate");
  check(graph->build_operation_graph(handle), "build_operation_graph");
  check(graph->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans");
  check(graph->check_support(handle), "check_support");
  check(graph->build_plans(handle), "build_plans");
  return graph;
}

}  // namespace

struct CudnnAttention::Graphs {
  cudnnHandle_t handle = nullptr;
  AttentionBackward backward_algorithm = AttentionBackward::deterministic;
  std::map<GraphKey, std::unique_ptr<fe::graph::Graph>> built;

  // The key of a call: its batch padded to a power of two sequences, its longest sequence to a power of two
  // of at least 64 rows (one tile), so that shapes reuse graphs.
  GraphKey key(bool backward, const AttentionShape& shape, std::span<const std::int32_t> cu,
               std::span<const Matrix> rows) const {
    GraphKey key;
    key.backward = backward;
    key.algorithm = backward_algorithm;
    key.batch = static_cast<Index>(std::bit_ceil(cu.size() - 1));
    const Index longest = std::max<Index>(64, longest_sequence(cu));
    key.length = static_cast<Index>(std::bit_ceil(static_cast<std::uint64_t>(longest)));
    key.q_heads = shape.q_heads;
    key.kv_heads = shape.kv_heads;
    key.head_dim = shape.head_dim;
    key.scale = shape.scale;
    for (std::size_t j = 0; j < rows.size(); ++j) {
      key.lds[j] = rows[j].ld;
      // cuDNN's ragged offsets are int32 elements.
      if (static_cast<Index>(cu.back()) * rows[j].ld > std::numeric_limits<std::int32_t>::max())
        throw InvalidArgument(uid_name(kBackwardRows[j]), "is over 2^31 elements, past cuDNN's int32 ragged offsets");
    }
    return key;
  }

  fe::graph::Graph& graph(const GraphKey& key) {
    auto found = built.find(key);
    if (found == built.end()) found = built.emplace(key, build(key, handle)).first;
    return *found->second;
  }

  // Runs `graph` with the packed rows (bound with their offsets, made here) and the statistics buffer.
  void run(Workspace& workspace, const GraphKey& key, std::span<const Matrix> rows, std::span<const Uid> uids,
           Sequences sequences, Matrix lse, bool stats_from_lse_first, cudaStream_t stream) {
    fe::graph::Graph& g = graph(key);
    std::int64_t cudnn_bytes = 0;
    check(g.get_workspace_size(cudnn_bytes), "get_workspace_size");
    const Index stats_count = key.batch * key.q_heads * key.length;
    Carver plan;
    plan.add<std::int32_t>(static_cast<Index>(rows.size()) * (key.batch + 1));
    plan.add<std::int32_t>(key.batch);
    plan.add<float>(stats_count);
    plan.add<std::byte>(cudnn_bytes);
    Carver carve(workspace.reserve(plan.bytes()));
    auto* offsets_data = carve.take<std::int32_t>(static_cast<Index>(rows.size()) * (key.batch + 1));
    auto* lengths_data = carve.take<std::int32_t>(key.batch);
    auto* stats_data = carve.take<float>(stats_count);
    auto* cudnn_workspace = carve.take<std::byte>(cudnn_bytes);

    RaggedStrides strides;
    strides.tensors = static_cast<int>(rows.size());
    std::unordered_map<std::int64_t, void*> pack{{lengths, lengths_data}, {stats, stats_data}};
    for (std::size_t j = 0; j < rows.size(); ++j) {
      strides.ld[j] = rows[j].ld;
      pack[uids[j]] = rows[j].data;
      pack[offsets + uids[j]] = offsets_data + j * (key.batch + 1);
    }
    ragged_offsets(offsets_data, lengths_data, strides, sequences, static_cast<int>(key.batch), stream);
    if (stats_from_lse_first) {
      // The padding rows past each sequence's length are never read; zeros keep them finite all the same.
      cuda_check(cudaMemsetAsync(stats_data, 0, stats_count * sizeof(float), stream),
                 "cudaMemsetAsync (attention statistics)");
      stats_from_lse(stats_data, lse, sequences, key.length, stream);
    }
    const cudnnStatus_t status = cudnnSetStream(handle, stream);
    if (status != CUDNN_STATUS_SUCCESS) throw Failure(std::string("cudnnSetStream: ") + cudnnGetErrorString(status));
    check(g.execute(handle, pack, cudnn_workspace), "execute");
    if (!stats_from_lse_first) lse_from_stats(lse, stats_data, sequences, key.length, stream);
  }
};

bool CudnnAttention::built() { return true; }

CudnnAttention::CudnnAttention(AttentionBackward backward) : graphs_(std::make_unique<Graphs>()) {
  graphs_->backward_algorithm = backward;
  const cudnnStatus_t status = cudnnCreate(&graphs_->handle);
  if (status != CUDNN_STATUS_SUCCESS)
    throw Unavailable("cuDNN's fused attention", std::string("cudnnCreate failed: ") + cudnnGetErrorString(status) +
                                                     "; DELTATRAIN_CUDNN_ATTENTION=0 runs the unfused kernels instead");
}

CudnnAttention::~CudnnAttention() {
  graphs_->built.clear();  // the plans before the handle they were built on
  cudnnDestroy(graphs_->handle);
}

void CudnnAttention::forward(Workspace& workspace, Matrix o, Matrix lse, Matrix q_rows, Matrix k_rows, Matrix v_rows,
                             AttentionShape shape, std::span<const std::int32_t> cu, Sequences sequences,
                             cudaStream_t stream) {
  if (cu.size() < 2 || cu.back() == 0) return;
  const std::array<Matrix, kForwardRows.size()> rows = {q_rows, k_rows, v_rows, o};
  const GraphKey key = graphs_->key(false, shape, cu, rows);
  graphs_->run(workspace, key, rows, kForwardRows, sequences, lse, false, stream);
}

void CudnnAttention::backward(Workspace& workspace, Matrix dq_rows, Matrix dk_rows, Matrix dv_rows, Matrix dout_rows,
                              Matrix q_rows, Matrix k_rows, Matrix v_rows, Matrix o_rows, Matrix lse,
                              AttentionShape shape, std::span<const std::int32_t> cu, Sequences sequences,
                              cudaStream_t stream) {
  if (cu.size() < 2 || cu.back() == 0) return;
  const std::array<Matrix, kBackwardRows.size()> rows = {q_rows,    k_rows,  v_rows,  o_rows,
                                                         dout_rows, dq_rows, dk_rows, dv_rows};
  const GraphKey key = graphs_->key(true, shape, cu, rows);
  graphs_->run(workspace, key, rows, kBackwardRows, sequences, lse, true, stream);
}

}  // namespace deltatrain::model::cuda
