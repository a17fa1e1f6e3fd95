// What the long-running commands (train, rl) share: MPI's lifetime, the stop signal, durations for progress
// lines, threads per rank, and the chart drawn from a JSONL log by python/deltatrain/charts.py.
#pragma once

#include <csignal>
#include <fstream>
#include <functional>
#include <string>

namespace deltatrain::tools {

// Runs `body(rank, ranks)` on every rank inside an MPI session, with SIGINT and SIGTERM setting the flag that
// stop_requested() reads (the loops poll it between steps). The library raises the same Error on every rank:
// rank 0 reports it, the others exit with status 1 quietly. After MPI is finalised, rank 0 draws the chart
// of `log` when there is a log and `chart` is not "none" (empty: the log's name with .png).
void run_collective_command(const std::function<void(int rank, int ranks)>& body, const std::string& log,
                            const std::string& chart);
bool stop_requested();

std::string duration_text(double seconds);  // "4m05s", "1h02m"; "?" when unknown
// One thread per core that this rank has to itself: mpirun says how many ranks share the node.
int default_threads();
// Whether progress may redraw one line: a terminal, outside mpirun (which hands its ranks a pseudo-terminal).
bool progress_on_terminal();

// The JSONL log at `path` (its directory created), appended to when resuming; InvalidArgument naming --log.
std::ofstream open_log(const std::string& path, bool append);

// Draws `chart` from the JSONL `log` through python (DELTATRAIN_PYTHON, else python3); a missing python or
// matplotlib is reported, never fatal.
void draw_chart(const std::string& log, const std::string& chart);

}  // namespace deltatrain::tools
