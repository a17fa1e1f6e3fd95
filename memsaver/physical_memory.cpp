#include "deltatrain/memsaver/physical_memory.h"

namespace deltatrain::memsaver {

std::unique_ptr<PhysicalMemory> make_physical_memory(const std::string& backend, int device) {
  if (backend == "host") return make_host_pages();
  if (backend == "cuda") return make_cuda_vmm(device);
  throw InvalidArgument("backend", "must be host or cuda, got '" + backend + "'");
}

}  // namespace deltatrain::memsaver
