// trainer.json read strictly: each field of the wrong type, out of range or unknown is refused naming the file and
// the field, where a loose read would truncate a step of 10.7 or wrap a count past 2^63.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "deltatrain/core/error.h"
#include "deltatrain/model/config.h"
#include "deltatrain/train/trainer.h"

namespace deltatrain::train {
namespace {

std::string saved_state() {
  TrainerState state;
  state.step = 10;
  state.data = {2, 3, 4};
  state.seed = 1234;
  state.tokens_per_step = 1024;
  state.seq_len = 256;
  state.dp_size = 2;
  state.config_json = model::config_to_hf_json(model::preset("tiny"));
  state.data_fingerprint = "abc";
  return state_to_json(state);
}

TEST(TrainerState, RoundTripsAndTakesAnyUnsigned64BitSeed) {
  nlohmann::json j = nlohmann::json::parse(saved_state());
  j["seed"] = UINT64_MAX;
  const TrainerState state = state_from_json(j.dump(), "x/trainer.json");
  EXPECT_EQ(state.step, 10);
  EXPECT_EQ(state.data, (DataPosition{2, 3, 4}));
  EXPECT_EQ(state.seed, UINT64_MAX);
  EXPECT_EQ(state.dp_size, 2);
}

TEST(TrainerState, RefusesEachBadFieldNamingTheFileAndTheField) {
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> edits = {
      {[](nlohmann::json& j) { j["step"] = 10.7; }, "step must be an integer"},
      {[](nlohmann::json& j) { j["step"] = -1; }, "step must be an integer"},
      {[](nlohmann::json& j) { j["seed"] = 1234.9; }, "seed must be an integer"},
      {[](nlohmann::json& j) { j["seed"] = -5; }, "seed must be an integer"},
      {[](nlohmann::json& j) { j["data"]["epoch"] = 2.5; }, "data.epoch must be an integer"},
      {[](nlohmann::json& j) { j["data"]["offset"] = -1; }, "data.offset must be an integer"},
      {[](nlohmann::json& j) { j["dp_size"] = -7; }, "dp_size must be an integer"},
      {[](nlohmann::json& j) { j["tokens_per_step"] = (std::uint64_t{1} << 63) + 5; }, "tokens_per_step must be"},
      {[](nlohmann::json& j) { j["seq_len"] = "256"; }, "seq_len must be an integer"},
      {[](nlohmann::json& j) { j["version"] = 2; }, "version must be an integer in [1, 1]"},
      {[](nlohmann::json& j) { j["stepp"] = 3; }, "stepp is not a field"},
      {[](nlohmann::json& j) { j["data"]["indx"] = 3; }, "data.indx is not a field"},
      {[](nlohmann::json& j) { j.erase("data_fingerprint"); }, "data_fingerprint is missing"},
  };
  for (const auto& [edit, what] : edits) {
    nlohmann::json j = nlohmann::json::parse(saved_state());
    edit(j);
    try {
      state_from_json(j.dump(), "x/trainer.json");
      ADD_FAILURE() << "accepted " << j.dump() << "; expected " << what;
    } catch (const Failure& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("trainer state x/trainer.json is not valid: "), std::string::npos) << message;
      EXPECT_NE(message.find(what), std::string::npos) << message;
    }
  }
}

}  // namespace
}  // namespace deltatrain::train
