#include "run_support.h"

#include "commands.h"

#include <mpi.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "deltatrain/comm/mpi_group.h"
#include "deltatrain/comm/nccl_group.h"
#include "deltatrain/core/device_memory.h"
#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"

extern char** environ;

namespace deltatrain::tools {
namespace {

// Set by SIGINT/SIGTERM. A second signal, when the first is not heeded soon enough (a long step: the loops poll
// between steps, evaluation batches and a sample's tokens), ends the process as the signal's default action does.
volatile std::sig_atomic_t g_stop = 0;
extern "C" void request_stop(int signal) {
  if (g_stop != 0) {
    std::signal(signal, SIG_DFL);
    std::raise(signal);
  }
  g_stop = 1;
}

// Whether every rank reaches this (on `failures`, a communicator of its own, so that it meets no collective of the
// run) within a few seconds: a failure raised on every rank, as the library's collective errors and refused
// options are, rather than one rank's alone while the others wait for it in a collective.
bool every_rank_failed(MPI_Comm failures) {
  constexpr auto kPatience = std::chrono::seconds(10);
  MPI_Request request;
  MPI_Ibarrier(failures, &request);
  const auto deadline = std::chrono::steady_clock::now() + kPatience;
  for (int done = 0; std::chrono::steady_clock::now() < deadline;) {
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (done) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

}  // namespace

void run_collective_command(const std::function<void(int rank, int ranks)>& body, const std::string& log,
                            const std::string& chart) {
  struct MpiSession {
    MpiSession() { MPI_Init(nullptr, nullptr); }
    ~MpiSession() { MPI_Finalize(); }
  };
  bool draw = false;
  {
    MpiSession mpi;
    int rank = 0, ranks = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    struct sigaction action {};
    action.sa_handler = request_stop;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, nullptr);
    sigaction(SIGTERM, &action, nullptr);
    MPI_Comm failures;
    MPI_Comm_dup(MPI_COMM_WORLD, &failures);
    try {
      body(rank, ranks);
      draw = rank == 0 && !log.empty() && chart != "none";
    } catch (const std::exception& e) {
      if (!every_rank_failed(failures)) {
        // The other ranks wait in a collective that this rank will never enter, and MPI_Finalize would wait for
        // them: the job is ended here, with the reason.
        std::fprintf(stderr, "deltatrain: rank %d of %d: %s\n", rank, ranks, e.what());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      MPI_Comm_free(&failures);
      if (rank == 0) throw;
      throw CLI::RuntimeError(1);
    }
    MPI_Comm_free(&failures);
  }
  if (draw) draw_chart(log, chart.empty() ? std::filesystem::path(log).replace_extension(".png").string() : chart);
}

bool stop_requested() { return g_stop != 0; }

void check_fits_in_memory(const std::string& flag, double bytes, const std::string& what, Device device) {
  const double memory = static_cast<double>(device_total_memory(device));  // 0: unknown, nothing refused
  if (memory > 0 && bytes > memory) {
    const std::string whose =
        device.type == DeviceType::cpu ? std::string("this machine's") : "GPU " + std::to_string(device.index) + "'s";
    char rule[320];
    std::snprintf(rule, sizeof rule, "needs at least %.1f GiB (%s), more than %s %.1f GiB", bytes / (1ull << 30),
                  what.c_str(), whose.c_str(), memory / (1ull << 30));
    throw InvalidArgument(flag, rule);
  }
}

std::string duration_text(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) return "?";
  const long s = static_cast<long>(seconds + 0.5);
  char text[32];
  if (s >= 3600) {
    std::snprintf(text, sizeof text, "%ldh%02ldm", s / 3600, s / 60 % 60);
  } else {
    std::snprintf(text, sizeof text, "%ldm%02lds", s / 60, s % 60);
  }
  return text;
}

int default_threads() {
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int ranks = local != nullptr ? std::max(1, std::atoi(local)) : 1;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / ranks);
}

bool progress_on_terminal() {
  return isatty(STDOUT_FILENO) != 0 && std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr;
}

namespace {
std::ofstream open_log(const std::string& path, std::ios::openmode mode) {
  std::ofstream log(path, mode);
  if (!log) throw InvalidArgument("--log", "cannot open " + path + " for writing");
  return log;
}
}  // namespace

JsonlLog::JsonlLog(std::string path, bool append) : path_(std::move(path)), append_(append) {
  if (path_.empty()) return;
  const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
  std::error_code ignored;  // a failure shows as the open's below
  if (!parent.empty()) std::filesystem::create_directories(parent, ignored);
  file_ = open_log(path_, std::ios::app);
}

void JsonlLog::start() {
  if (!path_.empty() && !append_) file_ = open_log(path_, std::ios::trunc);
}

void JsonlLog::write(const nlohmann::ordered_json& row) {
  if (!file_.is_open()) return;
  file_ << row.dump() << '\n';
  file_.flush();
}

void draw_chart(const std::string& log, const std::string& chart) {
  namespace fs = std::filesystem;
  const char* from_env = std::getenv("DELTATRAIN_PYTHON");
  const std::string python = from_env != nullptr && *from_env != '\0' ? from_env : "python3";
  const fs::path script = fs::path(DELTATRAIN_SOURCE_DIR) / "python" / "deltatrain" / "charts.py";
  std::vector<std::string> argv_text = {python};
  if (fs::exists(script)) {
    argv_text.push_back(script.string());  // the source tree's script: needs no installed package
  } else {
    argv_text.insert(argv_text.end(), {"-m", "deltatrain.charts"});
  }
  argv_text.insert(argv_text.end(), {log, chart});
  std::vector<char*> argv;
  for (std::string& a : argv_text) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  int status = 0;
  if (posix_spawnp(&pid, python.c_str(), nullptr, nullptr, argv.data(), environ) != 0) {
    std::printf("chart: not drawn, %s not found (set DELTATRAIN_PYTHON to a python with matplotlib)\n", python.c_str());
    return;
  }
  waitpid(pid, &status, 0);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    std::printf("chart: %s\n", chart.c_str());
  } else {
    std::printf("chart: not drawn (%s exited with status %d; see its message above)\n", python.c_str(),
                WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  }
}

std::unique_ptr<comm::Group> make_group(const std::string& device) {
  if (device == "cpu") return comm::make_mpi_group(MPI_COMM_WORLD);
  if (device != "cuda") throw InvalidArgument("device", "must be cpu or cuda, got '" + device + "'");
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  return comm::make_nccl_group(MPI_COMM_WORLD, local != nullptr ? std::atoi(local) : 0);
}

void print_result(const std::string& summary, const optim::StateDigest& digest) {
  std::printf("%s\nparams_sha256  %s\nstate_sha256   %s\n", summary.c_str(), digest.params.c_str(), digest.state.c_str());
  std::fflush(stdout);
}

double known_peak_flops(const std::string& device) {
  if (device != "cuda" || cuda_info().gpus.empty()) return 0;
  // Dense bf16 tensor-core peaks from the vendors' data sheets (SXM parts).
  const std::string& name = cuda_info().gpus.front().name;
  if (name.find("H100") != std::string::npos || name.find("H200") != std::string::npos) return 989.4e12;
  if (name.find("A100") != std::string::npos) return 312e12;
  return 0;
}

std::string resume_path(const std::string& resume, const std::string& ckpt) {
  if (resume != "latest") return resume;
  if (ckpt.empty()) throw InvalidArgument("resume", "`latest` needs --ckpt, the root whose latest checkpoint to load");
  return ckpt;
}

}  // namespace deltatrain::tools
