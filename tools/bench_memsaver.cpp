// `deltatrain bench memsaver`: one allocation of N bytes in a region, filled with a pattern, paused and
// resumed (several cycles), then checked; its pause and resume rates beside the plain copy of the same
// bytes measured in the same run (pinned D2H/H2D for cuda, memcpy for host).
#include <chrono>
#include <cstdio>
#include <ctime>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "deltatrain/memsaver/cycle_bench.h"
#include "describe.h"

namespace deltatrain::tools {
namespace {

struct Settings {
  std::string backend = "host";
  std::size_t bytes = std::size_t{1} << 30;
  std::string backup = "cpu";
  int cycles = 3;
  int device = 0;
  std::size_t chunk_bytes = memsaver::SaverOptions{}.chunk_bytes;
  bool json = false;
};

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return text;
}

double gib(std::uint64_t bytes) { return static_cast<double>(bytes) / double(1ull << 30); }

// Copy rate over the reference rate of the same direction; null where the transition copies nothing.
nlohmann::json fraction(bool copies, double rate, double reference) {
  return copies && reference > 0 ? nlohmann::json(rate / reference) : nlohmann::json(nullptr);
}

void run_bench(const Settings& s) {
  memsaver::CycleBenchOptions options;
  options.backend = s.backend;
  options.device = s.device;
  options.bytes = s.bytes;
  options.backup = memsaver::parse_backup(s.backup, "--backup");
  options.cycles = s.cycles;
  options.chunk_bytes = s.chunk_bytes;
  const memsaver::CycleBenchReport r = memsaver::run_cycle_bench(options);

  const bool pause_copies = r.backup == memsaver::Backup::CpuCopy;
  const bool resume_copies = r.backup != memsaver::Backup::None;
  const double pause_rate = memsaver::gib_per_s(r.bytes, r.pause_s);
  const double resume_rate = memsaver::gib_per_s(r.bytes, r.resume_s);
  const double d2h_rate = memsaver::gib_per_s(r.bytes, r.d2h_s);
  const double h2d_rate = memsaver::gib_per_s(r.bytes, r.h2d_s);
  if (s.json) {
    const nlohmann::json out = {
        {"benchmark", "memsaver"},
        {"date", utc_now()},
        {"backend", r.backend},
        {"bytes", r.bytes},
        {"backup", std::string(memsaver::to_string(r.backup))},
        {"cycles", r.cycles},
        {"chunk_bytes", s.chunk_bytes},
        {"pattern_seed", r.seed},
        {"pause_s", r.pause_s},
        {"resume_s", r.resume_s},
        {"first_pause_s", r.first_pause_s},
        {"first_resume_s", r.first_resume_s},
        {"pause_gibps", pause_rate},
        {"resume_gibps", resume_rate},
        {"reference_d2h_s", r.d2h_s},
        {"reference_h2d_s", r.h2d_s},
        {"d2h_gibps", d2h_rate},
        {"h2d_gibps", h2d_rate},
        {"pause_vs_d2h", fraction(pause_copies, pause_rate, d2h_rate)},
        {"resume_vs_h2d", fraction(resume_copies, resume_rate, h2d_rate)},
        {"resident_before", r.resident_before},
        {"resident_paused", r.resident_paused},
        {"resident_resumed", r.resident_resumed},
        {"host_bytes_held", r.host_bytes_held},
        {"contents_restored", r.contents_restored},
        {"machine", describe_build_and_machine()}};
    std::printf("%s\n", out.dump(2).c_str());
    return;
  }
  std::printf("memsaver on %s: %.3f GiB, backup %s, %d cycles\n", r.backend.c_str(), gib(r.bytes),
              std::string(memsaver::to_string(r.backup)).c_str(), r.cycles);
  std::printf("  pause    %.4f s  %7.2f GiB/s  (first cycle %.4f s)\n", r.pause_s, pause_rate, r.first_pause_s);
  std::printf("  resume   %.4f s  %7.2f GiB/s  (first cycle %.4f s)\n", r.resume_s, resume_rate, r.first_resume_s);
  std::printf("  plain copy of the same bytes: to host %.2f GiB/s, to device %.2f GiB/s\n", d2h_rate, h2d_rate);
  if (pause_copies) std::printf("  pause at %.0f%% of the plain copy to host\n", 100 * pause_rate / d2h_rate);
  if (resume_copies) std::printf("  resume at %.0f%% of the plain copy to device\n", 100 * resume_rate / h2d_rate);
  std::printf("  in use: before %.3f GiB, paused %.3f GiB, resumed %.3f GiB; host memory held %.3f GiB\n",
              gib(r.resident_before), gib(r.resident_paused), gib(r.resident_resumed), gib(r.host_bytes_held));
  std::printf("  contents restored bitwise: %s\n", r.contents_restored ? "yes" : "no");
}

// CLI11's size parser reads "-1" as 2^64 - 1 (then reported as too large, with that number): a size
// with a minus sign is refused as negative instead.
CLI::Validator size_value() {
  const CLI::Validator parse = CLI::AsSizeValue(false);
  return CLI::Validator(
      [parse](std::string& text) {
        if (text.find('-') != std::string::npos) {
          return "must be a size >= 0 (a number, or with a unit such as 8GiB), got " + text;
        }
        return parse(text);
      },
      parse.get_description());
}

}  // namespace

void add_bench_memsaver_command(CLI::App& bench) {
  auto s = std::make_shared<Settings>();
  CLI::App* command = bench.add_subcommand("memsaver", "time a pause/resume cycle of the memory saver beside a plain copy");
  command->add_option("--backend", s->backend, "host (host pages) or cuda (CUDA VMM)")
      ->check(CLI::IsMember({"host", "cuda"}))
      ->capture_default_str();
  command->add_option("--bytes", s->bytes, "bytes to park: a number, or with a unit such as 8GiB")
      ->transform(size_value())
      ->capture_default_str();
  command->add_option("--backup", s->backup, "none, cpu or restore_from (from the buffer that filled it)")
      ->capture_default_str();
  command->add_option("--cycles", s->cycles, "pause/resume cycles; times are the median after the first")
      ->capture_default_str();
  command->add_option("--device", s->device, "CUDA device")->capture_default_str();
  command->add_option("--chunk-bytes", s->chunk_bytes, "copies are split into chunks of this size over the streams")
      ->transform(size_value())
      ->capture_default_str();
  command->add_flag("--json", s->json, "print one JSON object (with date, machine and versions)");
  command->callback([s] { run_bench(*s); });
}

}  // namespace deltatrain::tools
