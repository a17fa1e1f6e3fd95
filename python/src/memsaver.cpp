// `_deltatrain.memsaver`: an in-process Saver over host pages or CUDA VMM. Addresses are plain integers;
// the Python layer (deltatrain/memsaver.py) adds regions, typed stats and the LD_PRELOAD shim's saver.
// The GIL is released while memory is mapped, copied or given back.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "deltatrain/memsaver/saver.h"
#include "tensor.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace deltatrain::python {
namespace {

using memsaver::Saver;

// StateError -> deltatrain.memsaver.StateError (a RuntimeError); the rest (OutOfMemory -> MemoryError, ...)
// is left to register_error_translators().
void register_memsaver_translators() {
  static const bool registered = [] {
    nb::register_exception_translator([](const std::exception_ptr& error, void*) {
      try {
        std::rethrow_exception(error);
      } catch (const StateError& e) {
        nb::object state_error = nb::module_::import_("deltatrain.memsaver").attr("StateError");
        PyErr_SetString(state_error.ptr(), e.what());
      }
    });
    return true;
  }();
  (void)registered;
}

nb::dict as_dict(const memsaver::TagStats& stats) {
  nb::dict entry;
  entry["tag"] = stats.tag;
  entry["backup"] = std::string(memsaver::to_string(stats.backup));
  entry["state"] = std::string(memsaver::to_string(stats.state));
  entry["allocations"] = stats.allocations;
  entry["bytes"] = stats.bytes;
  entry["reserved_bytes"] = stats.reserved_bytes;
  entry["mapped_bytes"] = stats.mapped_bytes;
  entry["backup_bytes"] = stats.backup_bytes;
  entry["host_bytes_held"] = stats.host_bytes_held;
  return entry;
}

}  // namespace

void bind_memsaver(nb::module_& m) {
  register_error_translators();
  register_memsaver_translators();
  nb::module_ module = m.def_submodule("memsaver", "In-process memory saver (see deltatrain.memsaver)");
  using release_gil = nb::call_guard<nb::gil_scoped_release>;

  nb::class_<Saver>(module, "Saver",
                    "Tagged allocations whose memory pause() releases and resume() brings back at the same "
                    "addresses. backend: 'host' (host pages) or 'cuda' (CUDA VMM on `device`).")
      .def(
          "__init__",
          [](Saver* self, const std::string& backend, int device, std::size_t chunk_bytes) {
            new (self) Saver(memsaver::make_physical_memory(backend, device), memsaver::SaverOptions{chunk_bytes});
          },
          "backend"_a = "host", "device"_a = 0, "chunk_bytes"_a = memsaver::SaverOptions{}.chunk_bytes)
      .def(
          "allocate",
          [](Saver& saver, const std::string& tag, const std::string& backup, std::size_t bytes) {
            const memsaver::Region region{tag, memsaver::parse_backup(backup)};
            nb::gil_scoped_release unlocked;
            return reinterpret_cast<std::uintptr_t>(saver.allocate(region, bytes));
          },
          "tag"_a, "backup"_a, "bytes"_a, "Address of a fresh allocation of `bytes` under `tag`.")
      .def(
          "free", [](Saver& saver, std::uintptr_t address) { saver.free(reinterpret_cast<void*>(address)); },
          "address"_a, release_gil())
      .def(
          "contains",
          [](const Saver& saver, std::uintptr_t address) { return saver.contains(reinterpret_cast<void*>(address)); },
          "address"_a)
      .def(
          "pause",
          [](Saver& saver, const std::optional<std::string>& tag) { tag ? saver.pause(*tag) : saver.pause(); },
          "tag"_a = nb::none(), release_gil(), "Pause one tag, or every active tag when tag is None.")
      .def(
          "resume",
          [](Saver& saver, const std::optional<std::string>& tag) { tag ? saver.resume(*tag) : saver.resume(); },
          "tag"_a = nb::none(), release_gil(), "Resume one tag, or every paused tag when tag is None.")
      .def(
          "register_backup",
          [](Saver& saver, const std::string& tag,
             const std::vector<std::tuple<std::uintptr_t, std::uintptr_t, std::size_t>>& segments) {
            std::vector<memsaver::BackupSegment> converted;
            for (const auto& [device, host, bytes] : segments) {
              converted.push_back({device, reinterpret_cast<const void*>(host), bytes});
            }
            nb::gil_scoped_release unlocked;
            saver.register_backup(tag, converted);
          },
          "tag"_a, "segments"_a, "segments: (device address, host address, bytes) triples.")
      .def("unregister_backup", [](Saver& saver, const std::string& tag) { saver.unregister_backup(tag); }, "tag"_a)
      .def("stats",
           [](const Saver& saver) {
             nb::list all;
             for (const memsaver::TagStats& stats : saver.stats()) all.append(as_dict(stats));
             return all;
           })
      .def("device_bytes_in_use", [](Saver& saver) { return saver.memory().device_bytes_in_use(); })
      .def_prop_ro("backend", [](Saver& saver) { return saver.memory().name(); })
      .def_prop_ro("granularity", [](Saver& saver) { return saver.memory().granularity(); });
}

}  // namespace deltatrain::python
