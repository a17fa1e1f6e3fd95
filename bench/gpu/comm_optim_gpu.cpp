// GPU figures of comm and optim, under `mpirun -np 2` with one GPU per rank (bench/gpu/comm_optim.sh):
//   1. a NCCL communicator's device memory (free memory before creation, after the first collective,
//      after release) and the time to release, rebuild, and run the first collective after a rebuild;
//   2. checkpoint save and load throughput of a DistributedAdamW whose fp32 state spans --state-gib
//      GiB in all, on the disk under --dir, with the page cache dropped (posix_fadvise) before each
//      load; loads with and without checksum verification, and resharded onto one rank.
// Prints one JSON object (rank 0). Every figure is a wall-clock time on rank 0 between barriers.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <mpi.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "deltatrain/core/clock.h"
#include "deltatrain/core/cuda_check.h"
#include "deltatrain/comm/nccl_group.h"
#include "deltatrain/optim/adamw.h"
#include "deltatrain/optim/checkpoint.h"
#include "deltatrain/optim/digest.h"

namespace dt = deltatrain;
namespace fs = std::filesystem;
using deltatrain::Clock;
using deltatrain::seconds_since;
namespace {

std::vector<double> mib(std::vector<double> bytes) {
  for (double& b : bytes) b /= 1 << 20;
  return bytes;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

std::uint64_t free_device_bytes() { return dt::comm::cuda_free_bytes(); }

// Drops this checkpoint's pages from the page cache, so that a load reads the disk.
void drop_cached_pages(const fs::path& dir) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    const int fd = ::open(entry.path().c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

std::uint64_t directory_bytes(const fs::path& dir) {
  std::uint64_t bytes = 0;
  for (const auto& entry : fs::directory_iterator(dir)) bytes += fs::file_size(entry.path());
  return bytes;
}

nlohmann::json communicator_figures(dt::comm::Group& group, int repeats, std::uint64_t free_before_group) {
  const std::size_t count = std::size_t{64} << 20;  // 256 MiB of floats
  void* buffer = nullptr;
  dt::cuda_check(cudaMalloc(&buffer, count * sizeof(float)), "cudaMalloc");
  dt::cuda_check(cudaMemset(buffer, 0, count * sizeof(float)), "cudaMemset");
  auto collective = [&] {
    group.all_reduce(buffer, buffer, count, dt::DType::f32, dt::comm::ReduceOp::sum);
    dt::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  };
  collective();  // NCCL connects lazily: the first collective allocates the channels' buffers
  const double footprint = static_cast<double>(free_before_group) - static_cast<double>(free_device_bytes()) -
                           static_cast<double>(count * sizeof(float));
  std::vector<double> freed, release_ms, reload_ms, first_ms, steady_ms;
  for (int i = 0; i < repeats; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    auto start = Clock::now();
    collective();
    steady_ms.push_back(1e3 * seconds_since(start));
    const std::uint64_t before = free_device_bytes();
    MPI_Barrier(MPI_COMM_WORLD);
    start = Clock::now();
    group.release();
    release_ms.push_back(1e3 * seconds_since(start));
    freed.push_back(static_cast<double>(free_device_bytes()) - static_cast<double>(before));
    MPI_Barrier(MPI_COMM_WORLD);
    start = Clock::now();
    group.reload();
    reload_ms.push_back(1e3 * seconds_since(start));
    start = Clock::now();
    collective();
    first_ms.push_back(1e3 * seconds_since(start));
  }
  dt::cuda_check(cudaFree(buffer), "cudaFree");
  return {{"repeats", repeats},
          {"communicator_footprint_mib", footprint / (1 << 20)},
          {"freed_by_release_mib_median", median(freed) / (1 << 20)},
          {"freed_by_release_mib_all", mib(freed)},
          {"release_ms_median", median(release_ms)},
          {"reload_ms_median", median(reload_ms)},
          {"first_all_reduce_after_reload_ms_median", median(first_ms)},
          {"steady_all_reduce_256mib_ms_median", median(steady_ms)}};
}

// Parameters of the checkpoint benchmark: equal bf16 tensors whose fp32 state (3 x 4 bytes per
// element) spans `state_gib` GiB.
std::vector<dt::optim::ParamSpec> large_params(double state_gib) {
  const int tensors = 16;
  const auto per_tensor = static_cast<std::int64_t>(state_gib * (1ull << 30) / 12 / tensors);
  std::vector<dt::optim::ParamSpec> specs;
  for (int t = 0; t < tensors; ++t) specs.push_back({"w" + std::to_string(t), {per_tensor}, dt::DType::bf16});
  return specs;
}

// Fills a device view with a repeated block of random values (never zeros), then synchronises.
void fill(const dt::TensorView& view, std::uint64_t seed) {
  std::vector<char> block(std::size_t{64} << 20);
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i + 8 <= block.size(); i += 8) {
    const std::uint64_t bits = rng() & 0x3f3f3f3f3f3f3f3full;  // small, finite values in bf16 and f32
    std::memcpy(block.data() + i, &bits, 8);
  }
  char* target = static_cast<char*>(view.data);
  for (std::size_t done = 0; done < view.nbytes(); done += block.size()) {
    dt::cuda_check(cudaMemcpy(target + done, block.data(), std::min(block.size(), view.nbytes() - done),
                              cudaMemcpyHostToDevice),
                   "cudaMemcpy");
  }
}

template <class Body>
double timed(Body&& body) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = Clock::now();
  body();
  MPI_Barrier(MPI_COMM_WORLD);
  return seconds_since(start);
}

nlohmann::json checkpoint_figures(dt::comm::Group& group, const fs::path& root, double state_gib) {
  const std::vector<dt::optim::ParamSpec> specs = large_params(state_gib);
  dt::optim::DistributedAdamW optimizer(group, specs, dt::optim::AdamWConfig{});
  for (int b = 0; b < static_cast<int>(optimizer.layout().buffers.size()); ++b) {
    fill(optimizer.param_buffer(b), 1 + b);
    fill(optimizer.grad_buffer(b), 100 + b);
  }
  optimizer.initialize_from_params();
  optimizer.step();
  dt::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const dt::optim::StateDigest saved_digest = dt::optim::digest_state(optimizer);

  fs::path dir;
  const double save_s = timed([&] { dir = dt::optim::save_checkpoint(optimizer, root); });
  const std::uint64_t bytes = directory_bytes(dir);
  nlohmann::json out = {{"state_gib", state_gib}, {"files_bytes", bytes}, {"save_s", save_s},
                        {"save_gb_per_s", bytes / save_s / 1e9}};

  auto load = [&](dt::comm::Group& into, bool verify) {
    dt::optim::DistributedAdamW loaded(into, specs, dt::optim::AdamWConfig{});
    if (group.rank() == 0) drop_cached_pages(dir);
    const double s = timed([&] { dt::optim::load_checkpoint(loaded, dir, {verify}); });
    return std::make_pair(s, dt::optim::digest_state(loaded).state == saved_digest.state);
  };
  const auto [verified_s, verified_exact] = load(group, true);
  const auto [plain_s, plain_exact] = load(group, false);
  out["load_verified_s"] = verified_s;
  out["load_verified_gb_per_s"] = bytes / verified_s / 1e9;
  out["load_s"] = plain_s;
  out["load_gb_per_s"] = bytes / plain_s / 1e9;
  out["loaded_state_equals_saved"] = verified_exact && plain_exact;

  // Resharded onto one rank: rank 0 alone reads both ranks' files.
  MPI_Comm alone = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, group.rank() == 0 ? 0 : MPI_UNDEFINED, 0, &alone);
  if (alone != MPI_COMM_NULL) {
    const std::unique_ptr<dt::comm::Group> one = dt::comm::make_nccl_group(alone, 0);
    dt::optim::DistributedAdamW loaded(*one, specs, dt::optim::AdamWConfig{});
    drop_cached_pages(dir);
    const auto start = Clock::now();
    dt::optim::load_checkpoint(loaded, dir, {false});
    const double s = seconds_since(start);
    out["load_resharded_to_1_rank_s"] = s;
    out["load_resharded_to_1_rank_gb_per_s"] = bytes / s / 1e9;
    out["resharded_state_equals_saved"] = dt::optim::digest_state(loaded).state == saved_digest.state;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (alone != MPI_COMM_NULL) MPI_Comm_free(&alone);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  fs::path dir = "/tmp/deltatrain-bench";
  double state_gib = 8;
  int repeats = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--dir") dir = argv[i + 1];
    if (flag == "--state-gib") state_gib = std::stod(argv[i + 1]);
    if (flag == "--repeats") repeats = std::stoi(argv[i + 1]);
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int code = 0;
  try {
    dt::cuda_check(cudaSetDevice(rank), "cudaSetDevice");
    dt::cuda_check(cudaFree(nullptr), "cudaFree");  // the context exists before the first reading
    const std::uint64_t before_group = free_device_bytes();
    const std::unique_ptr<dt::comm::Group> group = dt::comm::make_nccl_group(MPI_COMM_WORLD, rank);
    nlohmann::json result;
    result["communicator"] = communicator_figures(*group, repeats, before_group);
    result["checkpoint"] = checkpoint_figures(*group, dir, state_gib);
    int nccl_version = 0;
    ncclGetVersion(&nccl_version);
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, rank);
    result["environment"] = {{"gpu", prop.name}, {"ranks", group->size()}, {"nccl_version_code", nccl_version}};
    if (rank == 0) std::printf("%s\n", result.dump(2).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    code = 1;
  }
  MPI_Finalize();
  return code;
}
