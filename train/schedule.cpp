#include "deltatrain/train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "deltatrain/core/error.h"

namespace deltatrain::train {

ScheduleKind parse_schedule_kind(const std::string& name) {
  if (name == "cosine") return ScheduleKind::cosine;
  if (name == "constant") return ScheduleKind::constant;
  throw InvalidArgument("schedule", "must be cosine or constant; got \"" + name + "\"");
}

const char* schedule_kind_name(ScheduleKind kind) { return kind == ScheduleKind::cosine ? "cosine" : "constant"; }

void check_schedule(const Schedule& schedule) {
  if (!(schedule.lr > 0) || !std::isfinite(schedule.lr)) {
    throw InvalidArgument("lr", "must be a positive finite number; got " + std::to_string(schedule.lr));
  }
  if (schedule.warmup < 0) throw InvalidArgument("warmup", "must be >= 0; got " + std::to_string(schedule.warmup));
  if (!(schedule.min_lr_ratio >= 0 && schedule.min_lr_ratio <= 1)) {
    throw InvalidArgument("min-lr-ratio", "must be in [0, 1]; got " + std::to_string(schedule.min_lr_ratio));
  }
  if (schedule.total_steps < 0) throw InvalidArgument("steps", "must be >= 0; got " + std::to_string(schedule.total_steps));
}

double learning_rate(const Schedule& schedule, std::int64_t step) {
  if (step < schedule.warmup) return schedule.lr * static_cast<double>(step + 1) / static_cast<double>(schedule.warmup);
  if (schedule.kind == ScheduleKind::constant) return schedule.lr;
  const std::int64_t span = std::max<std::int64_t>(1, schedule.total_steps - schedule.warmup);
  const double progress = std::clamp(static_cast<double>(step - schedule.warmup) / static_cast<double>(span), 0.0, 1.0);
  const double r = schedule.min_lr_ratio;
  return schedule.lr * (r + (1 - r) * 0.5 * (1 + std::cos(std::numbers::pi * progress)));
}

}  // namespace deltatrain::train
