// An independent float64 evaluation of the hybrid model, written from the math of HF's Qwen3.5 modeling code
// token by token: the GDN layer by its recurrence (not the chunked algorithm the model runs), attention by a
// direct softmax per query, every projection as a plain dot product. Forward only: the tests check the
// model's backward against finite differences of the model itself.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "deltatrain/model/config.h"

namespace deltatrain::model::reference {

// A parameter's values by HF name, row-major.
using ParamValues = std::function<const std::vector<double>&(const std::string& name)>;

struct ReferenceOutput {
  std::vector<double> logits;    // [T, vocab]
  std::vector<double> logprobs;  // log p(target) per token, 0 where the target is -1
  double loss = 0;               // sum_t weights[t] * -logprobs[t]
};

ReferenceOutput reference_forward(const Config& config, const ParamValues& params,
                                  const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& cu_seqlens,
                                  const std::vector<std::int32_t>& targets, const std::vector<double>& weights);

}  // namespace deltatrain::model::reference
