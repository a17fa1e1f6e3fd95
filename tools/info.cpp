// `deltatrain info`: what this build and this machine offer, and which GDN backends can run here and why not.
#include <omp.h>

#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "describe.h"
#include "deltatrain/core/system.h"
#include "deltatrain/gdn/registry.h"

namespace deltatrain::tools {
namespace {

std::string compiler() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("GCC ") + __VERSION__;
#else
  return "unknown";
#endif
}

std::string optional_version(const std::optional<Version>& version) { return version ? version->str() : "none"; }

}  // namespace

nlohmann::json describe_build_and_machine() {
  const CpuInfo& cpu = cpu_info();
  const CudaInfo& cuda = cuda_info();
  nlohmann::json gpus = nlohmann::json::array();
  for (const GpuInfo& gpu : cuda.gpus) {
    gpus.push_back({{"index", gpu.index},
                    {"name", gpu.name},
                    {"compute_capability", std::to_string(gpu.cc_major) + "." + std::to_string(gpu.cc_minor)},
                    {"multiprocessors", gpu.multiprocessors},
                    {"memory_bytes", gpu.memory_bytes}});
  }
  nlohmann::json backends = nlohmann::json::array();
  for (const auto& backend : gdn::Registry::instance().backends()) {
    const gdn::Availability here = backend->available();
    nlohmann::json details = nlohmann::json::object();
    for (const auto& [key, value] : backend->details()) details[key] = value;
    backends.push_back({{"name", backend->name()},
                        {"priority", backend->priority()},
                        {"available", here.ok},
                        {"reason", here.reason},
                        {"details", details}});
  }
  return {{"versions",
           {{"deltatrain", DELTATRAIN_VERSION},
            {"compiler", compiler()},
            {"cuda_built", cuda.built},
            {"cuda_runtime", optional_version(cuda.runtime)},
            {"cuda_driver", optional_version(cuda.driver)},
            {"openmp_threads", omp_get_max_threads()}}},
          {"cpu", {{"model", cpu.model}, {"logical_cores", cpu.logical_cores}, {"vector_isa", cpu.vector_isa}}},
          {"gpus", gpus},
          {"gpu_unavailable_reason", cuda.unavailable_reason},
          {"gdn_backends", backends}};
}

namespace {

void print_table(const nlohmann::json& info) {
  const auto& v = info["versions"];
  std::printf("deltatrain %s\n", v["deltatrain"].get<std::string>().c_str());
  std::printf("  compiler        %s\n", v["compiler"].get<std::string>().c_str());
  std::printf("  CUDA            %s (runtime %s, driver %s)\n", v["cuda_built"].get<bool>() ? "built" : "not built",
              v["cuda_runtime"].get<std::string>().c_str(), v["cuda_driver"].get<std::string>().c_str());
  std::printf("  OpenMP threads  %d\n", v["openmp_threads"].get<int>());
  const auto& cpu = info["cpu"];
  std::string isa;
  for (const auto& name : cpu["vector_isa"]) isa += " " + name.get<std::string>();
  std::printf("CPU   %s, %d logical cores, ISA:%s\n", cpu["model"].get<std::string>().c_str(),
              cpu["logical_cores"].get<int>(), isa.empty() ? " (none detected)" : isa.c_str());
  if (info["gpus"].empty()) {
    std::printf("GPUs  none usable: %s\n", info["gpu_unavailable_reason"].get<std::string>().c_str());
  }
  for (const auto& gpu : info["gpus"]) {
    std::printf("GPU %d %s, compute capability %s, %d SMs, %.1f GiB\n", gpu["index"].get<int>(),
                gpu["name"].get<std::string>().c_str(), gpu["compute_capability"].get<std::string>().c_str(),
                gpu["multiprocessors"].get<int>(), gpu["memory_bytes"].get<double>() / (1u << 30));
  }
  std::printf("GDN backends (fastest first; \"auto\" takes the first that can serve a call):\n");
  for (const auto& backend : info["gdn_backends"]) {
    const bool ok = backend["available"].get<bool>();
    std::printf("  %-10s %-11s %s\n", backend["name"].get<std::string>().c_str(), ok ? "available" : "unavailable",
                ok ? "" : backend["reason"].get<std::string>().c_str());
    for (const auto& [key, value] : backend["details"].items()) {
      std::printf("  %-10s   %s: %s\n", "", key.c_str(), value.get<std::string>().c_str());
    }
  }
}

}  // namespace

void add_info_command(CLI::App& app) {
  CLI::App* info = app.add_subcommand("info", "backends (with the reason when unavailable), versions and hardware");
  auto json = std::make_shared<bool>(false);
  info->add_flag("--json", *json, "print JSON instead of a table");
  info->callback([json] {
    const nlohmann::json described = describe_build_and_machine();
    if (*json) {
      std::printf("%s\n", described.dump(2).c_str());
    } else {
      print_table(described);
    }
  });
}

}  // namespace deltatrain::tools
