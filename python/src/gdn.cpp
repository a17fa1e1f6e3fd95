// Placeholder until the gdn binding lands.
#include "bindings.h"

namespace deltatrain::python {
void bind_gdn(nanobind::module_&) {}
}  // namespace deltatrain::python
