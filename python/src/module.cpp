#include "bindings.h"

NB_MODULE(_deltatrain, m) {
  m.doc() = "deltatrain: Gated DeltaNet training runtime (native core)";
  m.attr("__version__") = DELTATRAIN_VERSION;
  deltatrain::python::bind_core(m);
  deltatrain::python::bind_gdn(m);
  deltatrain::python::bind_memsaver(m);
#ifdef DELTATRAIN_WITH_MODEL
  deltatrain::python::bind_model(m);
  deltatrain::python::bind_rollout(m);
#endif
}
