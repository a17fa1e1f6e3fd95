// The LD_PRELOAD shim: interception only. It decides which allocations go to the Saver (those made inside a
// region on the calling thread) and forwards everything else to the real CUDA runtime; all policy is the
// Saver's. See include/deltatrain/memsaver/preload.h for the interface and the environment it reads.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "deltatrain/memsaver/preload.h"
#include "deltatrain/memsaver/saver.h"

namespace {

using namespace deltatrain;
using namespace deltatrain::memsaver;

// The innermost open region of this thread; std::nullopt entries are scopes that bypass the saver.
thread_local std::vector<std::optional<Region>> open_regions;
thread_local std::string last_error;

struct Instance {
  Saver* saver = nullptr;
  bool on_device = false;  // CUDA backend: allocations must come from `device`
  int device = 0;
};
std::atomic<Instance*> instance{nullptr};

template <typename Function>
Function runtime_function(const char* name) {
  // Looked up on each use until found: the runtime may be loaded after this library.
  return reinterpret_cast<Function>(::dlsym(RTLD_NEXT, name));
}

int current_device() {
  using GetDevice = cudaError_t (*)(int*);
  int device = 0;
  if (auto get_device = runtime_function<GetDevice>("cudaGetDevice"); get_device && get_device(&device) == cudaSuccess) {
    return device;
  }
  return 0;
}

Instance& process_instance() {
  // Created once and never destroyed: a framework may still free blocks while the process exits.
  static Instance* created = [] {
    const char* backend_variable = std::getenv("DELTATRAIN_MEMSAVER_BACKEND");
    const std::string backend = backend_variable && *backend_variable ? backend_variable : "cuda";
    auto* made = new Instance;
    made->on_device = backend == "cuda";
    made->device = made->on_device ? current_device() : 0;
    try {
      made->saver = new Saver(make_physical_memory(backend, made->device));
    } catch (...) {
      delete made;
      throw;
    }
    instance.store(made, std::memory_order_release);
    return made;
  }();
  return *created;
}

std::optional<Region> parse_region(const char* text) {
  if (!text || !*text) return std::nullopt;
  const std::string value(text);
  const auto colon = value.find(':');
  if (colon == std::string::npos) return Region{value, Backup::None};
  return Region{value.substr(0, colon), parse_backup(value.substr(colon + 1), "DELTATRAIN_MEMSAVER_REGION")};
}

// DELTATRAIN_MEMSAVER_REGION, read once; a malformed value fails every allocation that would use it.
struct ProcessRegion {
  std::optional<Region> region;
  std::string error;
};

const ProcessRegion& process_region() {
  static const ProcessRegion parsed = [] {
    ProcessRegion result;
    try {
      result.region = parse_region(std::getenv("DELTATRAIN_MEMSAVER_REGION"));
    } catch (const Error& error) {
      result.error = error.what();
    }
    return result;
  }();
  return parsed;
}

// The region an allocation on this thread falls in, or none.
const Region* current_region() {
  if (!open_regions.empty()) return open_regions.back() ? &*open_regions.back() : nullptr;
  if (!process_region().error.empty()) throw InvalidArgument("DELTATRAIN_MEMSAVER_REGION", process_region().error);
  return process_region().region ? &*process_region().region : nullptr;
}

std::string require_tag(const char* tag) {
  if (!tag) throw InvalidArgument("tag", "must not be null");
  const std::string text(tag);
  if (text.size() >= DELTATRAIN_MEMSAVER_TAG_CAPACITY) {
    throw InvalidArgument("tag", "must be shorter than " + std::to_string(DELTATRAIN_MEMSAVER_TAG_CAPACITY) +
                                     " bytes, got " + std::to_string(text.size()));
  }
  return text;
}

// Runs body; turns each error type into its status and keeps the message for last_error().
template <typename Body>
int guarded(Body body) {
  try {
    body();
    return DELTATRAIN_MEMSAVER_OK;
  } catch (const OutOfMemory& error) {
    last_error = error.what();
    return DELTATRAIN_MEMSAVER_OUT_OF_MEMORY;
  } catch (const InvalidArgument& error) {
    last_error = error.what();
    return DELTATRAIN_MEMSAVER_INVALID_ARGUMENT;
  } catch (const StateError& error) {
    last_error = error.what();
    return DELTATRAIN_MEMSAVER_STATE_ERROR;
  } catch (const Unavailable& error) {
    last_error = error.what();
    return DELTATRAIN_MEMSAVER_UNAVAILABLE;
  } catch (const std::exception& error) {
    last_error = error.what();
    return DELTATRAIN_MEMSAVER_FAILURE;
  }
}

cudaError_t as_cuda_error(int status) {
  switch (status) {
    case DELTATRAIN_MEMSAVER_OK: return cudaSuccess;
    // The caching allocator frees its cache and retries on this one.
    case DELTATRAIN_MEMSAVER_OUT_OF_MEMORY: return cudaErrorMemoryAllocation;
    case DELTATRAIN_MEMSAVER_INVALID_ARGUMENT: return cudaErrorInvalidValue;
    case DELTATRAIN_MEMSAVER_STATE_ERROR: return cudaErrorNotPermitted;
    case DELTATRAIN_MEMSAVER_UNAVAILABLE: return cudaErrorNotSupported;
    default: return cudaErrorUnknown;
  }
}

std::optional<std::string> optional_tag(const char* tag) {
  return tag ? std::optional<std::string>(require_tag(tag)) : std::nullopt;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) cudaError_t cudaMalloc(void** pointer, size_t bytes) {
  const Region* region = nullptr;
  if (const int status = guarded([&] { region = current_region(); }); status != DELTATRAIN_MEMSAVER_OK) {
    return as_cuda_error(status);
  }
  if (!region || bytes == 0) {
    using Malloc = cudaError_t (*)(void**, size_t);
    const auto real = runtime_function<Malloc>("cudaMalloc");
    return real ? real(pointer, bytes) : cudaErrorInitializationError;
  }
  return as_cuda_error(guarded([&] {
    Instance& process = process_instance();
    if (process.on_device && current_device() != process.device) {
      throw InvalidArgument("device", "the memsaver shim serves device " + std::to_string(process.device) +
                                          " only, got an allocation on device " + std::to_string(current_device()));
    }
    *pointer = process.saver->allocate(*region, bytes);
  }));
}

__attribute__((visibility("default"))) cudaError_t cudaFree(void* pointer) {
  Instance* process = instance.load(std::memory_order_acquire);
  if (pointer && process && process->saver->contains(pointer)) {
    return as_cuda_error(guarded([&] { process->saver->free(pointer); }));
  }
  using Free = cudaError_t (*)(void*);
  const auto real = runtime_function<Free>("cudaFree");
  return real ? real(pointer) : cudaErrorInitializationError;
}

__attribute__((visibility("default"))) int deltatrain_memsaver_abi_version(void) {
  return DELTATRAIN_MEMSAVER_ABI_VERSION;
}

__attribute__((visibility("default"))) int deltatrain_memsaver_region_enter(const char* tag, int backup) {
  return guarded([&] {
    if (!tag) {
      open_regions.emplace_back(std::nullopt);
      return;
    }
    if (backup < DELTATRAIN_MEMSAVER_NONE || backup > DELTATRAIN_MEMSAVER_RESTORE_FROM) {
      throw InvalidArgument("backup", "must be 0 (none), 1 (cpu) or 2 (restore_from), got " + std::to_string(backup));
    }
    Region region{require_tag(tag), static_cast<Backup>(backup)};
    if (region.tag.empty()) throw InvalidArgument("tag", "must not be empty (no tag means every tag)");
    process_instance();
    open_regions.emplace_back(std::move(region));
  });
}

__attribute__((visibility("default"))) int deltatrain_memsaver_region_exit(void) {
  return guarded([] {
    if (open_regions.empty()) throw StateError("no region is open on this thread");
    open_regions.pop_back();
  });
}

__attribute__((visibility("default"))) int deltatrain_memsaver_pause(const char* tag) {
  return guarded([&] {
    const auto name = optional_tag(tag);
    Saver& saver = *process_instance().saver;
    name ? saver.pause(*name) : saver.pause();
  });
}

__attribute__((visibility("default"))) int deltatrain_memsaver_resume(const char* tag) {
  return guarded([&] {
    const auto name = optional_tag(tag);
    Saver& saver = *process_instance().saver;
    name ? saver.resume(*name) : saver.resume();
  });
}

__attribute__((visibility("default"))) int deltatrain_memsaver_register_backup(const char* tag, const uint64_t* device,
                                                                              const uint64_t* host, const uint64_t* bytes,
                                                                              uint64_t count) {
  return guarded([&] {
    if (count > 0 && (!device || !host || !bytes)) {
      throw InvalidArgument("segments", "device, host and bytes must not be null when count is positive");
    }
    std::vector<BackupSegment> segments;
    for (uint64_t i = 0; i < count; ++i) {
      segments.push_back({static_cast<std::uintptr_t>(device[i]), reinterpret_cast<const void*>(host[i]),
                          static_cast<std::size_t>(bytes[i])});
    }
    process_instance().saver->register_backup(require_tag(tag), segments);
  });
}

__attribute__((visibility("default"))) int deltatrain_memsaver_unregister_backup(const char* tag) {
  return guarded([&] { process_instance().saver->unregister_backup(require_tag(tag)); });
}

__attribute__((visibility("default"))) int deltatrain_memsaver_stats(deltatrain_memsaver_tag_stats* out, int capacity,
                                                                    int* count) {
  return guarded([&] {
    if (!count) throw InvalidArgument("count", "must not be null");
    if (capacity > 0 && !out) throw InvalidArgument("out", "must not be null when capacity is positive");
    const std::vector<TagStats> all = process_instance().saver->stats();
    *count = static_cast<int>(all.size());
    for (int i = 0; i < capacity && i < *count; ++i) {
      const TagStats& stats = all[static_cast<std::size_t>(i)];
      deltatrain_memsaver_tag_stats& entry = out[i];
      std::memset(&entry, 0, sizeof entry);
      std::strncpy(entry.tag, stats.tag.c_str(), sizeof entry.tag - 1);
      entry.backup = static_cast<int32_t>(stats.backup);
      entry.paused = stats.state == TagState::Paused;
      entry.allocations = stats.allocations;
      entry.bytes = stats.bytes;
      entry.reserved_bytes = stats.reserved_bytes;
      entry.mapped_bytes = stats.mapped_bytes;
      entry.backup_bytes = stats.backup_bytes;
      entry.host_bytes_held = stats.host_bytes_held;
    }
  });
}

__attribute__((visibility("default"))) int deltatrain_memsaver_device_bytes_in_use(uint64_t* bytes) {
  return guarded([&] {
    if (!bytes) throw InvalidArgument("bytes", "must not be null");
    *bytes = process_instance().saver->memory().device_bytes_in_use();
  });
}

__attribute__((visibility("default"))) const char* deltatrain_memsaver_last_error(void) { return last_error.c_str(); }

}  // extern "C"
