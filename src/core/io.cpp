// Whole-file reads and atomic writes.
#include "fovea/io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>

#include "fovea/error.h"

namespace fovea {

int open_regular_file(const std::string& path, const std::string& what, struct stat* st) {
  // O_NONBLOCK: open() of a FIFO with no writer would otherwise wait forever; for a regular file it
  // changes nothing. The type is checked on the open descriptor (fstat), not by a stat() before
  // open(), so the file cannot be swapped in between.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    fail("{} '{}': cannot open: {}", what, path, std::strerror(err));
  }
  if (::fstat(fd, st) != 0) {
    const int err = errno;
    ::close(fd);
    fail("{} '{}': cannot stat: {}", what, path, std::strerror(err));
  }
  if (S_ISDIR(st->st_mode)) {
    ::close(fd);
    fail("{} '{}': is a folder, not a file", what, path);
  }
  if (!S_ISREG(st->st_mode)) {
    ::close(fd);
    fail("{} '{}': is not a regular file ({})", what, path,
         S_ISFIFO(st->st_mode) ? "a FIFO" : S_ISCHR(st->st_mode) || S_ISBLK(st->st_mode) ? "a device"
                                     : S_ISSOCK(st->st_mode)                              ? "a socket"
                                                                                          : "not a plain file");
  }
  return fd;
}

std::string read_file(const std::string& path, const std::string& what, size_t max_bytes) {
  struct stat st {};
  const int fd = open_regular_file(path, what, &st);
  auto bail = [&](const std::string& message) {
    ::close(fd);
    throw Error(message);
  };
  if (uint64_t(st.st_size) > max_bytes)
    bail(fmt::format("{} '{}': {} bytes, larger than the limit of {} bytes", what, path, uint64_t(st.st_size),
                     max_bytes));
  // st_size bytes, then on until EOF: some regular files (/proc) report size 0, and a file may grow
  // while it is read; the bound holds either way.
  std::string out(size_t(st.st_size), '\0');
  size_t done = 0;
  char more[1 << 16];
  for (;;) {
    char* dst = done < out.size() ? out.data() + done : more;
    const size_t room = done < out.size() ? out.size() - done : sizeof(more);
    const ssize_t n = ::read(fd, dst, room);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) bail(fmt::format("{} '{}': read error: {}", what, path, std::strerror(errno)));
    if (n == 0) break;
    if (dst == more) out.append(more, size_t(n));
    done += size_t(n);
    if (done > max_bytes)
      bail(fmt::format("{} '{}': larger than the limit of {} bytes (it grew while being read)", what, path, max_bytes));
  }
  ::close(fd);
  out.resize(done);  // a file that shrank while being read
  return out;
}

void write_file_atomic(const std::string& path, const std::string& contents, const std::string& what) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail("{} '{}': folder '{}' does not exist", what, path, dir.string());
  if (fs::is_directory(target, ec)) fail("{} '{}': is a folder; give a file name", what, path);
  std::string tmp = (dir / fmt::format(".{}.tmp.XXXXXX", target.filename().string())).string();
  const int fd = mkstemp(tmp.data());
  if (fd < 0) fail("{} '{}': cannot create a temporary file in '{}': {}", what, path, dir.string(), std::strerror(errno));
  auto abandon = [&](const char* step, bool close_fd) {
    const int err = errno;
    if (close_fd) ::close(fd);
    ::unlink(tmp.c_str());
    fail("{} '{}': {}: {}", what, path, step, std::strerror(err));
  };
  if (fchmod(fd, 0644) != 0) abandon("cannot set permissions", true);  // mkstemp made it 0600
  for (size_t done = 0; done < contents.size();) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) abandon("write failed", true);
    done += size_t(n);
  }
  if (::fsync(fd) != 0) abandon("fsync failed", true);
  if (::close(fd) != 0) abandon("close failed", false);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) abandon("cannot move the temporary file into place", false);
}

}  // namespace fovea
