// Policy of the memory saver: tagged allocations, each in its own reserved range, whose physical memory a
// tag releases at pause() and gets back, at the same addresses, at resume(); what the contents are after
// resume is the tag's backup policy. Built on PhysicalMemory and knows nothing of CUDA.
//
// States and rules (every wrong call throws, none exits, and a failed call changes nothing it reports):
//   allocate under a paused tag          StateError
//   pause a paused tag, resume an active one   StateError
//   pause() / resume() with every tag already in the target state   StateError (no tags at all: nothing to do)
//   an unknown tag, an unknown address, a zero size, a tag reused with another policy   InvalidArgument
//   free of a paused allocation          allowed: releases its address range and its backup (a framework's
//                                        cache may free blocks at any time, so this must not fail)
//   pause of a restore_from tag holding allocations but no registered backup   StateError
//   unregister_backup of a paused tag    StateError (its resume would have nothing to restore from)
// All members are thread-safe; one lock serialises them, including the copies of pause and resume.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "deltatrain/core/allocator.h"
#include "deltatrain/memsaver/physical_memory.h"

namespace deltatrain::memsaver {

enum class Backup {
  None,         // contents undefined after resume (gradients: zeroed every step anyway)
  CpuCopy,      // copied to pinned host memory at pause, restored bitwise at resume (optimizer state)
  RestoreFrom,  // restored from a registered host copy the caller owns (parameters, from the trainer's one
                // pinned weights backup): nothing is copied at pause and the host never holds two copies
};

enum class TagState { Active, Paused };

std::string_view to_string(Backup backup);
std::string_view to_string(TagState state);
// "none", "cpu", "restore_from"; InvalidArgument naming `argument` otherwise.
Backup parse_backup(std::string_view text, const std::string& argument = "backup");

// Allocations made in a region carry its tag; the first allocation under a tag fixes the tag's policy.
struct Region {
  std::string tag;
  Backup backup = Backup::None;
};

// One piece of a registered backup: resume copies `bytes` from `host` to `device`.
struct BackupSegment {
  std::uintptr_t device = 0;
  const void* host = nullptr;
  std::size_t bytes = 0;
};

struct TagStats {
  std::string tag;
  Backup backup = Backup::None;
  TagState state = TagState::Active;
  std::size_t allocations = 0;
  std::uint64_t bytes = 0;           // requested by the allocations
  std::uint64_t reserved_bytes = 0;  // address space, rounded up to the granularity
  std::uint64_t mapped_bytes = 0;    // physical memory held now (0 once paused)
  std::uint64_t backup_bytes = 0;    // bytes a resume restores: copies taken (cpu) or registered (restore_from)
  std::uint64_t host_bytes_held = 0; // host memory the saver keeps for this tag (pinned copies, kept across cycles)
};

struct SaverOptions {
  // Transfers are split into chunks of this size, spread over the backend's lanes.
  std::size_t chunk_bytes = std::size_t{64} << 20;
};

class Saver {
 public:
  explicit Saver(std::unique_ptr<PhysicalMemory> memory, SaverOptions options = {});
  ~Saver();
  Saver(const Saver&) = delete;
  Saver& operator=(const Saver&) = delete;

  // A fresh reserved range of at least `bytes`, mapped and readable/writable, under the region's tag.
  void* allocate(const Region& region, std::size_t bytes);
  // Gives back an allocation (waiting for device work first, as cudaFree does), active or paused.
  void free(void* address);
  // Whether `address` is the start of a live allocation of this saver.
  bool contains(const void* address) const;

  void pause(std::string_view tag);
  void pause();  // every active tag, with one device synchronisation and one wait for all their copies
  void resume(std::string_view tag);
  void resume();  // every paused tag

  // Replaces the tag's registered backup (restore_from tags only). Each segment's device range must lie in
  // one allocation of the tag, and segments must not overlap there. Host memory that is not pinned yet is
  // pinned once here and unpinned when the registration is replaced or dropped; the caller keeps it alive.
  void register_backup(std::string_view tag, const std::vector<BackupSegment>& segments);
  void unregister_backup(std::string_view tag);

  // Allocates now the pinned host copies that pausing a cpu tag fills (otherwise the first pause allocates
  // them, and pinning gigabytes takes seconds): what a loop calls once, before its first phase switch.
  // InvalidArgument for an unknown tag or one that is not a cpu tag.
  void prepare_backups(std::string_view tag);

  std::vector<TagStats> stats() const;  // sorted by tag
  TagStats stats(std::string_view tag) const;

  PhysicalMemory& memory() { return *memory_; }

 private:
  struct Allocation {
    std::string tag;
    std::size_t bytes = 0;
    std::size_t reserved = 0;
    bool mapped = true;
    void* host_copy = nullptr;  // CpuCopy: pinned buffer of `bytes`, allocated at the first pause, then kept
  };
  struct PinnedRange {
    void* host = nullptr;
    bool pinned_here = false;
  };
  struct Tag {
    Backup backup = Backup::None;
    TagState state = TagState::Active;
    std::vector<std::uintptr_t> allocations;
    std::vector<BackupSegment> registered;
    std::vector<PinnedRange> pinned;
  };
  using TagEntry = std::pair<const std::string, Tag>;
  struct Transfer {
    std::byte* mapped;
    std::byte* host;  // the destination of a copy to the host, the source of a copy to the device
    std::size_t bytes;
  };

  TagEntry& find_tag(std::string_view tag);
  const TagEntry& find_tag(std::string_view tag) const;
  std::vector<TagEntry*> tags_in_state(TagState state, std::string_view verb);
  void pause_tags(const std::vector<TagEntry*>& entries);
  void resume_tags(const std::vector<TagEntry*>& entries);
  void copy_chunked(const std::vector<Transfer>& transfers, bool to_host);
  void release_allocation(std::uintptr_t address, Allocation& allocation);
  void drop_registration(Tag& tag);
  TagStats describe(const TagEntry& entry) const;

  std::unique_ptr<PhysicalMemory> memory_;
  SaverOptions options_;
  mutable std::mutex mutex_;
  std::map<std::string, Tag, std::less<>> tags_;
  std::unordered_map<std::uintptr_t, Allocation> allocations_;
};

// An Allocator (core/allocator.h) whose allocations are the saver's under `region`, on `device` (the device
// of the saver's physical memory: the CPU for host pages, the GPU for CUDA VMM). The saver must outlive it.
std::unique_ptr<Allocator> make_allocator(Saver& saver, Region region, Device device);

}  // namespace deltatrain::memsaver
