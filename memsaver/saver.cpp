#include "deltatrain/memsaver/saver.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <sstream>

namespace deltatrain::memsaver {
namespace {

std::string hex(std::uintptr_t value) {
  std::ostringstream text;
  text << "0x" << std::hex << value;
  return text.str();
}

std::string quoted(std::string_view tag) { return "'" + std::string(tag) + "'"; }

}  // namespace

std::string_view to_string(Backup backup) {
  switch (backup) {
    case Backup::None: return "none";
    case Backup::CpuCopy: return "cpu";
    case Backup::RestoreFrom: return "restore_from";
  }
  return "?";
}

std::string_view to_string(TagState state) { return state == TagState::Active ? "active" : "paused"; }

Backup parse_backup(std::string_view text, const std::string& argument) {
  for (Backup backup : {Backup::None, Backup::CpuCopy, Backup::RestoreFrom}) {
    if (text == to_string(backup)) return backup;
  }
  throw InvalidArgument(argument, "must be none, cpu or restore_from, got '" + std::string(text) + "'");
}

Saver::Saver(std::unique_ptr<PhysicalMemory> memory, SaverOptions options)
    : memory_(std::move(memory)), options_(options) {
  if (!memory_) throw InvalidArgument("memory", "must be a PhysicalMemory, got none");
  if (options_.chunk_bytes == 0) throw InvalidArgument("chunk_bytes", "must be positive, got 0");
}

Saver::~Saver() {
  // A destructor cannot report failures; each piece is given back independently of the others.
  try {
    memory_->synchronize_device();
  } catch (const Error&) {
  }
  for (auto& [address, allocation] : allocations_) {
    try {
      release_allocation(address, allocation);
    } catch (const Error&) {
    }
  }
  for (auto& [name, tag] : tags_) drop_registration(tag);
}

void* Saver::allocate(const Region& region, std::size_t bytes) {
  if (region.tag.empty()) throw InvalidArgument("tag", "must not be empty (no tag means every tag)");
  if (bytes == 0) throw InvalidArgument("bytes", "must be positive, got 0");
  std::lock_guard lock(mutex_);
  const std::size_t granularity = memory_->granularity();
  if (bytes > std::numeric_limits<std::size_t>::max() - granularity) {
    throw InvalidArgument("bytes", "is too large to reserve, got " + std::to_string(bytes));
  }
  auto existing = tags_.find(region.tag);
  if (existing != tags_.end()) {
    if (existing->second.backup != region.backup) {
      throw InvalidArgument("backup", "tag " + quoted(region.tag) + " has policy " +
                                          std::string(to_string(existing->second.backup)) +
                                          "; a region under it cannot ask for " + std::string(to_string(region.backup)));
    }
    if (existing->second.state == TagState::Paused) {
      throw StateError("cannot allocate under tag " + quoted(region.tag) + ": it is paused (resume it first)");
    }
  }
  const std::size_t reserved = (bytes + granularity - 1) / granularity * granularity;
  void* address = memory_->reserve(reserved);
  try {
    memory_->map(address, reserved);
  } catch (const Error&) {
    memory_->release(address, reserved);
    throw;
  }
  Tag& tag = existing != tags_.end() ? existing->second : tags_[region.tag];
  tag.backup = region.backup;
  const auto key = reinterpret_cast<std::uintptr_t>(address);
  tag.allocations.push_back(key);
  allocations_.emplace(key, Allocation{region.tag, bytes, reserved, true, nullptr});
  return address;
}

void Saver::free(void* address) {
  const auto key = reinterpret_cast<std::uintptr_t>(address);
  std::lock_guard lock(mutex_);
  auto found = allocations_.find(key);
  if (found == allocations_.end()) {
    throw InvalidArgument("address", hex(key) + " is not the start of a live allocation of this saver");
  }
  Allocation& allocation = found->second;
  if (allocation.mapped) memory_->synchronize_device();
  release_allocation(key, allocation);
  Tag& tag = tags_.find(allocation.tag)->second;
  std::erase(tag.allocations, key);
  // A registered segment inside the freed range has nowhere to be restored to.
  std::erase_if(tag.registered, [&](const BackupSegment& segment) {
    return segment.device >= key && segment.device < key + allocation.reserved;
  });
  allocations_.erase(found);
}

bool Saver::contains(const void* address) const {
  std::lock_guard lock(mutex_);
  return allocations_.contains(reinterpret_cast<std::uintptr_t>(address));
}

void Saver::release_allocation(std::uintptr_t address, Allocation& allocation) {
  auto* pointer = reinterpret_cast<void*>(address);
  if (allocation.mapped) {
    memory_->unmap(pointer, allocation.reserved);
    allocation.mapped = false;
  }
  if (allocation.host_copy) {
    memory_->free_host(allocation.host_copy, allocation.bytes);
    allocation.host_copy = nullptr;
  }
  memory_->release(pointer, allocation.reserved);
}

Saver::TagEntry& Saver::find_tag(std::string_view tag) {
  auto found = tags_.find(tag);
  if (found == tags_.end()) {
    std::string known;
    for (const auto& [name, entry] : tags_) known += (known.empty() ? "" : ", ") + quoted(name);
    throw InvalidArgument("tag", quoted(tag) + " is unknown: no allocation was made under it (known: " +
                                     (known.empty() ? "none" : known) + ")");
  }
  return *found;
}

const Saver::TagEntry& Saver::find_tag(std::string_view tag) const {
  return const_cast<Saver*>(this)->find_tag(tag);
}

std::vector<Saver::TagEntry*> Saver::tags_in_state(TagState state, std::string_view verb) {
  std::vector<TagEntry*> entries;
  for (auto& entry : tags_) {
    if (entry.second.state == state) entries.push_back(&entry);
  }
  if (entries.empty() && !tags_.empty()) {
    throw StateError("nothing to " + std::string(verb) + ": every tag is already " +
                     std::string(to_string(state == TagState::Active ? TagState::Paused : TagState::Active)));
  }
  return entries;
}

void Saver::pause(std::string_view tag) {
  std::lock_guard lock(mutex_);
  TagEntry& entry = find_tag(tag);
  if (entry.second.state == TagState::Paused) throw StateError("tag " + quoted(tag) + " is already paused");
  pause_tags({&entry});
}

void Saver::pause() {
  std::lock_guard lock(mutex_);
  pause_tags(tags_in_state(TagState::Active, "pause"));
}

void Saver::resume(std::string_view tag) {
  std::lock_guard lock(mutex_);
  TagEntry& entry = find_tag(tag);
  if (entry.second.state == TagState::Active) throw StateError("tag " + quoted(tag) + " is not paused");
  resume_tags({&entry});
}

void Saver::resume() {
  std::lock_guard lock(mutex_);
  resume_tags(tags_in_state(TagState::Paused, "resume"));
}

void Saver::prepare_backups(std::string_view tag) {
  std::lock_guard lock(mutex_);
  TagEntry& entry = find_tag(tag);
  if (entry.second.backup != Backup::CpuCopy) {
    throw InvalidArgument("tag", "tag " + quoted(tag) + " has policy " + std::string(to_string(entry.second.backup)) +
                                     "; only cpu tags keep host copies to prepare");
  }
  for (std::uintptr_t address : entry.second.allocations) {
    Allocation& allocation = allocations_.at(address);
    if (!allocation.host_copy) allocation.host_copy = memory_->allocate_host(allocation.bytes);
  }
}

void Saver::pause_tags(const std::vector<TagEntry*>& entries) {
  for (const TagEntry* entry : entries) {
    const Tag& tag = entry->second;
    if (tag.backup == Backup::RestoreFrom && !tag.allocations.empty() && tag.registered.empty()) {
      throw StateError("tag " + quoted(entry->first) +
                       " restores from a registered backup but none is registered: call register_backup() "
                       "before pause(), or its contents would be lost");
    }
  }
  if (entries.empty()) return;
  memory_->synchronize_device();

  std::vector<Allocation*> fresh_copies;  // given back again if this call fails
  std::vector<Transfer> transfers;
  try {
    for (const TagEntry* entry : entries) {
      if (entry->second.backup != Backup::CpuCopy) continue;
      for (std::uintptr_t address : entry->second.allocations) {
        Allocation& allocation = allocations_.at(address);
        if (!allocation.host_copy) {
          allocation.host_copy = memory_->allocate_host(allocation.bytes);
          fresh_copies.push_back(&allocation);
        }
        transfers.push_back({reinterpret_cast<std::byte*>(address), static_cast<std::byte*>(allocation.host_copy),
                             allocation.bytes});
      }
    }
    copy_chunked(transfers, /*to_host=*/true);
  } catch (const Error&) {
    for (Allocation* allocation : fresh_copies) {
      memory_->free_host(allocation->host_copy, allocation->bytes);
      allocation->host_copy = nullptr;
    }
    throw;
  }

  // From here the tags count as paused: should an unmap fail, resume maps back whatever was unmapped.
  for (TagEntry* entry : entries) entry->second.state = TagState::Paused;
  for (const TagEntry* entry : entries) {
    for (std::uintptr_t address : entry->second.allocations) {
      Allocation& allocation = allocations_.at(address);
      if (!allocation.mapped) continue;
      memory_->unmap(reinterpret_cast<void*>(address), allocation.reserved);
      allocation.mapped = false;
    }
  }
}

void Saver::resume_tags(const std::vector<TagEntry*>& entries) {
  std::vector<std::pair<std::uintptr_t, Allocation*>> mapped_here;  // unmapped again if mapping runs out
  try {
    for (const TagEntry* entry : entries) {
      for (std::uintptr_t address : entry->second.allocations) {
        Allocation& allocation = allocations_.at(address);
        if (allocation.mapped) continue;
        memory_->map(reinterpret_cast<void*>(address), allocation.reserved);
        allocation.mapped = true;
        mapped_here.emplace_back(address, &allocation);
      }
    }
  } catch (const Error&) {
    for (auto& [address, allocation] : mapped_here) {
      memory_->unmap(reinterpret_cast<void*>(address), allocation->reserved);
      allocation->mapped = false;
    }
    throw;
  }

  std::vector<Transfer> transfers;
  for (const TagEntry* entry : entries) {
    const Tag& tag = entry->second;
    if (tag.backup == Backup::CpuCopy) {
      for (std::uintptr_t address : tag.allocations) {
        const Allocation& allocation = allocations_.at(address);
        transfers.push_back({reinterpret_cast<std::byte*>(address), static_cast<std::byte*>(allocation.host_copy),
                             allocation.bytes});
      }
    } else if (tag.backup == Backup::RestoreFrom) {
      for (const BackupSegment& segment : tag.registered) {
        // Read only: copies to the device never write the host side.
        transfers.push_back({reinterpret_cast<std::byte*>(segment.device),
                             const_cast<std::byte*>(static_cast<const std::byte*>(segment.host)), segment.bytes});
      }
    }
  }
  // Should a copy fail the tags stay paused and mapped: a second resume() copies again.
  copy_chunked(transfers, /*to_host=*/false);
  for (TagEntry* entry : entries) entry->second.state = TagState::Active;
}

void Saver::copy_chunked(const std::vector<Transfer>& transfers, bool to_host) {
  const int lanes = memory_->lanes();
  int lane = 0;
  try {
    for (const Transfer& transfer : transfers) {
      for (std::size_t offset = 0; offset < transfer.bytes; offset += options_.chunk_bytes) {
        const std::size_t bytes = std::min(options_.chunk_bytes, transfer.bytes - offset);
        if (to_host) {
          memory_->copy_to_host(transfer.host + offset, transfer.mapped + offset, bytes, lane);
        } else {
          memory_->copy_to_device(transfer.mapped + offset, transfer.host + offset, bytes, lane);
        }
        lane = (lane + 1) % lanes;
      }
    }
  } catch (const Error&) {
    try {
      memory_->wait_for_copies();  // nothing may still be in flight when the caller frees or reuses buffers
    } catch (const Error&) {
    }
    throw;
  }
  memory_->wait_for_copies();
}

void Saver::register_backup(std::string_view tag_name, const std::vector<BackupSegment>& segments) {
  std::lock_guard lock(mutex_);
  TagEntry& entry = find_tag(tag_name);
  Tag& tag = entry.second;
  if (tag.backup != Backup::RestoreFrom) {
    throw InvalidArgument("tag", quoted(tag_name) + " has policy " + std::string(to_string(tag.backup)) +
                                     "; only restore_from tags take a registered backup");
  }
  std::vector<std::size_t> order(segments.size());
  std::iota(order.begin(), order.end(), 0);
  for (std::size_t index : order) {
    const BackupSegment& segment = segments[index];
    const std::string name = "segments[" + std::to_string(index) + "]";
    if (segment.bytes == 0) throw InvalidArgument(name + ".bytes", "must be positive, got 0");
    if (!segment.host) throw InvalidArgument(name + ".host", "must not be null");
    const bool inside = std::any_of(tag.allocations.begin(), tag.allocations.end(), [&](std::uintptr_t start) {
      return segment.device >= start && segment.bytes <= allocations_.at(start).bytes &&
             segment.device - start <= allocations_.at(start).bytes - segment.bytes;
    });
    if (!inside) {
      throw InvalidArgument(name + ".device", "[" + hex(segment.device) + ", +" + std::to_string(segment.bytes) +
                                                  ") must lie inside one allocation of tag " + quoted(tag_name));
    }
  }
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return segments[a].device < segments[b].device; });
  for (std::size_t i = 1; i < order.size(); ++i) {
    const BackupSegment& previous = segments[order[i - 1]];
    if (segments[order[i]].device < previous.device + previous.bytes) {
      throw InvalidArgument("segments[" + std::to_string(order[i]) + "].device",
                            "overlaps segments[" + std::to_string(order[i - 1]) + "] on the device");
    }
  }
  std::vector<PinnedRange> pinned;
  try {
    for (const BackupSegment& segment : segments) {
      auto* host = const_cast<void*>(segment.host);
      pinned.push_back({host, memory_->pin_host(host, segment.bytes)});
    }
  } catch (const Error&) {
    for (const PinnedRange& range : pinned) {
      if (range.pinned_here) memory_->unpin_host(range.host);
    }
    throw;
  }
  drop_registration(tag);
  tag.registered = segments;
  tag.pinned = std::move(pinned);
}

