// deltatrain_memsaver_bench: `deltatrain bench memsaver` alone, for the GPU machine, whose image lacks the
// MPI and BLAS libraries the full CLI links. Same command file (tools/bench_memsaver.cpp); the machine
// description has the versions, CPU and GPUs but not the GDN backends, which this binary does not carry.
#include <cstdio>
#include <string>

#include "commands.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"
#include "describe.h"

namespace deltatrain::tools {

nlohmann::json describe_build_and_machine() {
  const CudaInfo& cuda = cuda_info();
  nlohmann::json gpus = nlohmann::json::array();
  for (const GpuInfo& gpu : cuda.gpus) {
    gpus.push_back({{"index", gpu.index}, {"name", gpu.name}, {"memory_bytes", gpu.memory_bytes}});
  }
  return {{"versions",
           {{"deltatrain", DELTATRAIN_VERSION},
            {"cuda_runtime", cuda.runtime ? cuda.runtime->str() : "none"},
            {"cuda_driver", cuda.driver ? cuda.driver->str() : "none"}}},
          {"cpu", {{"model", cpu_info().model}, {"logical_cores", cpu_info().logical_cores}}},
          {"gpus", gpus},
          {"gpu_unavailable_reason", cuda.unavailable_reason}};
}

}  // namespace deltatrain::tools

int main(int argc, char** argv) {
  CLI::App app{"deltatrain_memsaver_bench: the memory saver's cycle benchmark alone"};
  app.require_subcommand(1);
  deltatrain::tools::add_bench_memsaver_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const deltatrain::Error& e) {
    std::fprintf(stderr, "deltatrain_memsaver_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
