// Whole-file reads and atomic writes.
#include "fovea/io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "fovea/error.h"

namespace fovea {

std::string read_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail("{} '{}': is a folder, not a file", what, path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{} '{}': cannot open: {}", what, path, std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail("{} '{}': read error", what, path);
  return ss.str();
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
