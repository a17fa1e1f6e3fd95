// The base of the backends that run on the host (reference, cpu).
#pragma once

#include "deltatrain/gdn/backend.h"

namespace deltatrain::gdn::host {

// What the host backends share: always available, CPU tensors only.
class HostBackend : public Backend {
 public:
  Availability available() const override { return Availability::yes(); }
  Availability supports(const Problem& problem) const override {
    if (problem.device.type != DeviceType::cpu) {
      return Availability::no("it runs on the CPU and the tensors are on " + device_name(problem.device));
    }
    return Availability::yes();
  }
};

}  // namespace deltatrain::gdn::host