void Saver::unregister_backup(std::string_view tag_name) {
  std::lock_guard lock(mutex_);
  Tag& tag = find_tag(tag_name).second;
  if (tag.backup != Backup::RestoreFrom) {
    throw InvalidArgument("tag", quoted(tag_name) + " has policy " + std::string(to_string(tag.backup)) +
                                     "; only restore_from tags have a registered backup");
  }
  if (tag.state == TagState::Paused) {
    throw StateError("tag " + quoted(tag_name) + " is paused: its resume needs the registered backup");
  }
  drop_registration(tag);
}

void Saver::drop_registration(Tag& tag) {
  for (const PinnedRange& range : tag.pinned) {
    if (!range.pinned_here) continue;
    try {
      memory_->unpin_host(range.host);
    } catch (const Error&) {
      // The caller's memory stays pinned; that costs speed elsewhere, never correctness.
    }
  }
  tag.pinned.clear();
  tag.registered.clear();
}

TagStats Saver::describe(const TagEntry& entry) const {
  const Tag& tag = entry.second;
  TagStats stats{entry.first, tag.backup, tag.state};
  stats.allocations = tag.allocations.size();
  for (std::uintptr_t address : tag.allocations) {
    const Allocation& allocation = allocations_.at(address);
    stats.bytes += allocation.bytes;
    stats.reserved_bytes += allocation.reserved;
    if (allocation.mapped) stats.mapped_bytes += allocation.reserved;
    if (allocation.host_copy) stats.host_bytes_held += allocation.bytes;
  }
  if (tag.backup == Backup::CpuCopy) stats.backup_bytes = stats.bytes;
  for (const BackupSegment& segment : tag.registered) stats.backup_bytes += segment.bytes;
  return stats;
}

