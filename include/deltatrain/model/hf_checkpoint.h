// The model in HF's format: a directory with config.json and model.safetensors (HF's parameter names), so
// a model saved by transformers' save_pretrained loads here and ours loads in transformers.
#pragma once

#include <filesystem>

#include "deltatrain/core/tensor.h"
#include "deltatrain/model/config.h"
#include "deltatrain/model/params.h"

namespace deltatrain::model {

// Writes `dir` (Failure if it exists; nothing is overwritten): config.json and model.safetensors with every
// parameter of `config` in `file_dtype` (f32 or bf16), converted from whatever dtype `params` holds in host
// memory; views on a GPU must already be in `file_dtype` and are streamed to the file chunk by chunk (no host
// copy of the model).
// Written into a temporary sibling directory, fsynced and renamed, so a crash leaves no half-written model.
void save_hf_model(const std::filesystem::path& dir, const Config& config, const TensorLookup& params,
                   DType file_dtype);

// Reads every parameter of `config` from `dir` (model.safetensors, or the shards model.safetensors.index.json
// lists) into `params`, converting from the file's dtype (f32, bf16, f16, f64). Everything is checked before
// anything is written, so nothing is half-loaded: a missing tensor, a tensor the model does not have, or a
// wrong shape raises InvalidArgument naming the tensor and the file; a damaged file raises Failure naming
// it. With tied embeddings an lm_head.weight in the file is accepted when it equals the embedding.
void load_hf_weights(const std::filesystem::path& dir, const Config& config, const TensorLookup& params);

}  // namespace deltatrain::model
