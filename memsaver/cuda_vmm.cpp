// CUDA virtual memory management. The driver is loaded with dlopen, not linked, so that binaries built with
// CUDA start on machines without a driver (CI) and the LD_PRELOAD shim adds no CUDA library to a process.
#include "deltatrain/memsaver/physical_memory.h"

#ifdef DELTATRAIN_WITH_CUDA
#include <cuda.h>
#include <dlfcn.h>

#include <vector>
#endif

namespace deltatrain::memsaver {

#ifdef DELTATRAIN_WITH_CUDA
namespace {

// Names pass through cuda.h's macros before they are looked up (cuMemGetInfo -> cuMemGetInfo_v2), so each
// pointer has the ABI of the declaration it is typed after.
#define DELTATRAIN_STRINGIFY(name) #name
#define DELTATRAIN_SYMBOL(name) DELTATRAIN_STRINGIFY(name)
#define DELTATRAIN_DRIVER_FUNCTIONS(X)                                                                      \
  X(cuInit) X(cuGetErrorName) X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetAttribute)                   \
  X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxGetCurrent) X(cuCtxSetCurrent)           \
  X(cuCtxSynchronize) X(cuMemGetAllocationGranularity) X(cuMemAddressReserve) X(cuMemAddressFree)          \
  X(cuMemCreate) X(cuMemRelease) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuStreamCreate)             \
  X(cuStreamDestroy) X(cuStreamSynchronize) X(cuMemcpyDtoHAsync) X(cuMemcpyHtoDAsync) X(cuMemHostAlloc)   \
  X(cuMemFreeHost) X(cuMemHostRegister) X(cuMemHostUnregister) X(cuMemGetInfo) X(cuPointerGetAttribute)

struct Driver {
#define DELTATRAIN_DECLARE(name) decltype(&::name) name = nullptr;
  DELTATRAIN_DRIVER_FUNCTIONS(DELTATRAIN_DECLARE)
#undef DELTATRAIN_DECLARE
  std::string unavailable_reason;  // empty once loaded and initialised
};

const Driver& driver() {
  static const Driver loaded = [] {
    Driver driver;
    void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!library) {
      driver.unavailable_reason = std::string("the NVIDIA driver library libcuda.so.1 cannot be loaded: ") + ::dlerror();
      return driver;
    }
#define DELTATRAIN_LOAD(name)                                                                    \
  driver.name = reinterpret_cast<decltype(driver.name)>(::dlsym(library, DELTATRAIN_SYMBOL(name))); \
  if (!driver.name && driver.unavailable_reason.empty()) {                                       \
    driver.unavailable_reason = "libcuda.so.1 lacks " DELTATRAIN_SYMBOL(name) " (the driver is too old)"; \
  }
    DELTATRAIN_DRIVER_FUNCTIONS(DELTATRAIN_LOAD)
#undef DELTATRAIN_LOAD
    if (driver.unavailable_reason.empty()) {
      if (const CUresult status = driver.cuInit(0); status != CUDA_SUCCESS) {
        const char* name = nullptr;
        driver.cuGetErrorName(status, &name);
        driver.unavailable_reason = std::string("cuInit failed: ") + (name ? name : "unknown error");
      }
    }
    return driver;
  }();
  return loaded;
}

void check(CUresult status, const char* call) {
  if (status == CUDA_SUCCESS) return;
  const char* name = nullptr;
  driver().cuGetErrorName(status, &name);
  const std::string message =
      std::string(call) + " failed: " + (name ? name : "unknown error") + " (" + std::to_string(status) + ")";
  if (status == CUDA_ERROR_OUT_OF_MEMORY) throw OutOfMemory(message);
  throw Failure(message);
}

CUdeviceptr device_pointer(const void* address) { return reinterpret_cast<CUdeviceptr>(address); }

