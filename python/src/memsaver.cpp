// Placeholder until the memsaver binding lands.
#include "bindings.h"

namespace deltatrain::python {
void bind_memsaver(nanobind::module_&) {}
}  // namespace deltatrain::python
