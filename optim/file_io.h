// POSIX file access for checkpoints: every failure is a Failure naming the file and the call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace deltatrain::optim {

class File {
 public:
  // Regular files only (a symlink is followed): a FIFO, a device or a directory is a Failure naming it.
  static File open_read(const std::filesystem::path& path);
  // Fails if the file exists: a checkpoint never overwrites.
  static File create_new(const std::filesystem::path& path);
  static File open_directory(const std::filesystem::path& path);
  ~File();
  File(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::uint64_t size() const;
  void write_all(const void* data, std::size_t bytes);
  // Exactly `bytes` at `offset`; a Failure saying the file is truncated when it ends first.
  void read_exact(void* data, std::size_t bytes, std::uint64_t offset) const;
  // Up to `bytes` at `offset`; 0 at the end of the file.
  std::size_t read_some(void* data, std::size_t bytes, std::uint64_t offset) const;
  void sync();
  // Hints, whose failure changes nothing but speed (fsync reports any I/O error; a read, any missing byte):
  // start writing these bytes back to the disk now rather than at the next fsync (sync_file_range), and start
  // reading these into the page cache now rather than when they are read (posix_fadvise WILLNEED).
  void start_writeback(std::uint64_t offset, std::uint64_t bytes) const;
  void prefetch(std::uint64_t offset, std::uint64_t bytes) const;

 private:
  File(std::filesystem::path path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::filesystem::path path_;
  int fd_ = -1;
};

// Makes a directory's entries (creations, renames) durable.
void sync_directory(const std::filesystem::path& path);

// Renames `from` to `to`, failing (Failure) rather than replacing when `to` exists.
void rename_no_replace(const std::filesystem::path& from, const std::filesystem::path& to);

// Swaps two existing paths (files or directories) in one atomic step: each then names what the other did.
void exchange_paths(const std::filesystem::path& a, const std::filesystem::path& b);

// Creates `path` (Failure if it exists), writes `content` and syncs it: a file of a directory that is itself
// written aside and renamed into place.
void write_new_file(const std::filesystem::path& path, const std::string& content);

// Writes `content` to a temporary file beside `path`, syncs it, renames it over `path`, and syncs
// the directory: readers see the old content or the new, never a mix.
void replace_file_atomically(const std::filesystem::path& path, const std::string& content);

std::string read_text_file(const std::filesystem::path& path);

}  // namespace deltatrain::optim
