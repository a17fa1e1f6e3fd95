// The learning-rate schedule against its definition, on random settings.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "deltatrain/core/error.h"
#include "deltatrain/train/schedule.h"
#include "train_testing.h"

namespace deltatrain::train {
namespace {

TEST(Schedule, WarmupThenCosineToTheFloor) {
  std::mt19937_64 rng(testing::test_seed());
  for (int trial = 0; trial < 50; ++trial) {
    Schedule s;
    s.lr = std::uniform_real_distribution<double>(1e-5, 1e-1)(rng);
    s.warmup = std::uniform_int_distribution<int>(0, 30)(rng);
    s.total_steps = s.warmup + std::uniform_int_distribution<int>(1, 200)(rng);
    s.min_lr_ratio = std::uniform_real_distribution<double>(0, 1)(rng);
    s.kind = ScheduleKind::cosine;
    const double floor = s.lr * s.min_lr_ratio;
    for (std::int64_t step = 0; step < s.warmup; ++step) {
      EXPECT_DOUBLE_EQ(learning_rate(s, step), s.lr * (step + 1) / s.warmup) << "warmup step " << step;
    }
    EXPECT_DOUBLE_EQ(learning_rate(s, s.warmup), s.lr);
    EXPECT_NEAR(learning_rate(s, s.total_steps), floor, 1e-15);
    EXPECT_NEAR(learning_rate(s, s.total_steps + 17), floor, 1e-15);  // stays at the floor
    const std::int64_t span = s.total_steps - s.warmup;
    for (std::int64_t k = 0; k <= span; ++k) {
      const double expected = floor + (s.lr - floor) * 0.5 * (1 + std::cos(M_PI * k / static_cast<double>(span)));
      EXPECT_NEAR(learning_rate(s, s.warmup + k), expected, 1e-14 * s.lr);
      if (k > 0) EXPECT_LE(learning_rate(s, s.warmup + k), learning_rate(s, s.warmup + k - 1));
    }
  }
}

TEST(Schedule, ConstantAfterWarmup) {
  Schedule s{.lr = 0.01, .warmup = 4, .kind = ScheduleKind::constant, .min_lr_ratio = 0.1, .total_steps = 10};
  EXPECT_DOUBLE_EQ(learning_rate(s, 0), 0.0025);
  EXPECT_DOUBLE_EQ(learning_rate(s, 3), 0.01);
  for (int step = 4; step < 30; ++step) EXPECT_EQ(learning_rate(s, step), 0.01);
}

TEST(Schedule, RefusesValuesOutOfRangeNamingTheFlag) {
  auto flag_of = [](const Schedule& s) {
    try {
      check_schedule(s);
    } catch (const InvalidArgument& e) {
      return e.argument();
    }
    return std::string("accepted");
  };
  EXPECT_EQ(flag_of({.lr = 0}), "lr");
  EXPECT_EQ(flag_of({.lr = NAN}), "lr");
  EXPECT_EQ(flag_of({.warmup = -1}), "warmup");
  EXPECT_EQ(flag_of({.min_lr_ratio = 1.5}), "min-lr-ratio");
  EXPECT_EQ(flag_of({.total_steps = -2}), "steps");
  EXPECT_EQ(flag_of({}), "accepted");
  EXPECT_EQ(parse_schedule_kind("constant"), ScheduleKind::constant);
  EXPECT_THROW(parse_schedule_kind("linear"), InvalidArgument);
}

}  // namespace
}  // namespace deltatrain::train
