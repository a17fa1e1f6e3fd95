// Bad input is an InvalidArgument naming the argument, the rule and the value passed, raised before
// anything is written; a backend that cannot serve a call is Unavailable, naming itself and the reason.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"
#include "deltatrain/gdn/registry.h"
#include "gdn_testing.h"

namespace deltatrain::gdn::testing {
namespace {

// A valid call (B = 1, two packed sequences, GVA 2, initial and final state) whose pieces a case breaks.
struct Call {
  Layout layout = packed({3, 5}, 2, 4, 8, 8);
  HostTensor q{DType::f32, layout.qk_shape()}, k{DType::f32, layout.qk_shape()}, v{DType::f32, layout.v_shape()},
      g{DType::f32, layout.gate_shape()}, beta{DType::f32, layout.gate_shape()}, h0{DType::f32, layout.state_shape()},
      cu{std::vector<double>{0, 3, 8}, DType::i32, {3}};
  HostTensor o{std::vector<double>(layout.B * layout.T * layout.HV * layout.V, 7.0), DType::f32, layout.v_shape()},
      ht{std::vector<double>(layout.sequences() * layout.HV * layout.K * layout.V, 7.0), DType::f32,
         layout.state_shape()};
  HostTensor d_o{DType::f32, layout.v_shape()}, dht{DType::f32, layout.state_shape()};
  HostTensor dq{DType::f32, layout.qk_shape()}, dk{DType::f32, layout.qk_shape()}, dv{DType::f32, layout.v_shape()},
      dg{DType::f32, layout.gate_shape()}, dbeta{DType::f32, layout.gate_shape()},
      dh0{DType::f32, layout.state_shape()};

