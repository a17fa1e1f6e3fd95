#include "deltatrain/core/system.h"

#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#ifdef DELTATRAIN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "deltatrain/core/error.h"

namespace deltatrain {

std::optional<bool> optional_switch_setting(const char* variable, const char* value) {
  const std::string text = value == nullptr ? "" : value;
  if (text.empty()) return std::nullopt;
  if (text == "1") return true;
  if (text == "0") return false;
  throw InvalidArgument(variable, "must be 0 or 1 (or unset), got \"" + text + "\"");
}

bool switch_setting(const char* variable, const char* value) {
  return optional_switch_setting(variable, value).value_or(true);
}

const CpuInfo& cpu_info() {
  static const CpuInfo info = [] {
    CpuInfo cpu;
    cpu.logical_cores = static_cast<int>(std::thread::hardware_concurrency());
    std::ifstream cpuinfo("/proc/cpuinfo");
    std::string line;
    while (std::getline(cpuinfo, line)) {
      const auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      const std::string key = line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1);
      const std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
      if (key == "model name" && cpu.model.empty()) cpu.model = value;
      if (key == "flags" && cpu.vector_isa.empty()) {
        std::istringstream flags(value);
        std::string flag;
        while (flags >> flag) {
          for (const char* isa : {"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"}) {
            if (flag == isa) cpu.vector_isa.push_back(flag);
          }
        }
      }
    }
    return cpu;
  }();
  return info;
}

const CudaInfo& cuda_info() {
  static const CudaInfo info = [] {
    CudaInfo cuda;
#ifdef DELTATRAIN_WITH_CUDA
    cuda.built = true;
    int runtime = 0;
    if (cudaRuntimeGetVersion(&runtime) == cudaSuccess && runtime > 0) cuda.runtime = version_from_cuda_int(runtime);
    int driver = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) {
      cuda.unavailable_reason = "no NVIDIA driver is installed";
      return cuda;
    }
    cuda.driver = version_from_cuda_int(driver);
    if (driver < runtime) {
      cuda.unavailable_reason = "the driver supports CUDA " + cuda.driver->str() + " but this build needs CUDA " +
                                cuda.runtime->str() + " (update the driver)";
      return cuda;
    }
    int count = 0;
    if (const cudaError_t status = cudaGetDeviceCount(&count); status != cudaSuccess || count == 0) {
      cuda.unavailable_reason = status == cudaSuccess ? "no CUDA GPU is visible"
                                                      : std::string("no CUDA GPU is usable: ") + cudaGetErrorString(status);
      cudaGetLastError();  // clear the sticky-free error so later calls start clean
      return cuda;
    }
    for (int index = 0; index < count; ++index) {
      cudaDeviceProp prop{};
      if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) continue;
      cuda.gpus.push_back({index, prop.name, prop.major, prop.minor, prop.multiProcessorCount,
                           static_cast<std::uint64_t>(prop.totalGlobalMem)});
    }
#else
    cuda.unavailable_reason = "this build of deltatrain has no CUDA support (nvcc was not found at configure time)";
#endif
    return cuda;
  }();
  return info;
}

}  // namespace deltatrain
