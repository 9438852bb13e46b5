// Whole-file reads and atomic writes.
#include "fovea/io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cerrno>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>

#include "fovea/error.h"

namespace fovea {

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

bool write_full(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  for (size_t done = 0; done < n;) {
    const ssize_t w = ::write(fd, p + done, n - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return false;
    done += size_t(w);
  }
  return true;
}

ssize_t pread_full(int fd, void* data, size_t n, off_t offset) {
  char* p = static_cast<char*>(data);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, p + done, n - done, offset + off_t(done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -1;
    if (r == 0) break;
    done += size_t(r);
  }
  return ssize_t(done);
}

ReadEnd read_to_end(int fd, std::string& out, size_t max_bytes) {
  // Past the room given, reads go to a small buffer first and are appended only if data comes: a
  // file whose size fstat gave exactly is read without growing `out` (no doubled capacity).
  size_t done = 0;
  char more[1 << 16];
  for (;;) {
    char* dst = done < out.size() ? out.data() + done : more;
    const size_t room = done < out.size() ? out.size() - done : sizeof(more);
    const ssize_t n = ::read(fd, dst, room);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ReadEnd::ERROR;
    if (n == 0) break;
    if (dst == more) out.append(more, size_t(n));
    done += size_t(n);
    if (done > max_bytes) return ReadEnd::TOO_LARGE;
  }
  out.resize(done);  // a file that shrank while being read
  return ReadEnd::OK;
}

Fd open_regular_file(const std::string& path, const std::string& what, struct stat* st) {
  // O_NONBLOCK: open() of a FIFO with no writer would otherwise wait forever; for a regular file it
  // changes nothing. The type is checked on the open descriptor (fstat), not by a stat() before
  // open(), so the file cannot be swapped in between.
  Fd fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  if (!fd) fail("{} '{}': cannot open: {}", what, path, std::strerror(errno));
  if (::fstat(fd.get(), st) != 0) fail("{} '{}': cannot stat: {}", what, path, std::strerror(errno));
  if (S_ISDIR(st->st_mode)) fail("{} '{}': is a folder, not a file", what, path);
  if (!S_ISREG(st->st_mode))
    fail("{} '{}': is not a regular file ({})", what, path,
         S_ISFIFO(st->st_mode)                          ? "a FIFO"
         : S_ISCHR(st->st_mode) || S_ISBLK(st->st_mode) ? "a device"
         : S_ISSOCK(st->st_mode)                        ? "a socket"
                                                        : "not a plain file");
  return fd;
}

std::string read_file(const std::string& path, const std::string& what, size_t max_bytes) {
  struct stat st {};
  const Fd fd = open_regular_file(path, what, &st);
  if (uint64_t(st.st_size) > max_bytes)
    fail("{} '{}': {} bytes, larger than the limit of {} bytes", what, path, uint64_t(st.st_size), max_bytes);
  std::string out(size_t(st.st_size), '\0');
  switch (read_to_end(fd.get(), out, max_bytes)) {
    case ReadEnd::OK: return out;
    case ReadEnd::ERROR: fail("{} '{}': read error: {}", what, path, std::strerror(errno));
    case ReadEnd::TOO_LARGE: break;
  }
  fail("{} '{}': larger than the limit of {} bytes (it grew while being read)", what, path, max_bytes);
}

std::string atomic_temp_prefix(const std::string& name) { return "." + name + ".tmp."; }

namespace {

// A fresh temporary file for `name` in `folder_fd`, created exclusively (O_EXCL: never an existing
// file, nor through a symlink planted under the name); its name goes to *tmp. -1 with errno on failure.
int create_temp(int folder_fd, const std::string& name, std::string* tmp) {
  static constexpr char kChars[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 rng(std::random_device{}());
  for (int attempt = 0; attempt < 100; ++attempt) {
    *tmp = atomic_temp_prefix(name);
    for (int i = 0; i < 6; ++i) *tmp += kChars[rng() % (sizeof(kChars) - 1)];
    const int fd = ::openat(folder_fd, tmp->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  errno = EEXIST;
  return -1;
}

}  // namespace

void write_atomic_at(int folder_fd, const std::string& name, const std::function<bool(int fd)>& write,
                     const std::string& label) {
  std::string tmp;
  Fd fd(create_temp(folder_fd, name, &tmp));
  if (!fd) fail("{}: cannot create a temporary file beside it: {}", label, std::strerror(errno));
  auto abandon = [&](const char* step) {
    const int err = errno;
    fd = Fd();
    ::unlinkat(folder_fd, tmp.c_str(), 0);
    fail("{}: {}: {}", label, step, std::strerror(err));
  };
  if (::fchmod(fd.get(), 0644) != 0) abandon("cannot set permissions");  // readable by others whatever the umask
  if (!write(fd.get())) abandon("write failed");
  if (::fsync(fd.get()) != 0) abandon("fsync failed");
  if (::close(fd.release()) != 0) abandon("close failed");
  if (::renameat(folder_fd, tmp.c_str(), folder_fd, name.c_str()) != 0)
    abandon("cannot move the temporary file into place");
}

void write_file_atomic(const std::string& path, const std::string& contents, const std::string& what) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string label = fmt::format("{} '{}'", what, path);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail("{}: folder '{}' does not exist", label, dir.string());
  if (fs::is_directory(target, ec)) fail("{}: is a folder; give a file name", label);
  const Fd folder(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!folder) fail("{}: cannot open the folder '{}': {}", label, dir.string(), std::strerror(errno));
  write_atomic_at(
      folder.get(), target.filename().string(),
      [&](int fd) { return write_full(fd, contents.data(), contents.size()); }, label);
}

}  // namespace fovea
