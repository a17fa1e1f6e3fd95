// Each component binds itself into the one extension module.
#pragma once

#include <nanobind/nanobind.h>

namespace deltatrain::python {

void bind_core(nanobind::module_& m);
void bind_gdn(nanobind::module_& m);
void bind_memsaver(nanobind::module_& m);
void bind_model(nanobind::module_& m);  // only where the model is built (DELTATRAIN_WITH_MODEL)
void bind_rollout(nanobind::module_& m);  // likewise

}  // namespace deltatrain::python
