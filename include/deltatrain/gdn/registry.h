// The registry of GDN backends. Every backend (reference, cpu, cuda, later hopper) is listed here,
// built or not, so that `deltatrain info` and `backends()` can say why one is missing.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "deltatrain/gdn/backend.h"

namespace deltatrain::gdn {

class Registry {
 public:
  static const Registry& instance();

  // All backends, fastest first.
  const std::vector<std::unique_ptr<Backend>>& backends() const { return backends_; }

  // The backend named by `name` ("auto" picks the fastest available one that supports the problem).
  // Throws InvalidArgument for an unknown name, Unavailable (naming the backend and the reason, or every
  // backend's reason for "auto") when nothing can serve the call. Never falls back silently.
  const Backend& select(const std::string& name, const Problem& problem) const;

 private:
  Registry();
  std::vector<std::unique_ptr<Backend>> backends_;
};

// Factories, one per backend; each lives in its backend's folder.
std::unique_ptr<Backend> make_reference_backend();
std::unique_ptr<Backend> make_cpu_backend();
std::unique_ptr<Backend> make_cuda_backend();  // reports itself unavailable when built without CUDA

}  // namespace deltatrain::gdn