  Inputs in{q.view(), k.view(), v.view(), g.view(), beta.view(), h0.view(), cu.view(), std::nullopt};
  ForwardOutputs out{o.view(), ht.view()};
  BackwardInputs grads_in{d_o.view(), dht.view()};
  Gradients grads_out{dq.view(), dk.view(), dv.view(), dg.view(), dbeta.view(), dh0.view()};
  Options options;
};

// A tensor of another shape or dtype, kept alive by the case that uses it.
struct Spare {
  std::vector<HostTensor> tensors;
  TensorView make(DType dtype, std::vector<std::int64_t> shape) {
    tensors.emplace_back(dtype, std::move(shape));
    return tensors.back().view();
  }
};

struct BadCase {
  const char* name;
  const char* argument;  // what the error must name
  const char* detail;    // and a piece of the value it must quote
  std::function<void(Call&, Spare&)> breaks;
};

// A view of `like`'s shape and dtype whose data starts one byte into an allocation: misaligned.
TensorView misaligned(Spare& spare, const TensorView& like) {
  TensorView view = like;
  view.data = static_cast<char*>(spare.make(like.dtype, {like.numel() + 1}).data) + 1;
  return view;
}

// A transposed view of a tensor of shape `transposed`: the right shape, the wrong strides.
TensorView transposed_view(Spare& spare, std::vector<std::int64_t> transposed, int a, int b) {
  TensorView view = spare.make(DType::f32, std::move(transposed));
  std::swap(view.shape[a], view.shape[b]);
  std::swap(view.strides[a], view.strides[b]);
  return view;
}

std::vector<BadCase> forward_cases() {
  return {
      {"q_rank", "q", "[1, 8, 2]", [](Call& c, Spare& s) { c.in.q = s.make(DType::f32, {1, 8, 2}); }},
      {"k_head_dim", "k", "[1, 8, 2, 4]", [](Call& c, Spare& s) { c.in.k = s.make(DType::f32, {1, 8, 2, 4}); }},
      {"v_rank", "v", "[1, 8, 4]", [](Call& c, Spare& s) { c.in.v = s.make(DType::f32, {1, 8, 4}); }},
      {"v_length", "v", "[1, 9, 4, 8]", [](Call& c, Spare& s) { c.in.v = s.make(DType::f32, {1, 9, 4, 8}); }},
      {"hv_not_multiple_of_h", "v", "HV = 3",
       [](Call& c, Spare& s) {
         c.in.v = s.make(DType::f32, {1, 8, 3, 8});
         c.in.g = s.make(DType::f32, {1, 8, 3});
         c.in.beta = s.make(DType::f32, {1, 8, 3});
       }},
      {"g_shape", "g", "[1, 8, 2]", [](Call& c, Spare& s) { c.in.g = s.make(DType::f32, {1, 8, 2}); }},
      {"beta_shape", "beta", "[1, 8]", [](Call& c, Spare& s) { c.in.beta = s.make(DType::f32, {1, 8}); }},
      {"k_dtype", "k", "float64", [](Call& c, Spare& s) { c.in.k = s.make(DType::f64, c.layout.qk_shape()); }},
      {"v_dtype", "v", "float16", [](Call& c, Spare& s) { c.in.v = s.make(DType::f16, c.layout.v_shape()); }},
      {"q_integer", "q", "int32",
       [](Call& c, Spare& s) {
         for (TensorView* t : {&c.in.q, &c.in.k, &c.in.v}) t->dtype = DType::i32;
       }},
      {"g_half_in_float32_call", "g", "float16",
       [](Call& c, Spare& s) { c.in.g = s.make(DType::f16, c.layout.gate_shape()); }},
      {"beta_float32_in_float64_call", "beta", "float32",
       [](Call& c, Spare& s) {
         c.in.q = s.make(DType::f64, c.layout.qk_shape());
         c.in.k = s.make(DType::f64, c.layout.qk_shape());
         c.in.v = s.make(DType::f64, c.layout.v_shape());
         c.in.g = s.make(DType::f64, c.layout.gate_shape());
       }},
      {"cu_seqlens_not_from_zero", "cu_seqlens", "cu_seqlens[0] = 1",
       [](Call& c, Spare& s) { c.in.cu_seqlens->ptr<std::int32_t>()[0] = 1; }},
      {"cu_seqlens_decreasing", "cu_seqlens", "non-decreasing",
       [](Call& c, Spare& s) {
         c.in.cu_seqlens = s.make(DType::i64, {4});
         const std::int64_t offsets[] = {0, 6, 5, 8};
         std::copy(std::begin(offsets), std::end(offsets), c.in.cu_seqlens->ptr<std::int64_t>());
       }},
      {"cu_seqlens_not_ending_at_T", "cu_seqlens", "got 7",
       [](Call& c, Spare& s) { c.in.cu_seqlens->ptr<std::int32_t>()[2] = 7; }},
      {"cu_seqlens_with_batch_2", "cu_seqlens", "B = 2",
       [](Call& c, Spare& s) {
         c.in.q = s.make(DType::f32, {2, 4, 2, 8});
         c.in.k = s.make(DType::f32, {2, 4, 2, 8});
         c.in.v = s.make(DType::f32, {2, 4, 4, 8});
         c.in.g = s.make(DType::f32, {2, 4, 4});
         c.in.beta = s.make(DType::f32, {2, 4, 4});
       }},
      {"cu_seqlens_float", "cu_seqlens", "float32", [](Call& c, Spare& s) { c.in.cu_seqlens->dtype = DType::f32; }},
      {"cu_seqlens_2d", "cu_seqlens", "[3, 1]",
       [](Call& c, Spare& s) {
         c.in.cu_seqlens->ndim = 2;
         c.in.cu_seqlens->shape[1] = 1;
         c.in.cu_seqlens->strides[1] = 1;
       }},
      {"cu_seqlens_on_gpu_without_host_copy", "cu_seqlens", "cuda:0",
       [](Call& c, Spare& s) { c.in.cu_seqlens->device = Device{DeviceType::cuda, 0}; }},
      {"initial_state_wrong_N", "initial_state", "[3, 4, 8, 8]",
       [](Call& c, Spare& s) { c.in.initial_state = s.make(DType::f32, {3, 4, 8, 8}); }},
      {"initial_state_bf16", "initial_state", "bfloat16",
       [](Call& c, Spare& s) { c.in.initial_state = s.make(DType::bf16, c.layout.state_shape()); }},
      {"q_transposed", "q", "contiguous", [](Call& c, Spare& s) { c.in.q = transposed_view(s, {1, 8, 8, 2}, 2, 3); }},
      {"v_with_gaps_between_tokens", "v", "contiguous", [](Call& c, Spare& s) { c.in.v.strides[1] *= 2; }},
      {"beta_on_another_device", "beta", "cuda:1", [](Call& c, Spare& s) { c.in.beta.device = {DeviceType::cuda, 1}; }},
      {"k_null", "k", "null", [](Call& c, Spare& s) { c.in.k.data = nullptr; }},
      {"q_misaligned", "q", "not a multiple of its 4-byte float32", [](Call& c, Spare& s) { c.in.q = misaligned(s, c.in.q); }},
      {"initial_state_misaligned", "initial_state", "not a multiple",
       [](Call& c, Spare& s) { c.in.initial_state = misaligned(s, *c.in.initial_state); }},
      {"cu_seqlens_misaligned", "cu_seqlens", "not a multiple",
       [](Call& c, Spare& s) {
         c.in.cu_seqlens = misaligned(s, *c.in.cu_seqlens);
         const std::int32_t offsets[] = {0, 3, 8};
         std::memcpy(c.in.cu_seqlens->data, offsets, sizeof offsets);
       }},
      {"scale_nan", "scale", "nan", [](Call& c, Spare& s) { c.options.scale = std::nan(""); }},
      {"scale_beyond_float32", "scale", "1.0000000000000001e+300", [](Call& c, Spare& s) { c.options.scale = 1e300; }},
      {"scale_below_float32", "scale", "1e-300", [](Call& c, Spare& s) { c.options.scale = -1e-300; }},
      {"cpu_threads_negative", "cpu_threads", "-1", [](Call& c, Spare& s) { c.options.cpu_threads = -1; }},
      {"cpu_threads_beyond_the_machine", "cpu_threads", "got 1000000",
       [](Call& c, Spare& s) { c.options.cpu_threads = 1000000; }},
      {"unknown_backend", "backend", "'fastest'", [](Call& c, Spare& s) { c.options.backend = "fastest"; }},
  };
}

std::vector<BadCase> forward_output_cases() {
  return {
      {"o_shape", "o", "[1, 8, 4, 4]", [](Call& c, Spare& s) { c.out.o = s.make(DType::f32, {1, 8, 4, 4}); }},
      {"o_dtype", "o", "bfloat16", [](Call& c, Spare& s) { c.out.o = s.make(DType::bf16, c.layout.v_shape()); }},
      {"final_state_shape", "final_state", "[1, 4, 8, 8]",
       [](Call& c, Spare& s) { c.out.final_state = s.make(DType::f32, {1, 4, 8, 8}); }},
      {"final_state_float64", "final_state", "float64",
       [](Call& c, Spare& s) { c.out.final_state = s.make(DType::f64, c.layout.state_shape()); }},
      {"o_misaligned", "o", "not a multiple", [](Call& c, Spare& s) { c.out.o = misaligned(s, c.out.o); }},
  };
}

std::vector<BadCase> backward_cases() {
  return {
      {"do_shape", "do", "[1, 8, 4, 7]", [](Call& c, Spare& s) { c.grads_in.d_o = s.make(DType::f32, {1, 8, 4, 7}); }},
      {"do_dtype", "do", "float64", [](Call& c, Spare& s) { c.grads_in.d_o = s.make(DType::f64, c.layout.v_shape()); }},
      {"dht_shape", "dht", "[2, 4, 8, 9]", [](Call& c, Spare& s) { c.grads_in.dht = s.make(DType::f32, {2, 4, 8, 9}); }},
      {"dq_dtype", "dq", "bfloat16", [](Call& c, Spare& s) { c.grads_out.dq = s.make(DType::bf16, c.layout.qk_shape()); }},
      {"dg_shape", "dg", "[1, 8, 2]", [](Call& c, Spare& s) { c.grads_out.dg = s.make(DType::f32, {1, 8, 2}); }},
      {"dbeta_transposed", "dbeta", "contiguous", [](Call& c, Spare& s) { c.grads_out.dbeta = transposed_view(s, {1, 4, 8}, 1, 2); }},
      {"dh0_missing", "dh0", "required", [](Call& c, Spare& s) { c.grads_out.dh0.reset(); }},
      {"dh0_without_initial_state", "dh0", "absent", [](Call& c, Spare& s) { c.in.initial_state.reset(); }},
      {"unknown_backend", "backend", "'fastest'", [](Call& c, Spare& s) { c.options.backend = "fastest"; }},
  };
}

// The baseline call's two sequences on a pool of three states (rows 2 and 0), updated in place.
TensorView state_indices(Call& c, Spare& s, std::vector<std::int32_t> rows = {2, 0}) {
  const TensorView pool = s.make(DType::f32, {3, c.layout.HV, c.layout.K, c.layout.V});
  c.in.initial_state = pool;
  c.out.final_state = pool;
  c.in.state_indices = s.make(DType::i32, {static_cast<std::int64_t>(rows.size())});
  std::copy(rows.begin(), rows.end(), c.in.state_indices->ptr<std::int32_t>());
  return pool;
}

// Each breaks a valid call on a pool of states (state_indices) for the recurrent step.
std::vector<BadCase> state_index_cases() {
  return {
      {"state_index_beyond_the_pool", "state_indices", "entry 1 is 3, outside the rows [0, 3)",
       [](Call& c, Spare& s) { state_indices(c, s, {2, 3}); }},
      {"state_index_negative", "state_indices", "entry 0 is -1", [](Call& c, Spare& s) { state_indices(c, s, {-1, 0}); }},
      {"state_index_repeated_with_final_state", "state_indices", "entries 0 and 1 both name state row 1",
       [](Call& c, Spare& s) { state_indices(c, s, {1, 1}); }},
      {"state_indices_one_too_few", "state_indices", "got [1]", [](Call& c, Spare& s) { state_indices(c, s, {0}); }},
      {"state_indices_one_too_many", "state_indices", "got [3]", [](Call& c, Spare& s) { state_indices(c, s, {0, 1, 2}); }},
      {"state_indices_2d", "state_indices", "[2, 1]",
       [](Call& c, Spare& s) {
         state_indices(c, s);
         c.in.state_indices->ndim = 2;
         c.in.state_indices->shape[1] = 1;
         c.in.state_indices->strides[1] = 1;
       }},
      {"state_indices_int64", "state_indices", "int64",
       [](Call& c, Spare& s) {
         state_indices(c, s);
         c.in.state_indices = s.make(DType::i64, {2});
       }},
      {"state_indices_float", "state_indices", "float32",
       [](Call& c, Spare& s) {
         state_indices(c, s);
         c.in.state_indices = s.make(DType::f32, {2});
       }},
      {"state_indices_on_another_device", "state_indices", "cuda:0",
       [](Call& c, Spare& s) {
         state_indices(c, s);
         c.in.state_indices->device = Device{DeviceType::cuda, 0};
       }},
      {"state_indices_misaligned", "state_indices", "not a multiple",
       [](Call& c, Spare& s) {
         state_indices(c, s);
         c.in.state_indices = misaligned(s, *c.in.state_indices);
       }},
      {"state_indices_strided", "state_indices", "contiguous",
       [](Call& c, Spare& s) {
         state_indices(c, s);
         c.in.state_indices->strides[0] = 2;
       }},
      {"state_indices_without_initial_state", "state_indices", "initial_state, which is then required",
       [](Call& c, Spare& s) {
         state_indices(c, s);
         c.in.initial_state.reset();
       }},
      {"state_pool_head_dims", "initial_state", "[3, 4, 8, 8]",
       [](Call& c, Spare& s) {
         state_indices(c, s);
         c.in.initial_state = s.make(DType::f32, {3, 4, 8, 9});
       }},
      {"state_pool_bf16", "initial_state", "bfloat16",
       [](Call& c, Spare& s) {
         state_indices(c, s);
         c.in.initial_state = s.make(DType::bf16, {3, 4, 8, 8});
       }},
      {"final_pool_of_other_rows", "final_state", "like the pool initial_state, got [2, 4, 8, 8]",
       [](Call& c, Spare& s) {
         state_indices(c, s);
         c.out.final_state = c.ht.view();
       }},
  };
}

void expect_invalid(const BadCase& bad, const std::function<void(const Call&)>& run) {
  SCOPED_TRACE(bad.name);
  Call call;
  Spare spare;
  bad.breaks(call, spare);
  try {
    run(call);
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), bad.argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::string("'") + bad.argument + "'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(bad.detail), std::string::npos) << e.what();
  }
  // Nothing was written: the outputs still hold what the caller put there.
  for (double x : call.o.values()) ASSERT_EQ(x, 7.0);
  for (double x : call.ht.values()) ASSERT_EQ(x, 7.0);
}

TEST(BadInput, ForwardAndRecurrent) {
  for (const BadCase& bad : forward_cases()) {
    expect_invalid(bad, [](const Call& c) { chunk_forward(c.in, c.out, c.options); });
    expect_invalid(bad, [](const Call& c) { recurrent_forward(c.in, c.out, c.options); });
    expect_invalid(bad, [](const Call& c) { resolve_backend(c.in, c.options); });
  }
  for (const BadCase& bad : forward_output_cases()) {
    expect_invalid(bad, [](const Call& c) { chunk_forward(c.in, c.out, c.options); });
    expect_invalid(bad, [](const Call& c) { recurrent_forward(c.in, c.out, c.options); });
  }
}

TEST(BadInput, StateIndices) {
  for (const BadCase& bad : state_index_cases()) {
    expect_invalid(bad, [](const Call& c) { recurrent_forward(c.in, c.out, c.options); });
  }
}

// A pool of states is the recurrent step's: the chunked operations refuse state_indices by name.
TEST(BadInput, StateIndicesOutsideTheRecurrentStep) {
  const BadCase bad{"state_indices_in_chunked_call", "state_indices", "in the recurrent step only",
                    [](Call& c, Spare& s) { state_indices(c, s); }};
  expect_invalid(bad, [](const Call& c) { chunk_forward(c.in, c.out, c.options); });
  expect_invalid(bad, [](const Call& c) { chunk_backward(c.in, c.grads_in, c.grads_out, c.options); });
  expect_invalid(bad, [](const Call& c) { resolve_backend(c.in, c.options); });
}

TEST(BadInput, StateIndicesBaselineIsValid) {
  for (const std::string backend : {"auto", "reference", "cpu"}) {
    Call call;
    Spare spare;
    state_indices(call, spare);
    call.options.backend = backend;
    EXPECT_NO_THROW(recurrent_forward(call.in, call.out, call.options)) << backend;
    // Repeated rows are fine when nothing is written back.
    state_indices(call, spare, {1, 1});
    call.out.final_state.reset();
    EXPECT_NO_THROW(recurrent_forward(call.in, call.out, call.options)) << backend;
  }
}

TEST(BadInput, Backward) {
  for (const BadCase& bad : backward_cases()) {
    expect_invalid(bad, [](const Call& c) { chunk_backward(c.in, c.grads_in, c.grads_out, c.options); });
  }
}

// The CPU backends keep nothing for the backward (forward_saved_bytes 0): a saved buffer, where passed, must then be
// empty, and anything else is refused by name before anything is written; the recurrent step refuses one outright.
TEST(BadInput, SavedBuffer) {
  for (const std::string backend : {"auto", "reference", "cpu"}) {
    Call call;
    call.options.backend = backend;
    EXPECT_EQ(forward_saved_bytes(call.in, call.options), 0u) << backend;
  }
  const BadCase sized{"saved_not_empty", "saved", "got [16]",
                      [](Call& c, Spare& s) { c.out.saved = c.grads_in.saved = s.make(DType::u8, {16}); }};
  const BadCase typed{"saved_not_bytes", "saved", "float32",
                      [](Call& c, Spare& s) { c.out.saved = c.grads_in.saved = s.make(DType::f32, {0}); }};
  for (const BadCase& bad : {sized, typed}) {
    expect_invalid(bad, [](const Call& c) { chunk_forward(c.in, c.out, c.options); });
    expect_invalid(bad, [](const Call& c) { chunk_backward(c.in, c.grads_in, c.grads_out, c.options); });
  }
  const BadCase recurrent{"saved_in_recurrent_step", "saved", "only chunk_forward",
                          [](Call& c, Spare& s) { c.out.saved = s.make(DType::u8, {0}); }};
  expect_invalid(recurrent, [](const Call& c) { recurrent_forward(c.in, c.out, c.options); });
}

// An empty saved buffer is accepted where the backend keeps nothing (the cuda backend's tests hold the results to the
// bits of a call without one).
TEST(BadInput, EmptySavedBufferIsValid) {
  Call call;
  Spare spare;
  call.out.saved = call.grads_in.saved = spare.make(DType::u8, {0});
  for (const std::string backend : {"auto", "reference", "cpu"}) {
    call.options.backend = backend;
    EXPECT_NO_THROW(chunk_forward(call.in, call.out, call.options)) << backend;
    EXPECT_NO_THROW(chunk_backward(call.in, call.grads_in, call.grads_out, call.options)) << backend;
  }
}

TEST(BadInput, TheBaselineCallIsValid) {
  Call call;
  for (const std::string backend : {"auto", "reference", "cpu"}) {
    call.options.backend = backend;
    EXPECT_NO_THROW(chunk_forward(call.in, call.out, call.options)) << backend;
    EXPECT_NO_THROW(recurrent_forward(call.in, call.out, call.options)) << backend;
    EXPECT_NO_THROW(chunk_backward(call.in, call.grads_in, call.grads_out, call.options)) << backend;
  }
}

// A float64 call computes in float64: a scale beyond float32 is representable there.
TEST(BadInput, ScaleBeyondFloat32IsValidInAFloat64Call) {
  Call call;
  Spare spare;
  call.in.q = spare.make(DType::f64, call.layout.qk_shape());
  call.in.k = spare.make(DType::f64, call.layout.qk_shape());
  call.in.v = spare.make(DType::f64, call.layout.v_shape());
  call.in.g = spare.make(DType::f64, call.layout.gate_shape());
  call.in.beta = spare.make(DType::f64, call.layout.gate_shape());
  call.in.initial_state.reset();
  call.options.scale = 1e300;
  EXPECT_NO_THROW(make_problem(call.in, call.options, Operation::chunk_forward));
}

// A call whose K x V state (2^46 elements) exceeds any address space fails with OutOfMemory naming the
// backend's workspace and the state's size, on every backend and operation: the allocation fails inside
// an OpenMP region, which an exception may not leave.
TEST(Limits, AStateTooLargeForMemoryIsOutOfMemoryNamingIt) {
#ifdef __SANITIZE_ADDRESS__
  GTEST_SKIP() << "under AddressSanitizer a failing operator new reports out of memory and exits instead of throwing "
                  "std::bad_alloc, so the failure this test provokes cannot be caught (`make sanitize`)";
#endif
  const std::int64_t K = std::int64_t{1} << 23, V = std::int64_t{1} << 23;
  const HostTensor q(DType::f32, {1, 1, 1, K}), v(DType::f32, {1, 1, 1, V}), gates(DType::f32, {1, 1, 1});
  const Inputs in{q.view(), q.view(), v.view(), gates.view(), gates.view(), std::nullopt, std::nullopt, std::nullopt};
  const auto expect_out_of_memory = [](const std::string& what, const std::string& backend, const auto& run) {
    try {
      run();
      ADD_FAILURE() << what << " on " << backend << " did not fail";
    } catch (const OutOfMemory& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(backend + " backend"), std::string::npos) << message;
      EXPECT_NE(message.find("K x V state of"), std::string::npos) << message;
      EXPECT_NE(message.find("K = 8388608, V = 8388608"), std::string::npos) << message;
    }
  };
  for (const std::string backend : {"cpu", "reference"}) {
    Options options;
    options.backend = backend;
    {
      const HostTensor o(DType::f32, {1, 1, 1, V});
      expect_out_of_memory("forward", backend, [&] { chunk_forward(in, {o.view(), std::nullopt}, options); });
      expect_out_of_memory("recurrent", backend, [&] { recurrent_forward(in, {o.view(), std::nullopt}, options); });
    }
    const HostTensor d_o(DType::f32, {1, 1, 1, V}), dq(DType::f32, {1, 1, 1, K}), dk(DType::f32, {1, 1, 1, K}),
        dv(DType::f32, {1, 1, 1, V}), dg(DType::f32, {1, 1, 1}), dbeta(DType::f32, {1, 1, 1});
    expect_out_of_memory("backward", backend, [&] {
      chunk_backward(in, {d_o.view(), std::nullopt},
                     {dq.view(), dk.view(), dv.view(), dg.view(), dbeta.view(), std::nullopt}, options);
    });
  }
}