// Makes a context current for one call and puts the caller's back afterwards: a library call must not
// change which context the calling thread (PyTorch's, say) works in.
class ContextScope {
 public:
  explicit ContextScope(CUcontext context) : context_(context) {
    check(driver().cuCtxGetCurrent(&previous_), "cuCtxGetCurrent");
    if (previous_ != context_) check(driver().cuCtxSetCurrent(context_), "cuCtxSetCurrent");
  }
  ~ContextScope() {
    if (previous_ != context_) driver().cuCtxSetCurrent(previous_);
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  CUcontext context_;
  CUcontext previous_ = nullptr;
};

class CudaVmm final : public PhysicalMemory {
 public:
  CudaVmm(int ordinal, int lanes) {
    if (lanes < 1) throw InvalidArgument("lanes", "must be at least 1, got " + std::to_string(lanes));
    const Driver& api = driver();
    int count = 0;
    check(api.cuDeviceGetCount(&count), "cuDeviceGetCount");
    if (ordinal < 0 || ordinal >= count) {
      throw InvalidArgument("device", "must be in [0, " + std::to_string(count) + "), got " + std::to_string(ordinal));
    }
    check(api.cuDeviceGet(&device_, ordinal), "cuDeviceGet");
    int supported = 0;
    check(api.cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device_),
          "cuDeviceGetAttribute");
    if (!supported) {
      throw Unavailable("the CUDA VMM backend", "device " + std::to_string(ordinal) +
                                                    " does not support virtual memory management");
    }
    properties_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    properties_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    properties_.location.id = ordinal;
    access_.location = properties_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check(api.cuMemGetAllocationGranularity(&granularity_, &properties_, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          "cuMemGetAllocationGranularity");
    check(api.cuDevicePrimaryCtxRetain(&context_, device_), "cuDevicePrimaryCtxRetain");
    try {
      ContextScope scope(context_);
      for (int lane = 0; lane < lanes; ++lane) {
        CUstream stream = nullptr;
        check(api.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        streams_.push_back(stream);
      }
    } catch (const Error&) {
      destroy();
      throw;
    }
  }

  ~CudaVmm() override { destroy(); }

  std::string name() const override { return "cuda"; }
  std::size_t granularity() const override { return granularity_; }
  int lanes() const override { return static_cast<int>(streams_.size()); }

  void* reserve(std::size_t bytes) override {
    CUdeviceptr address = 0;
    check(driver().cuMemAddressReserve(&address, bytes, 0, 0, 0), "cuMemAddressReserve");
    return reinterpret_cast<void*>(address);
  }

  void map(void* address, std::size_t bytes) override {
    const Driver& api = driver();
    ContextScope scope(context_);
    CUmemGenericAllocationHandle handle = 0;
    check(api.cuMemCreate(&handle, bytes, &properties_, 0), "cuMemCreate");
    const CUresult mapped = api.cuMemMap(device_pointer(address), bytes, 0, handle, 0);
    // The mapping holds the physical memory from here on; cuMemUnmap alone gives it back.
    api.cuMemRelease(handle);
    check(mapped, "cuMemMap");
    if (const CUresult status = api.cuMemSetAccess(device_pointer(address), bytes, &access_, 1); status != CUDA_SUCCESS) {
      api.cuMemUnmap(device_pointer(address), bytes);
      check(status, "cuMemSetAccess");
    }
  }

  void unmap(void* address, std::size_t bytes) override {
    check(driver().cuMemUnmap(device_pointer(address), bytes), "cuMemUnmap");
  }

  void release(void* address, std::size_t bytes) override {
    check(driver().cuMemAddressFree(device_pointer(address), bytes), "cuMemAddressFree");
  }

  void synchronize_device() override {
    ContextScope scope(context_);
    check(driver().cuCtxSynchronize(), "cuCtxSynchronize");
  }

  void copy_to_host(void* host, const void* mapped, std::size_t bytes, int lane) override {
    ContextScope scope(context_);
    check(driver().cuMemcpyDtoHAsync(host, device_pointer(mapped), bytes, stream(lane)), "cuMemcpyDtoHAsync");
  }

  void copy_to_device(void* mapped, const void* host, std::size_t bytes, int lane) override {
    ContextScope scope(context_);
    check(driver().cuMemcpyHtoDAsync(device_pointer(mapped), host, bytes, stream(lane)), "cuMemcpyHtoDAsync");
  }

  void wait_for_copies() override {
    ContextScope scope(context_);
    for (CUstream lane : streams_) check(driver().cuStreamSynchronize(lane), "cuStreamSynchronize");
  }

  void* allocate_host(std::size_t bytes) override {
    ContextScope scope(context_);
    void* host = nullptr;
    check(driver().cuMemHostAlloc(&host, bytes, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc");
    return host;
  }

  void free_host(void* host, std::size_t) override {
    ContextScope scope(context_);
    check(driver().cuMemFreeHost(host), "cuMemFreeHost");
  }

  bool pin_host(void* host, std::size_t bytes) override {
    ContextScope scope(context_);
    // Memory the driver already knows (cuMemHostAlloc, torch's pin_memory) needs nothing; registering it
    // again fails with CUDA_ERROR_INVALID_VALUE rather than ..._ALREADY_REGISTERED.
    CUmemorytype type{};
    if (driver().cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, device_pointer(host)) == CUDA_SUCCESS &&
        type == CU_MEMORYTYPE_HOST) {
      return false;
    }
    const CUresult status = driver().cuMemHostRegister(host, bytes, CU_MEMHOSTREGISTER_PORTABLE);
    if (status == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) return false;
    check(status, "cuMemHostRegister");
    return true;
  }

  void unpin_host(void* host) override {
    ContextScope scope(context_);
    check(driver().cuMemHostUnregister(host), "cuMemHostUnregister");
  }

  std::uint64_t device_bytes_in_use() const override {
    ContextScope scope(context_);
    std::size_t free = 0, total = 0;
    check(driver().cuMemGetInfo(&free, &total), "cuMemGetInfo");
    return total - free;
  }

 private:
  CUstream stream(int lane) const {
    if (lane < 0 || lane >= lanes()) {
      throw InvalidArgument("lane", "must be in [0, " + std::to_string(lanes()) + "), got " + std::to_string(lane));
    }
    return streams_[static_cast<std::size_t>(lane)];
  }

  void destroy() noexcept {
    if (!context_) return;
    try {
      ContextScope scope(context_);
      for (CUstream lane : streams_) driver().cuStreamDestroy(lane);
    } catch (const Error&) {
      // Streams die with the context; nothing is lost.
    }
    streams_.clear();
    driver().cuDevicePrimaryCtxRelease(device_);
    context_ = nullptr;
  }

  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  CUmemAllocationProp properties_{};
  CUmemAccessDesc access_{};
  std::size_t granularity_ = 0;
  std::vector<CUstream> streams_;
};

}  // namespace

std::unique_ptr<PhysicalMemory> make_cuda_vmm(int device, int lanes) {
  if (const std::string& reason = driver().unavailable_reason; !reason.empty()) {
    throw Unavailable("the CUDA VMM backend", reason);
  }
  return std::make_unique<CudaVmm>(device, lanes);
}

#else

std::unique_ptr<PhysicalMemory> make_cuda_vmm(int, int) {
  throw Unavailable("the CUDA VMM backend", "this build of deltatrain has no CUDA support");
}

#endif

}  // namespace deltatrain::memsaver
