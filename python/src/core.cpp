// Core utilities for Python: robust version parsing, for trainers that gate features on library,
// runtime and driver versions ("2.8a0", "12.8rc1", "2.9.0+cu128").
#include <nanobind/operators.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>

#include "bindings.h"
#include "deltatrain/core/version.h"
#include "tensor.h"

namespace nb = nanobind;

namespace deltatrain::python {

void bind_core(nb::module_& m) {
  register_error_translators();
  nb::class_<Version>(m, "Version", "A parsed version; comparisons use the release numbers only")
      .def_ro("major", &Version::major)
      .def_ro("minor", &Version::minor)
      .def_ro("patch", &Version::patch)
      .def_ro("prerelease", &Version::prerelease)
      .def_ro("local", &Version::local)
      .def_prop_ro("release", [](const Version& v) { return std::make_tuple(v.major, v.minor, v.patch); })
      .def(nb::self == nb::self)
      .def(nb::self < nb::self)
      .def(nb::self <= nb::self)
      .def(nb::self > nb::self)
      .def(nb::self >= nb::self)
      .def("__str__", &Version::str)
      .def("__repr__", [](const Version& v) { return "Version('" + v.str() + "')"; });
  m.def("parse_version", &parse_version, nb::arg("text"), nb::arg("what") = "version",
        "Parses MAJOR[.MINOR[.PATCH[.BUILD]]][pre-release][+local] ('12.8', '12.8rc1', '2.8a0', '2.9.0+cu128', "
        "'13.0.88'); anything else raises ValueError naming `what` and quoting the text.");
}

}  // namespace deltatrain::python
