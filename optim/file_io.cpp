#include "file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "deltatrain/core/error.h"

namespace deltatrain::optim {

namespace {

[[noreturn]] void fail(const char* call, const std::filesystem::path& path) {
  throw Failure(std::string(call) + " " + path.string() + " failed: " + std::strerror(errno) + " (errno " +
                std::to_string(errno) + ")");
}

int open_or_fail(const std::filesystem::path& path, int flags, const char* call) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) fail(call, path);
  return fd;
}

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "something else";
}

}  // namespace

File File::open_read(const std::filesystem::path& path) {
  // O_NONBLOCK: opening a FIFO would otherwise wait for a writer, forever. The check then runs on what
  // was opened (a symlink followed), so nothing can swap the file between check and use.
  File file(path, open_or_fail(path, O_RDONLY | O_NONBLOCK, "open"));
  struct stat info {};
  if (::fstat(file.fd_, &info) != 0) fail("fstat", path);
  if (!S_ISREG(info.st_mode)) {
    // A device has no end (/dev/zero hashes forever) and a FIFO blocks: only regular files are read.
    throw Failure("file " + path.string() + " is " + file_kind(info.st_mode) + ", not a regular file");
  }
  const int flags = ::fcntl(file.fd_, F_GETFL);
  if (flags < 0 || ::fcntl(file.fd_, F_SETFL, flags & ~O_NONBLOCK) != 0) fail("fcntl", path);
  return file;
}

File File::create_new(const std::filesystem::path& path) {
  return File(path, open_or_fail(path, O_WRONLY | O_CREAT | O_EXCL, "create"));
}

File File::open_directory(const std::filesystem::path& path) {
  return File(path, open_or_fail(path.empty() ? "." : path, O_RDONLY | O_DIRECTORY, "open directory"));
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

File::File(File&& other) noexcept : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}

std::uint64_t File::size() const {
  struct stat info {};
  if (::fstat(fd_, &info) != 0) fail("fstat", path_);
  return static_cast<std::uint64_t>(info.st_size);
}

void File::write_all(const void* data, std::size_t bytes) {
  const char* cursor = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t wrote = ::write(fd_, cursor, bytes);
    if (wrote < 0) {
      if (errno == EINTR) continue;
      fail("write", path_);
    }
    cursor += wrote;
    bytes -= static_cast<std::size_t>(wrote);
  }
}

std::size_t File::read_some(void* data, std::size_t bytes, std::uint64_t offset) const {
  for (;;) {
    const ssize_t got = ::pread(fd_, data, bytes, static_cast<off_t>(offset));
    if (got >= 0) return static_cast<std::size_t>(got);
    if (errno != EINTR) fail("pread", path_);
  }
}

void File::read_exact(void* data, std::size_t bytes, std::uint64_t offset) const {
  char* cursor = static_cast<char*>(data);
  std::uint64_t at = offset;
  while (bytes > 0) {
    const std::size_t got = read_some(cursor, bytes, at);
    if (got == 0) {
      throw Failure("file " + path_.string() + " is truncated: reading bytes [" + std::to_string(offset) + ", " +
                    std::to_string(at + bytes) + ") but it ends at byte " + std::to_string(size()));
    }
    cursor += got;
    at += got;
    bytes -= got;
  }
}

void File::sync() {
  if (::fsync(fd_) != 0) fail("fsync", path_);
}

void File::start_writeback(std::uint64_t offset, std::uint64_t bytes) const {
  ::sync_file_range(fd_, static_cast<off64_t>(offset), static_cast<off64_t>(bytes), SYNC_FILE_RANGE_WRITE);
}

void File::prefetch(std::uint64_t offset, std::uint64_t bytes) const {
  ::posix_fadvise(fd_, static_cast<off_t>(offset), static_cast<off_t>(bytes), POSIX_FADV_WILLNEED);
}

void sync_directory(const std::filesystem::path& path) {
  File::open_directory(path).sync();
}

void rename_no_replace(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) != 0) {
    throw Failure("rename " + from.string() + " to " + to.string() + " failed: " + std::strerror(errno) + " (errno " +
                  std::to_string(errno) + ")");
  }
}

void exchange_paths(const std::filesystem::path& a, const std::filesystem::path& b) {
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) != 0) {
    throw Failure("exchanging " + a.string() + " and " + b.string() + " failed: " + std::strerror(errno) +
                  " (errno " + std::to_string(errno) + ")");
  }
}

void write_new_file(const std::filesystem::path& path, const std::string& content) {
  File file = File::create_new(path);
  file.write_all(content.data(), content.size());
  file.sync();
}

void replace_file_atomically(const std::filesystem::path& path, const std::string& content) {
  const std::filesystem::path temporary = path.string() + ".tmp";
  std::filesystem::remove(temporary);  // left by a save that was killed
  write_new_file(temporary, content);
  if (std::rename(temporary.c_str(), path.c_str()) != 0) fail("rename to", path);
  sync_directory(path.parent_path());
}

std::string read_text_file(const std::filesystem::path& path) {
  const File file = File::open_read(path);
  std::string text(file.size(), '\0');
  file.read_exact(text.data(), text.size(), 0);
  return text;
}

}  // namespace deltatrain::optim