// Empty inputs (T = 0) are valid, with the all-zero strides NumPy gives zero-size arrays: nothing is
// written to the empty outputs, the final state is the initial one and dh0 is dht.
TEST(Limits, EmptyInputsGiveTheInitialStateBack) {
  const Layout layout{2, 0, 1, 2, 4, 3, {}};
  const auto zero_strides = [](TensorView view) {
    for (int d = 0; d < view.ndim; ++d) view.strides[d] = 0;
    return view;
  };
  std::vector<double> h0_values(2 * 2 * 4 * 3);
  for (std::size_t i = 0; i < h0_values.size(); ++i) h0_values[i] = 0.25 * static_cast<double>(i) - 3;
  const HostTensor q(DType::f32, layout.qk_shape()), v(DType::f32, layout.v_shape()),
      gates(DType::f32, layout.gate_shape()), h0(h0_values, DType::f32, layout.state_shape());
  const Inputs in{zero_strides(q.view()), zero_strides(q.view()), zero_strides(v.view()), zero_strides(gates.view()),
                  zero_strides(gates.view()), h0.view(), std::nullopt, std::nullopt};
  for (const std::string backend : {"cpu", "reference"}) {
    Options options;
    options.backend = backend;
    const HostTensor o(DType::f32, layout.v_shape());
    HostTensor ht(DType::f32, layout.state_shape());
    chunk_forward(in, {zero_strides(o.view()), ht.view()}, options);
    EXPECT_EQ(ht.values(), h0_values) << backend;
    ht = HostTensor(DType::f32, layout.state_shape());
    recurrent_forward(in, {zero_strides(o.view()), ht.view()}, options);
    EXPECT_EQ(ht.values(), h0_values) << backend;
    const HostTensor dq(DType::f32, layout.qk_shape()), dk(DType::f32, layout.qk_shape()),
        dv(DType::f32, layout.v_shape()), dg(DType::f32, layout.gate_shape()), dbeta(DType::f32, layout.gate_shape()),
        dh0(DType::f32, layout.state_shape());
    chunk_backward(in, {zero_strides(o.view()), h0.view()},
                   {zero_strides(dq.view()), zero_strides(dk.view()), zero_strides(dv.view()),
                    zero_strides(dg.view()), zero_strides(dbeta.view()), dh0.view()},
                   options);
    EXPECT_EQ(dh0.values(), h0_values) << backend;
  }
}

