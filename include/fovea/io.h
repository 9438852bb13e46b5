// fovea/io.h: whole-file reads and atomic writes (a temporary file in the same folder, fsync, rename),
// so no output of fovea is ever left half-written.
#pragma once
#include <sys/stat.h>

#include <cstddef>
#include <string>

namespace fovea {

constexpr size_t kMaxReadFileBytes = size_t(1) << 30;  // read_file's default bound: 1 GiB

// The whole of a regular file, at most max_bytes long. Throws fovea::Error "<what> '<path>': <reason>"
// for a missing file, a folder, anything that is not a regular file (a FIFO, a device, a socket:
// refused at once, never read, so a FIFO cannot block the caller) and a file over max_bytes
// (refused before any of it is read, or as soon as a growing file passes it).
std::string read_file(const std::string& path, const std::string& what = "file", size_t max_bytes = kMaxReadFileBytes);

// Opens `path` for reading only if it is a regular file: open(O_RDONLY | O_NONBLOCK | O_CLOEXEC), so
// opening a FIFO does not wait for a writer, then fstat. Returns the descriptor (the caller closes
// it) and fills *st; throws fovea::Error "<what> '<path>': is not a regular file" otherwise.
int open_regular_file(const std::string& path, const std::string& what, struct stat* st);
void write_file_atomic(const std::string& path, const std::string& contents, const std::string& what = "file");

}  // namespace fovea
