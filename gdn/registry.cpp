#include "deltatrain/gdn/registry.h"

#include <algorithm>

#include "deltatrain/core/error.h"

namespace deltatrain::gdn {

Registry::Registry() {
  backends_.push_back(make_cuda_backend());
  backends_.push_back(make_cpu_backend());
  backends_.push_back(make_reference_backend());
  std::stable_sort(backends_.begin(), backends_.end(),
                   [](const auto& a, const auto& b) { return a->priority() > b->priority(); });
}

const Registry& Registry::instance() {
  static const Registry registry;
  return registry;
}

const Backend& Registry::select(const std::string& name, const Problem& problem) const {
  const std::string call = std::string(operation_name(problem.op)) + " on " + device_name(problem.device);
  if (name == "auto") {
    std::string reasons;
    for (const auto& backend : backends_) {
      Availability verdict = backend->available();
      if (verdict.ok) verdict = backend->supports(problem);
      if (verdict.ok) return *backend;
      reasons += "; " + backend->name() + ": " + verdict.reason;
    }
    throw Unavailable("GDN backend 'auto'", "no backend can serve this " + call + reasons);
  }
  for (const auto& backend : backends_) {
    if (backend->name() != name) continue;
    if (Availability verdict = backend->available(); !verdict.ok) {
      throw Unavailable("GDN backend '" + name + "'", verdict.reason);
    }
    if (Availability verdict = backend->supports(problem); !verdict.ok) {
      throw Unavailable("GDN backend '" + name + "'", "it cannot serve this " + call + ": " + verdict.reason);
    }
    return *backend;
  }
  std::string known = "auto";
  for (const auto& backend : backends_) known += ", " + backend->name();
  throw InvalidArgument("backend", "'" + name + "' is not a GDN backend; choose one of: " + known);
}

}  // namespace deltatrain::gdn
