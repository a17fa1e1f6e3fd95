// Host pages: the backend that lets every state and policy run without a GPU, with the same contract as
// CUDA VMM. An unmapped range is PROT_NONE, so a stray access faults as it would on the device.
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "deltatrain/memsaver/physical_memory.h"

namespace deltatrain::memsaver {
namespace {

[[noreturn]] void throw_errno(const std::string& call, std::size_t bytes) {
  const int code = errno;
  const std::string message = call + " of " + std::to_string(bytes) + " bytes failed: " + std::strerror(code) +
                              " (errno " + std::to_string(code) + ")";
  if (code == ENOMEM) throw OutOfMemory(message);
  throw Failure(message);
}

void* map_anonymous(void* address, std::size_t bytes, int protection, int flags, const char* call) {
  void* mapped = ::mmap(address, bytes, protection, MAP_PRIVATE | MAP_ANONYMOUS | flags, -1, 0);
  if (mapped == MAP_FAILED) throw_errno(call, bytes);
  return mapped;
}

class HostPages final : public PhysicalMemory {
 public:
  HostPages() : page_(static_cast<std::size_t>(::sysconf(_SC_PAGESIZE))) {}

  std::string name() const override { return "host"; }
  std::size_t granularity() const override { return page_; }
  int lanes() const override { return 1; }

  void* reserve(std::size_t bytes) override {
    check_multiple(bytes);
    void* address = map_anonymous(nullptr, bytes, PROT_NONE, MAP_NORESERVE, "mmap(PROT_NONE)");
    std::lock_guard lock(mutex_);
    reservations_.emplace(static_cast<std::byte*>(address), bytes);
    return address;
  }

  void map(void* address, std::size_t bytes) override {
    check_multiple(bytes);
    map_anonymous(address, bytes, PROT_READ | PROT_WRITE, MAP_FIXED, "mmap(MAP_FIXED)");
    populate(address, bytes);
  }

  void unmap(void* address, std::size_t bytes) override {
    // Replacing the range frees its pages at once (the resident size falls) and keeps the addresses reserved.
    map_anonymous(address, bytes, PROT_NONE, MAP_FIXED | MAP_NORESERVE, "mmap(MAP_FIXED, PROT_NONE)");
  }

  void release(void* address, std::size_t bytes) override {
    if (::munmap(address, bytes) != 0) throw_errno("munmap", bytes);
    std::lock_guard lock(mutex_);
    reservations_.erase(static_cast<std::byte*>(address));
  }

  void synchronize_device() override {}
  void copy_to_host(void* host, const void* mapped, std::size_t bytes, int) override {
    std::memcpy(host, mapped, bytes);
  }
  void copy_to_device(void* mapped, const void* host, std::size_t bytes, int) override {
    std::memcpy(mapped, host, bytes);
  }
  void wait_for_copies() override {}

  void* allocate_host(std::size_t bytes) override {
    void* host = map_anonymous(nullptr, bytes, PROT_READ | PROT_WRITE, 0, "mmap(host copy)");
    populate(host, bytes);
    return host;
  }
  void free_host(void* host, std::size_t bytes) override {
    if (::munmap(host, bytes) != 0) throw_errno("munmap(host copy)", bytes);
  }
  bool pin_host(void*, std::size_t) override { return false; }
  void unpin_host(void*) override {}

  std::uint64_t device_bytes_in_use() const override {
    std::lock_guard lock(mutex_);
    std::uint64_t resident = 0;
    std::vector<unsigned char> pages;
    for (const auto& [address, bytes] : reservations_) {
      pages.resize(bytes / page_);
      if (::mincore(address, bytes, pages.data()) != 0) throw_errno("mincore", bytes);
      for (unsigned char page : pages) resident += (page & 1u) ? page_ : 0;
    }
    return resident;
  }

 private:
  // Fault every page in now, as cuMemCreate commits device memory, in huge pages where the kernel allows
  // them (a fraction of the faults). An error from MADV_POPULATE_WRITE is an allocation that failed.
  static void populate(void* address, std::size_t bytes) {
    ::madvise(address, bytes, MADV_HUGEPAGE);  // advice only: refused where huge pages are off
    if (::madvise(address, bytes, MADV_POPULATE_WRITE) == 0) return;
    if (errno != EINVAL) throw_errno("madvise(MADV_POPULATE_WRITE)", bytes);
    // Kernels before 5.14: touch each page (fresh pages are zero, so writing zero changes nothing).
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    for (std::size_t offset = 0; offset < bytes; offset += page) static_cast<volatile char*>(address)[offset] = 0;
  }

  void check_multiple(std::size_t bytes) const {
    if (bytes == 0 || bytes % page_ != 0) {
      throw InvalidArgument("bytes", "must be a positive multiple of the page size " + std::to_string(page_) +
                                         ", got " + std::to_string(bytes));
    }
  }

  std::size_t page_;
  mutable std::mutex mutex_;
  std::map<std::byte*, std::size_t> reservations_;
};

}  // namespace

std::unique_ptr<PhysicalMemory> make_host_pages() { return std::make_unique<HostPages>(); }

}  // namespace deltatrain::memsaver
