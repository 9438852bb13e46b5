// fovea/io.h: whole-file reads and atomic writes (a temporary file in the same folder, fsync, rename),
// so no output of fovea is ever left half-written; and the one owner of a file descriptor, with the
// reads and writes that go on after EINTR, which every room that touches files uses.
#pragma once
#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <string>
#include <utility>

namespace fovea {

constexpr size_t kMaxReadFileBytes = size_t(1) << 30;  // read_file's default bound: 1 GiB

// The whole of a regular file, at most max_bytes long. Throws fovea::Error "<what> '<path>': <reason>"
// for a missing file, a folder, anything that is not a regular file (a FIFO, a device, a socket:
// refused at once, never read, so a FIFO cannot block the caller) and a file over max_bytes
// (refused before any of it is read, or as soon as a growing file passes it).
std::string read_file(const std::string& path, const std::string& what = "file", size_t max_bytes = kMaxReadFileBytes);

// A file descriptor this scope owns: closed when it goes (release() hands it back); move-only.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  void reset();
  int fd_;
};

// Writes all of [data, data + n) to fd, again after EINTR; false (errno set) if a write fails.
bool write_full(int fd, const void* data, size_t n);
// pread of n bytes at `offset`, again after EINTR and short reads, until n bytes or the end of the
// file; the bytes read, or -1 (errno set).
ssize_t pread_full(int fd, void* data, size_t n, off_t offset);
// Reads fd to its end into `out`, whose size is the room to fill first (the size fstat gave: some
// files, /proc's, say 0, and a file may grow while it is read), again after EINTR, never holding
// more than max_bytes + 1 bytes; `out` is cut to what was read.
enum class ReadEnd { OK, ERROR /* errno set */, TOO_LARGE };
ReadEnd read_to_end(int fd, std::string& out, size_t max_bytes);

// Opens `path` for reading only if it is a regular file: open(O_RDONLY | O_NONBLOCK | O_CLOEXEC), so
// opening a FIFO does not wait for a writer, then fstat. Returns the descriptor and fills *st;
// throws fovea::Error "<what> '<path>': is not a regular file" otherwise.
Fd open_regular_file(const std::string& path, const std::string& what, struct stat* st);

// The one atomic writer: `name` in the folder open as `folder_fd` gets what `write` puts into a fresh
// temporary file beside it (".<name>.tmp." and six random characters, created exclusively and never
// through a symlink), after fchmod 0644, fsync and a renameat over the name (which replaces a name and
// never writes through one). `write` returns false with errno set on failure. On any failure the
// temporary file is removed and fovea::Error says "<label>: <step>: <reason>".
void write_atomic_at(int folder_fd, const std::string& name, const std::function<bool(int fd)>& write,
                     const std::string& label);
// The temporary names write_atomic_at uses for `name`: what a crash may leave behind.
std::string atomic_temp_prefix(const std::string& name);
// write_atomic_at for a path: "<what> '<path>'" labels the errors; the folder must exist, and `path`
// must not be a folder.
void write_file_atomic(const std::string& path, const std::string& contents, const std::string& what = "file");

}  // namespace fovea
