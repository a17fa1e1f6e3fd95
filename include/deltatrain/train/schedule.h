// The learning-rate schedule: linear warmup, then cosine decay to a floor or a constant rate.
#pragma once

#include <cstdint>
#include <string>

namespace deltatrain::train {

enum class ScheduleKind { cosine, constant };
ScheduleKind parse_schedule_kind(const std::string& name);  // "cosine", "constant"; InvalidArgument otherwise
const char* schedule_kind_name(ScheduleKind kind);

struct Schedule {
  double lr = 3e-3;
  std::int64_t warmup = 0;     // steps of linear warmup
  ScheduleKind kind = ScheduleKind::cosine;
  double min_lr_ratio = 0.1;   // cosine's floor as a fraction of lr
  std::int64_t total_steps = 1;  // cosine reaches its floor here
};

// InvalidArgument naming the flag (lr, warmup, min-lr-ratio, steps) for values out of range.
void check_schedule(const Schedule& schedule);

// The rate of the step with 0-based index `step`: lr * (step + 1) / warmup during warmup; then constant,
// or lr * (r + (1 - r) * (1 + cos(pi * p)) / 2) with p = (step - warmup) / (total_steps - warmup) clamped
// to [0, 1] and r = min_lr_ratio.
double learning_rate(const Schedule& schedule, std::int64_t step);

}  // namespace deltatrain::train