std::vector<TagStats> Saver::stats() const {
  std::lock_guard lock(mutex_);
  std::vector<TagStats> all;
  for (const TagEntry& entry : tags_) all.push_back(describe(entry));
  return all;
}

TagStats Saver::stats(std::string_view tag) const {
  std::lock_guard lock(mutex_);
  return describe(find_tag(tag));
}

namespace {

class TaggedAllocator final : public Allocator {
 public:
  TaggedAllocator(Saver& saver, Region region, Device device)
      : saver_(saver), region_(std::move(region)), device_(device) {}
  void* allocate(std::size_t bytes, const char* what) override {
    try {
      return saver_.allocate(region_, bytes);
    } catch (const OutOfMemory& e) {
      throw OutOfMemory(std::string(what) + " under tag " + quoted(region_.tag) + ": " + e.what());
    }
  }
  void deallocate(void* address) noexcept override {
    try {
      saver_.free(address);
    } catch (const Error&) {
      // Unknown addresses cannot reach here (only this allocator's own are given back); a failed unmap in a
      // destructor has nobody to tell.
    }
  }
  Device device() const override { return device_; }

 private:
  Saver& saver_;
  Region region_;
  Device device_;
};

}  // namespace

std::unique_ptr<Allocator> make_allocator(Saver& saver, Region region, Device device) {
  return std::make_unique<TaggedAllocator>(saver, std::move(region), device);
}

}  // namespace deltatrain::memsaver
