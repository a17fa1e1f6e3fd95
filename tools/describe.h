// This build and this machine as JSON (versions, CPU, GPUs, GDN backends): shown by `deltatrain info`
// and recorded with every benchmark result. Defined in info.cpp.
#pragma once

#include <nlohmann/json.hpp>

namespace deltatrain::tools {

nlohmann::json describe_build_and_machine();

}  // namespace deltatrain::tools
