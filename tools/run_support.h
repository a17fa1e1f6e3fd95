// What the long-running commands (train, rl) share: MPI's lifetime, the stop signal, durations for progress
// lines, threads per rank, and the chart drawn from a JSONL log by python/deltatrain/charts.py.
#pragma once

#include <csignal>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "deltatrain/comm/group.h"
#include "deltatrain/optim/digest.h"

namespace deltatrain::tools {

// Runs `body(rank, ranks)` on every rank inside an MPI session, with SIGINT and SIGTERM setting the flag that
// stop_requested() reads (the loops poll it between steps, evaluation batches and a sample's tokens); a second
// signal ends the process at once. The library raises the same Error on every rank:
// rank 0 reports it, the others exit with status 1 quietly. An exception that not every rank raises within a few
// seconds (one rank's alone: a bad_alloc, a log that cannot be written) is printed by its rank, naming it, and
// ends the job (MPI_Abort), since the other ranks would wait for it forever. After MPI is finalised, rank 0
// draws the chart of `log` when there is a log and `chart` is not "none" (empty: the log's name with .png).
void run_collective_command(const std::function<void(int rank, int ranks)>& body, const std::string& log,
                            const std::string& chart);
bool stop_requested();

// The communicator of the ranks (--device): MPI on CPUs, NCCL with one GPU per rank (its local rank's).
// InvalidArgument naming --device for anything but cpu and cuda.
std::unique_ptr<comm::Group> make_group(const std::string& device);

// Rank 0's last lines of a run: how it ended (`summary`: "done at step 40, ...") and the digests of the final
// state, which a resumed run must reproduce.
void print_result(const std::string& summary, const optim::StateDigest& digest);

// Dense bf16 FLOP/s of the device `device` runs on, for MFU: the peak of GPUs whose figure we know (by name),
// 0 where unknown (the CPU, other GPUs: pass --peak-flops).
double known_peak_flops(const std::string& device);

std::string duration_text(double seconds);  // "4m05s", "1h02m"; "?" when unknown
// One thread per core that this rank has to itself: mpirun says how many ranks share the node.
int default_threads();
// Whether progress may redraw one line: a terminal, outside mpirun (which hands its ranks a pseudo-terminal).
bool progress_on_terminal();

// What --resume names: a checkpoint (a step directory or a root), or with `latest` the --ckpt root's latest;
// InvalidArgument naming --resume for `latest` without --ckpt.
std::string resume_path(const std::string& resume, const std::string& ckpt);

// Rank 0's JSONL log (--log; an empty path: none). Opening creates the file and its directory but keeps its
// lines; start(), called once the run's options, data and checkpoint have been accepted, empties it unless
// `append` (a resume continues the log). So a refused run leaves an earlier log as it was. InvalidArgument naming
// --log when it cannot be written.
class JsonlLog {
 public:
  JsonlLog(std::string path, bool append);
  void start();
  void write(const nlohmann::ordered_json& row);

 private:
  std::string path_;
  bool append_;
  std::ofstream file_;
};

// Draws `chart` from the JSONL `log` through python (DELTATRAIN_PYTHON, else python3); a missing python or
// matplotlib is reported, never fatal.
void draw_chart(const std::string& log, const std::string& chart);

}  // namespace deltatrain::tools
