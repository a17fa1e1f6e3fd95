// switch_setting reads the environment's on/off switches (DELTATRAIN_CUDA_WGMMA and the others) one way: unset,
// empty or "1" on, "0" off, and anything else refused with the variable and the value named; optional_switch_setting
// the same, but unset or empty is "not set" (the program's own choice).
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "deltatrain/core/error.h"
#include "deltatrain/core/system.h"

namespace deltatrain {
namespace {

TEST(SwitchSetting, UnsetEmptyAndOneAreOnZeroIsOff) {
  EXPECT_TRUE(switch_setting("DELTATRAIN_X", nullptr));
  EXPECT_TRUE(switch_setting("DELTATRAIN_X", ""));
  EXPECT_TRUE(switch_setting("DELTATRAIN_X", "1"));
  EXPECT_FALSE(switch_setting("DELTATRAIN_X", "0"));
}

TEST(SwitchSetting, OptionalLeavesUnsetAndEmptyToTheProgram) {
  EXPECT_EQ(optional_switch_setting("DELTATRAIN_X", nullptr), std::nullopt);
  EXPECT_EQ(optional_switch_setting("DELTATRAIN_X", ""), std::nullopt);
  EXPECT_EQ(optional_switch_setting("DELTATRAIN_X", "1"), true);
  EXPECT_EQ(optional_switch_setting("DELTATRAIN_X", "0"), false);
}

TEST(SwitchSetting, AnythingElseIsRefusedNamingTheVariableAndTheValue) {
  for (const char* bad : {"2", "yes", "off", " 0", "0 ", "true"}) {
    for (const bool optional : {false, true}) {
      try {
        if (optional) {
          optional_switch_setting("DELTATRAIN_CUDA_FUSED_BACKWARD", bad);
        } else {
          switch_setting("DELTATRAIN_CUDA_FUSED_BACKWARD", bad);
        }
        ADD_FAILURE() << "accepted \"" << bad << "\"";
      } catch (const InvalidArgument& error) {
        const std::string message = error.what();
        EXPECT_NE(message.find("DELTATRAIN_CUDA_FUSED_BACKWARD"), std::string::npos) << message;
        EXPECT_NE(message.find(bad), std::string::npos) << message;
      }
    }
  }
}

}  // namespace
}  // namespace deltatrain
