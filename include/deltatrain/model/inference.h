// The state the model carries between inference steps (rollout), per slot: a slot holds one sequence at a
// time, and is reused by the next once that sequence is done. Allocated once, at its full size, on the
// model's device; Model::prefill and Model::decode (model.h) read and write it.
//
//   GDN layers        gdn_state   [slots, HV, K, V]   the operator's recurrent state (float32; float64 in a
//                                                      float64 model: the gdn operator's state dtype)
//                     conv_state  [slots, W - 1, C]   the last W - 1 inputs of the causal conv1d, oldest first
//                                                      (zeros before the sequence's start), C = conv_dim
//   attention layers  k_cache, v_cache [slots, max_length, Hkv * hd]   keys (normed and rotated) and values
//                                                      of positions [0, lengths[slot])
//
// Everything but the GDN state is in the model's activation dtype.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "deltatrain/core/tensor.h"
#include "deltatrain/model/config.h"
#include "deltatrain/model/model.h"

namespace deltatrain::model {

class Arena;

struct LayerState {
  TensorView gdn_state, conv_state;  // GDN layers (empty views in attention layers)
  TensorView k_cache, v_cache;       // attention layers (empty views in GDN layers)
};

class InferenceState {
 public:
  // InvalidArgument naming slots or max_length when either is < 1.
  InferenceState(const Config& config, const ModelOptions& options, std::int64_t slots, std::int64_t max_length);
  ~InferenceState();
  InferenceState(const InferenceState&) = delete;
  InferenceState& operator=(const InferenceState&) = delete;

  // The bytes the state of `slots` slots of `max_length` positions holds on the device: what a cache budget
  // is checked against before anything is allocated.
  static std::int64_t bytes(const Config& config, const ModelOptions& options, std::int64_t slots,
                            std::int64_t max_length);

  std::int64_t slots() const { return slots_; }
  std::int64_t max_length() const { return max_length_; }
  const LayerState& layer(int index) const { return layers_[index]; }
  // The positions a slot holds (0: empty); prefill sets it, each decode step adds one.
  std::int32_t length(std::int64_t slot) const { return lengths_[slot]; }
  // Empties a slot (its memory is overwritten by the next prefill into it).
  void release(std::int64_t slot) { lengths_[slot] = 0; }

 private:
  friend class Model;
  std::int64_t slots_, max_length_;
  std::unique_ptr<Arena> memory_;
  std::vector<LayerState> layers_;
  std::vector<std::int32_t> lengths_;
};

}  // namespace deltatrain::model
