// The per-call cost of the communicators' free-memory check (Google Benchmark): what a hot-path
// operation pays to skip it, what the policy costs around a trivial probe, what a real probe costs
// (cudaMemGetInfo on a GPU, /proc/meminfo on the host), and a 1-element all-reduce on a one-rank MPI
// group with and without the check, for scale. Runs as one process (MPI singleton).
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <fstream>
#include <string>

#include "deltatrain/comm/group.h"
#include "deltatrain/comm/mpi_group.h"
#include "deltatrain/comm/nccl_group.h"

namespace deltatrain::comm {
namespace {

Group& self_group() {
  static const std::unique_ptr<Group> group = make_mpi_group(MPI_COMM_SELF);
  return *group;
}

// MemAvailable from /proc/meminfo: what a CPU group could plug in as its probe.
std::uint64_t host_available_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::uint64_t kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemAvailable:") return kib * 1024;
    meminfo.ignore(256, '\n');
  }
  return 0;
}

void with_probe(std::function<std::uint64_t()> probe, OpSet skipped = hot_path_ops()) {
  MemoryCheck check;
  check.free_bytes = std::move(probe);
  check.min_free_bytes = 1;  // never trims: only the probe's cost is measured
  check.skipped = skipped;
  self_group().set_memory_check(std::move(check));
}

void BM_HotOpSkipsTheCheck(benchmark::State& state) {
  with_probe([] { return std::uint64_t{1} << 40; });
  for (auto _ : state) self_group().check_memory(Op::all_gather);
}
BENCHMARK(BM_HotOpSkipsTheCheck);

void BM_ColdOpTrivialProbe(benchmark::State& state) {
  with_probe([] { return std::uint64_t{1} << 40; });
  for (auto _ : state) self_group().check_memory(Op::all_reduce);
}
BENCHMARK(BM_ColdOpTrivialProbe);

void BM_ColdOpHostMeminfoProbe(benchmark::State& state) {
  with_probe(host_available_bytes);
  for (auto _ : state) self_group().check_memory(Op::all_reduce);
}
BENCHMARK(BM_ColdOpHostMeminfoProbe);

void BM_ColdOpCudaMemGetInfoProbe(benchmark::State& state) {
  std::string reason;
  if (!nccl_available(&reason)) {
    state.SkipWithError(("no GPU: " + reason).c_str());
    return;
  }
  with_probe(cuda_free_bytes);
  for (auto _ : state) self_group().check_memory(Op::all_reduce);
}
BENCHMARK(BM_ColdOpCudaMemGetInfoProbe);

// A one-element all-reduce on one rank: the smallest real operation, with the check on or skipped.
void BM_OneRankAllReduce(benchmark::State& state) {
  const bool checked = state.range(0) != 0;
  OpSet skipped = hot_path_ops();
  if (!checked) skipped.insert(Op::all_reduce);
  with_probe(host_available_bytes, skipped);
  double value = 1;
  for (auto _ : state) {
    self_group().all_reduce(&value, &value, 1, DType::f64, ReduceOp::sum);
    benchmark::DoNotOptimize(value);
  }
  state.SetLabel(checked ? "checked (/proc/meminfo probe)" : "skipped");
}
BENCHMARK(BM_OneRankAllReduce)->Arg(0)->Arg(1);

}  // namespace
}  // namespace deltatrain::comm

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