TEST(Registry, ListsEveryBackendWithAReasonWhenUnavailable) {
  std::vector<std::string> names;
  for (const auto& backend : Registry::instance().backends()) {
    names.push_back(backend->name());
    const Availability here = backend->available();
    if (!here.ok) {
      EXPECT_FALSE(here.reason.empty()) << backend->name();
    }
  }
  for (const char* expected : {"reference", "cpu", "cuda"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected;
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::adjacent_find(names.begin(), names.end()), names.end()) << "duplicate backend name";
}

// "auto" is the first backend, in priority order, that is available and supports the call.
TEST(Registry, AutoPicksTheFirstBackendThatCanServe) {
  Call call;
  Problem problem = make_problem(call.in, call.options, Operation::chunk_forward);
  std::string expected;
  int previous_priority = std::numeric_limits<int>::max();
  for (const auto& backend : Registry::instance().backends()) {
    EXPECT_LE(backend->priority(), previous_priority) << "backends are not listed fastest first";
    previous_priority = backend->priority();
    if (expected.empty() && backend->available().ok && backend->supports(problem).ok) expected = backend->name();
  }
  ASSERT_FALSE(expected.empty());
  EXPECT_EQ(resolve_backend(call.in, call.options), expected);
}

// Every backend this machine cannot run, named explicitly, is Unavailable with its reason: never a crash,
// never another backend instead.
TEST(Registry, AnExplicitUnavailableBackendSaysWhy) {
  Call call;
  int unavailable = 0;
  for (const auto& backend : Registry::instance().backends()) {
    const Availability here = backend->available();
    if (here.ok) continue;
    ++unavailable;
    call.options.backend = backend->name();
    try {
      chunk_forward(call.in, call.out, call.options);
      ADD_FAILURE() << backend->name() << " accepted a call it cannot serve";
    } catch (const Unavailable& e) {
      EXPECT_NE(std::string(e.what()).find("'" + backend->name() + "'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(here.reason), std::string::npos) << e.what();
    }
  }
  if (unavailable == 0) GTEST_SKIP() << "every backend is available on this machine";
}

TEST(Registry, CudaWithoutAGpuIsUnavailableNamingTheReason) {
  if (cuda_info().usable()) GTEST_SKIP() << "a GPU is usable here; this checks the no-GPU path";
  Call call;
  call.options.backend = "cuda";
  try {
    chunk_forward(call.in, call.out, call.options);
    ADD_FAILURE() << "the cuda backend accepted a call without a GPU";
  } catch (const Unavailable& e) {
    EXPECT_NE(std::string(e.what()).find("'cuda'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(cuda_info().unavailable_reason), std::string::npos) << e.what();
  }
}

// A host backend asked to serve tensors that live on a GPU declines with its reason; "auto" lists them all.
TEST(Registry, HostBackendsDeclineGpuTensors) {
  Call call;
  for (TensorView* t : {&call.in.q, &call.in.k, &call.in.v, &call.in.g, &call.in.beta}) t->device = {DeviceType::cuda, 0};
  call.in.initial_state.reset();
  call.in.cu_seqlens.reset();
  for (const char* host : {"reference", "cpu"}) {
    call.options.backend = host;
    try {
      resolve_backend(call.in, call.options);
      ADD_FAILURE() << host << " accepted GPU tensors";
    } catch (const Unavailable& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + host + "'"), std::string::npos) << e.what();
    }
  }
  if (cuda_info().usable()) return;  // with a GPU, "auto" may find a backend for these
  call.options.backend = "auto";
  try {
    resolve_backend(call.in, call.options);
    ADD_FAILURE() << "auto found a backend for GPU tensors without a GPU";
  } catch (const Unavailable& e) {
    for (const auto& backend : Registry::instance().backends()) {
      EXPECT_NE(std::string(e.what()).find(backend->name()), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace deltatrain::gdn::testing
