// What this machine offers: CPU, and the CUDA driver, runtime and GPUs where the build has CUDA.
// Used by backends to decide availability (with a reason) and by `deltatrain info`.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "deltatrain/core/version.h"

namespace deltatrain {

struct CpuInfo {
  std::string model;
  int logical_cores = 0;
  std::vector<std::string> vector_isa;  // "avx2", "avx512f", ...
};

struct GpuInfo {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int multiprocessors = 0;
  std::uint64_t memory_bytes = 0;
};

struct CudaInfo {
  bool built = false;                     // compiled with CUDA support
  std::optional<Version> driver;          // highest CUDA version the installed driver supports
  std::optional<Version> runtime;         // the CUDA runtime this build links
  std::vector<GpuInfo> gpus;
  std::string unavailable_reason;         // empty when at least one GPU can be used
  bool usable() const { return unavailable_reason.empty(); }
};

const CpuInfo& cpu_info();
// Queried once per process; cheap afterwards.
const CudaInfo& cuda_info();

// An on/off switch read from the environment (DELTATRAIN_CUDA_WGMMA, DELTATRAIN_CUDNN_ATTENTION,
// DELTATRAIN_STREAM_GEMM: kernels' choices a user may turn off to compare them or to avoid one): `value` is
// getenv(variable)'s result; unset (null), empty or "1" is on, "0" off, anything else an InvalidArgument naming
// the variable.
bool switch_setting(const char* variable, const char* value);
// The same switch where unset is a third state, "let the program choose" (DELTATRAIN_CUDA_FUSED_BACKWARD: unset,
// the plan's rule; "1" wherever the choice applies; "0" never): nullopt for unset or empty.
std::optional<bool> optional_switch_setting(const char* variable, const char* value);

}  // namespace deltatrain
