// vLLM's encoder-cache files (see fovea/ec-cache.h).
#include "fovea/ec-cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "fovea/base64.h"
#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/sha256.h"
#include "fovea/json.h"
#include "fovea/safetensors.h"
#include "fovea/threads.h"

namespace fovea {

namespace fs = std::filesystem;

namespace {

constexpr const char* kWriterKey = "writer";
constexpr const char* kWriter = "fovea";
// The temporary files of write_atomic_at (fovea/io.h): a crash's leftovers are recognised by name.
const std::string kTempPrefix = atomic_temp_prefix(kEcCacheFile);
constexpr int64_t kStaleTempNs = int64_t(10) * 60 * 1000000000;  // ten minutes

// Everything below DIR is opened by these two, which follow no symlink: O_NOFOLLOW refuses a
// symlink as the last component, and names are single components (ec_key_problem), so there is no
// other. O_NONBLOCK: a FIFO planted as the file must not block the open.
Fd open_folder_at(int at, const std::string& name) {
  return Fd(::openat(at, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
}
Fd open_file_at(int at, const std::string& name) {
  return Fd(::openat(at, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
}

// Why opening `name` in `at` failed with `err`, in words. O_DIRECTORY | O_NOFOLLOW reports a symlink
// as ENOTDIR, so the name is looked at again (without following it) to say what it is.
std::string refusal(int at, const std::string& name, int err, bool want_folder) {
  struct stat st {};
  const std::string plain = fmt::format("cannot be opened: {}", std::strerror(err));
  if (err == ENOENT || ::fstatat(at, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return plain;
  if (S_ISLNK(st.st_mode)) return "is a symbolic link, and fovea follows none inside the cache folder";
  if (want_folder && !S_ISDIR(st.st_mode)) return "is not a folder";
  if (!want_folder && S_ISDIR(st.st_mode)) return "is a folder, not a file";
  if (!want_folder && !S_ISREG(st.st_mode)) return "is not a regular file";
  return plain;
}

// The entry file of one key as it is now, reached from DIR with no symlink followed: its folder
// and its stat, or no folder / no regular file (gone, a symlink, something else).
struct EntryNow {
  Fd folder;
  std::optional<struct stat> file;
};
EntryNow entry_now(int dir_fd, const std::string& key) {
  EntryNow e{open_folder_at(dir_fd, key), std::nullopt};
  struct stat st {};
  if (e.folder && ::fstatat(e.folder.get(), kEcCacheFile, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode))
    e.file = st;
  return e;
}

// The names in the folder `at` (not "." or "..") into `names`: 0, or the errno of the failure. The
// folder is listed through a descriptor of its own (fdopendir takes it), so `at` stays as it was.
int names_in(int at, std::vector<std::string>& names) {
  Fd fd(::openat(at, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  DIR* d = fd ? ::fdopendir(fd.get()) : nullptr;
  if (!d) return errno;
  fd.release();
  const std::unique_ptr<DIR, int (*)(DIR*)> closing(d, ::closedir);
  for (;;) {
    errno = 0;
    const dirent* e = ::readdir(d);
    if (!e) return errno;
    const std::string_view n = e->d_name;
    if (n != "." && n != "..") names.emplace_back(n);
  }
}

// A safetensors header's length (its first 8 bytes, little-endian), if it is one fovea reads for its
// mark: at most 1 MiB, within the file's `size` bytes.
std::optional<uint64_t> header_length(const uint8_t len8[8], uint64_t size) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | len8[i];
  if (n == 0 || n > (1u << 20) || n + 8 > size) return std::nullopt;
  return n;
}

// Whether a safetensors header (its JSON) says fovea wrote the file (its __metadata__).
bool header_marks_fovea(std::string_view head, const std::string& path) {
  try {
    const nlohmann::json j = parse_json_bounded(head, {}, path);
    const auto m = j.find("__metadata__");
    return m != j.end() && m->is_object() && m->value(kWriterKey, std::string()) == kWriter;
  } catch (const Error&) {
    return false;
  }
}

// Whether the safetensors file open as `fd` (`st` its fstat) says fovea wrote it. A file that
// cannot be read as one, or with a header over 1 MiB, is not fovea's.
bool written_by_fovea(int fd, const struct stat& st, const std::string& path) {
  uint8_t len8[8];
  if (!S_ISREG(st.st_mode) || ::pread(fd, len8, 8, 0) != 8) return false;
  const std::optional<uint64_t> n = header_length(len8, uint64_t(st.st_size));
  if (!n) return false;
  std::string head(*n, '\0');
  return ::pread(fd, head.data(), *n, 8) == ssize_t(*n) && header_marks_fovea(head, path);
}

// The same, for a whole file read into memory.
bool bytes_by_fovea(std::string_view file, const std::string& path) {
  if (file.size() < 8) return false;
  const std::optional<uint64_t> n = header_length(reinterpret_cast<const uint8_t*>(file.data()), file.size());
  return n && header_marks_fovea(file.substr(8, *n), path);
}

// The two clocks: the steady one orders recency in this process (it never jumps); the wall clock is
// what mtimes are, for the entries the start-up scan finds.
int64_t steady_ns() {
  using namespace std::chrono;
  return duration_cast<nanoseconds>(steady_clock::now().time_since_epoch()).count();
}
int64_t wall_ns() {
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  return int64_t(now.tv_sec) * 1000000000 + now.tv_nsec;
}

int64_t mtime_ns(const struct stat& st) { return int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec; }

// Removes the crash leftovers in one key's folder: regular temporary files older than ten minutes
// (a live writer's fresh one stays; a symlink with that name is not ours and is left alone).
void remove_stale_temps(int folder_fd) {
  std::vector<std::string> names;
  if (names_in(folder_fd, names) != 0) return;
  const int64_t now_ns = wall_ns();
  for (const std::string& name : names) {
    struct stat st {};
    if (name.rfind(kTempPrefix, 0) != 0 || ::fstatat(folder_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (S_ISREG(st.st_mode) && now_ns - mtime_ns(st) > kStaleTempNs) ::unlinkat(folder_fd, name.c_str(), 0);
  }
}

// An entry's file before it is written: the safetensors head, then the one tensor's rows (merger
// output, then each deepstack output), interleaved a few rows at a time into a small buffer as they
// are written. The server writes one per image (67 MB for the 8B model at FullHD) on the reply's
// path: a whole-file buffer would cost a fresh 67 MB of page faults per image, more than the write.
struct EntryFile {
  std::string head;
  const Bf16Rows* rows = nullptr;
  size_t O = 0, parts = 0, count = 0;  // row width per part, parts, rows
  int64_t size() const { return int64_t(head.size() + count * O * parts * 2); }
  bool write_to(int fd) const {
    if (!write_full(fd, head.data(), head.size())) return false;
    const size_t row_bytes = O * parts * 2, step = std::max<size_t>(1, (size_t(2) << 20) / row_bytes);
    thread_local std::vector<char> chunk;  // reused: its pages are touched once per thread
    chunk.resize(step * row_bytes);
    for (size_t r0 = 0; r0 < count; r0 += step) {
      const size_t n = std::min(step, count - r0);
      for (size_t r = 0; r < n; ++r)
        for (size_t p = 0; p < parts; ++p) {
          const std::span<const uint16_t> src = p == 0 ? rows->merged : rows->deepstack[p - 1];
          std::memcpy(chunk.data() + r * row_bytes + p * O * 2, src.data() + (r0 + r) * O, O * 2);
        }
      if (!write_full(fd, chunk.data(), n * row_bytes)) return false;
    }
    return true;
  }
};

// Writes the entry file in `folder_fd` atomically; on failure fovea::Error names `path`.
void write_entry(int folder_fd, const std::string& path, const EntryFile& entry) {
  write_atomic_at(
      folder_fd, kEcCacheFile, [&](int fd) { return entry.write_to(fd); },
      fmt::format("encoder cache file '{}'", path));
}

// Refuses to replace what must not be replaced at the entry's name: a symlink (another writer's, and
// possibly a trap) or a folder. A regular file there is replaced (an older entry for the key). A
// symlink planted after this check is replaced by the rename, which never follows it.
void check_entry_name(int folder_fd, const std::string& path) {
  struct stat st {};
  if (::fstatat(folder_fd, kEcCacheFile, &st, AT_SYMLINK_NOFOLLOW) != 0) return;  // not there: fine
  if (S_ISLNK(st.st_mode))
    fail("encoder cache file '{}': is a symbolic link; fovea neither writes through nor replaces one", path);
  if (S_ISDIR(st.st_mode)) fail("encoder cache file '{}': is a folder, not a file", path);
}

// The whole entry file open as `fd`, at most max_bytes long; `path` names it in errors.
std::string read_all(int fd, const std::string& path, size_t max_bytes) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail("encoder cache file '{}': cannot stat: {}", path, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail("encoder cache file '{}': is not a regular file", path);
  if (uint64_t(st.st_size) > max_bytes)
    fail("encoder cache file '{}': {} bytes, larger than the limit of {} bytes", path, uint64_t(st.st_size), max_bytes);
  std::string out(size_t(st.st_size), '\0');
  // On until EOF: a file may have grown since fstat; the bound holds either way.
  const ReadEnd r = read_to_end(fd, out, max_bytes);
  if (r == ReadEnd::ERROR) fail("encoder cache file '{}': read error: {}", path, std::strerror(errno));
  if (r == ReadEnd::TOO_LARGE)
    fail("encoder cache file '{}': larger than the limit of {} bytes (it grew while being read)", path, max_bytes);
  return out;
}

// DIR, made if missing and opened once. Its own path may pass through symlinks (the operator's
// choice); only what is below it is untrusted.
Fd open_cache_folder(const std::string& dir, int64_t max_bytes) {
  if (max_bytes < 0) fail("encoder cache: a byte budget of {} (0 means no bound)", max_bytes);
  std::error_code ec;
  fs::create_directories(dir, ec);
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd)
    fail("encoder cache '{}': not a folder and cannot be made one ({})", dir, ec ? ec.message() : std::strerror(errno));
  return fd;
}

// The key's folder, made if missing (*made: whether this call made it), opened with no symlink
// followed: a symlink or a plain file under the key's name is refused, never written through.
Fd make_key_folder(int dir_fd, const std::string& dir, const std::string& key, bool* made) {
  const std::string folder = (fs::path(dir) / key).string();
  *made = ::mkdirat(dir_fd, key.c_str(), 0777) == 0;
  if (!*made && errno != EEXIST) fail("encoder cache: cannot make the folder '{}': {}", folder, std::strerror(errno));
  Fd fd = open_folder_at(dir_fd, key);
  if (!fd) {
    const std::string why = refusal(dir_fd, key, errno, true);
    if (*made) ::unlinkat(dir_fd, key.c_str(), AT_REMOVEDIR);
    fail("encoder cache: '{}' {}; fovea does not write there", folder, why);
  }
  return fd;
}

// Writes `key`'s entry file, making its folder if missing; returns the folder. Nothing of a failed
// write stays: its folder goes too if this call made it (rmdir removes it only while empty, so
// whatever another writer put there meanwhile keeps it).
Fd write_key(int dir_fd, const std::string& dir, const std::string& key, const std::string& path,
             const EntryFile& entry) {
  bool made = false;
  Fd folder = make_key_folder(dir_fd, dir, key, &made);
  try {
    check_entry_name(folder.get(), path);
    write_entry(folder.get(), path, entry);
  } catch (...) {
    if (made) ::unlinkat(dir_fd, key.c_str(), AT_REMOVEDIR);
    throw;
  }
  return folder;
}

// The whole entry file of `key`, at most max_bytes, reached from DIR with no symlink followed.
std::string read_entry(int dir_fd, const std::string& dir, const std::string& key, size_t max_bytes) {
  const fs::path folder_path = fs::path(dir) / key;
  const std::string path = (folder_path / kEcCacheFile).string();
  const Fd folder = open_folder_at(dir_fd, key);
  if (!folder) {
    const int err = errno;
    fail("encoder cache file '{}': '{}' {}", path, folder_path.string(), refusal(dir_fd, key, err, true));
  }
  const Fd file = open_file_at(folder.get(), kEcCacheFile);
  if (!file) {
    const int err = errno;
    fail("encoder cache file '{}': {}", path, refusal(folder.get(), kEcCacheFile, err, false));
  }
  return read_all(file.get(), path, max_bytes);
}

}  // namespace

std::string ec_key_problem(std::string_view key) {
  if (key.empty()) return "it is empty";
  if (key.size() > 255) return fmt::format("it is {} bytes long, more than 255", key.size());
  if (key == "." || key == "..") return fmt::format("'{}' is not a folder name", key);
  for (const char c : key) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '/' || c == '\\') return fmt::format("it contains '{}' (a key is one folder name)", c);
    if (u < 0x20 || u == 0x7F) return fmt::format("it contains the control byte 0x{:02X}", unsigned(u));
  }
  return "";
}

void check_ec_min_age(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0)
    fail(
        "--ec-storage-min-age {}: not a number of seconds of at least 0 (0: cache files get no protection "
        "from eviction)",
        seconds);
}

namespace {

// The entry file for one input's rows (checked: whole rows, deepstack outputs as long as the merger's).
EntryFile entry_file(const Bf16Rows& t, const qwen3vl::GridThw& grid, const qwen3vl::VisionConfig& c,
                     const std::string& path) {
  EntryFile e{{}, &t, size_t(c.out_hidden), 1 + t.deepstack.size(), 0};
  if (e.O == 0 || t.merged.size() % e.O != 0) fail("encoder cache: {} values are not rows of {}", t.merged.size(), e.O);
  e.count = t.merged.size() / e.O;
  for (const auto& d : t.deepstack)
    if (d.size() != t.merged.size())
      fail("encoder cache: a deepstack output has {} values, not {}", d.size(), t.merged.size());
  const TensorToWrite tensor{kEcCacheTensor, DType::BF16, {int64_t(e.count), int64_t(e.O * e.parts)}, {}, {}};
  const std::map<std::string, std::string> meta = {
      {kWriterKey, kWriter},
      {"grid_thw", fmt::format("[{}, {}, {}]", grid[0], grid[1], grid[2])},
      {"layout", "merger output, then deepstack 0..k-1, along the last dimension"}};
  size_t data = 0;
  e.head = safetensors_header(path, {tensor}, meta, &data);
  return e;
}

// min_age in nanoseconds, checked; beyond 1e9 s (31 years) it is forever, and the clocks' int64 stays
// far from overflowing.
int64_t min_age_ns(double seconds) {
  check_ec_min_age(seconds);
  return int64_t(std::min(seconds, 1e9) * 1e9);
}

}  // namespace

EcCache::EcCache(std::string dir, int64_t max_bytes, double min_age_s)
    : dir_(std::move(dir)),
      max_bytes_(max_bytes),
      min_age_ns_(min_age_ns(min_age_s)),
      dir_fd_(open_cache_folder(dir_, max_bytes)) {
  scan();
  std::lock_guard lk(mu_);
  if (max_bytes_ != 0 && book_.bytes > max_bytes_) {
    recheck();
    stats_.young_kept += evict_for("", 0, /*dry=*/false);  // young ones stay, even over the budget
  }
}

EcCache::~EcCache() = default;

std::string EcCache::path_of(const std::string& key) const { return (fs::path(dir_) / key / kEcCacheFile).string(); }

void EcCache::scan() {
  std::vector<std::string> names;
  if (const int err = names_in(dir_fd_.get(), names); err != 0)
    fail("encoder cache '{}': cannot read the folder: {}", dir_, std::strerror(err));
  std::vector<Found> found;
  for (const std::string& key : names) scan_key(key, found);
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.mtime_ns < b.mtime_ns; });
  if (!found.empty()) last_stamp_ns_ = found.back().mtime_ns;
  // Each file's age is its mtime's (stamped at its last write or hit) on the wall clock, carried to
  // the steady clock; a future mtime (another host's clock) counts as now, not as years of youth.
  const int64_t steady = steady_ns(), wall = wall_ns();
  for (const Found& f : found) book_.add(f.key, f.bytes, steady - std::max<int64_t>(0, wall - f.mtime_ns));
}

// One name in DIR at start-up. A real folder named like a key has its crash leftovers removed and
// its file, if a regular one, counted as fovea's or another writer's; a symlink (to a folder or to
// a file) is skipped, never followed, and so is anything else.
void EcCache::scan_key(const std::string& key, std::vector<Found>& found) {
  if (!ec_key_problem(key).empty()) return;
  const Fd folder = open_folder_at(dir_fd_.get(), key);
  if (!folder) return;  // a symlink, a plain file, or gone meanwhile (another process evicting)
  remove_stale_temps(folder.get());
  const Fd file = open_file_at(folder.get(), kEcCacheFile);
  struct stat st {};
  if (!file || ::fstat(file.get(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  if (written_by_fovea(file.get(), st, path_of(key)))
    found.push_back({key, int64_t(st.st_size), mtime_ns(st)});
  else
    book_.foreign.insert(key);
}

void EcCache::Book::add(const std::string& key, int64_t n, int64_t used_ns) {
  forget(key);
  own[key] = {n, ++tick, used_ns};
  by_age[tick] = key;
  bytes += n;
}

void EcCache::Book::touch(const std::string& key, int64_t used_ns) {
  Entry& e = own.at(key);
  by_age.erase(e.tick);
  e.tick = ++tick;
  e.used_ns = used_ns;
  by_age[e.tick] = key;
}

void EcCache::Book::forget(const std::string& key) {
  foreign.erase(key);
  const auto it = own.find(key);
  if (it == own.end()) return;
  bytes -= it->second.bytes;
  by_age.erase(it->second.tick);
  own.erase(it);
}

void EcCache::stamp(int folder_fd) {
  const int64_t ns = std::max(wall_ns(), last_stamp_ns_ + 1000);
  last_stamp_ns_ = ns;
  const timespec times[2] = {{ns / 1000000000, ns % 1000000000}, {ns / 1000000000, ns % 1000000000}};
  // Best effort: only the order after a restart rests on it. AT_SYMLINK_NOFOLLOW: a symlink put in
  // the file's place meanwhile gets its own time changed, never its target's.
  ::utimensat(folder_fd, kEcCacheFile, times, AT_SYMLINK_NOFOLLOW);
}

// The accounting rule's re-check (fovea/ec-cache.h): every entry's file looked at once, without
// following symlinks; what is gone (or no longer a regular file there) leaves the books, and
// fovea's files count at their size now.
void EcCache::recheck() const {
  // At most once a second: a full cache under load stores often, and each store would otherwise
  // walk every entry (quadratic), as would a scrape storm.
  const int64_t now_ns = steady_ns();
  if (last_recheck_ns_ && now_ns - last_recheck_ns_ < kRecheckNs) return;
  last_recheck_ns_ = now_ns;
  std::vector<std::string> gone, gone_foreign;
  for (auto& [key, e] : book_.own) {
    const EntryNow now = entry_now(dir_fd_.get(), key);
    if (!now.file) {
      gone.push_back(key);
      continue;
    }
    book_.bytes += int64_t(now.file->st_size) - e.bytes;
    e.bytes = int64_t(now.file->st_size);
  }
  for (const std::string& key : book_.foreign)
    if (!entry_now(dir_fd_.get(), key).file) gone_foreign.push_back(key);
  for (const std::string& key : gone) forget_vanished(key);
  for (const std::string& key : gone_foreign) book_.forget(key);
}

void EcCache::forget_vanished(const std::string& key) const {
  book_.forget(key);
  stats_.vanished += 1;
}

int64_t EcCache::held_with(const std::string& key, int64_t size) const {
  const auto it = book_.own.find(key);
  return book_.bytes - (it == book_.own.end() ? 0 : it->second.bytes) + pending_bytes_ + size;
}

// The bytes of fovea's entries other than `key` that no eviction may free now: the young ones and
// those another store is replacing, beside the stores in flight. Young entries are the most recent
// (recency and use times rise together), so that walk goes back from the newest and stops at the
// first old one.
int64_t EcCache::kept_bytes(const std::string& key) const {
  const int64_t now = steady_ns();
  int64_t n = pending_bytes_;
  for (auto it = book_.by_age.rbegin(); it != book_.by_age.rend(); ++it) {
    const Book::Entry& e = book_.own.at(it->second);
    if (!young(e, now)) break;
    if (it->second != key) n += e.bytes;
  }
  for (const auto& [k, stores] : writing_)
    if (const auto it = book_.own.find(k); k != key && it != book_.own.end() && !young(it->second, now))
      n += it->second.bytes;
  return n;
}

// The eviction rule's decision for a store of `size` bytes as `key` (fovea/ec-cache.h): fits, fits
// once old entries go (they go now, before the write), or refused with nothing evicted.
void EcCache::make_room(const std::string& key, int64_t size) {
  if (max_bytes_ == 0 || held_with(key, size) <= max_bytes_) return;
  recheck();  // files others deleted free the budget before any of fovea's goes
  const int64_t kept = kept_bytes(key);
  if (kept > 0 && kept + size > max_bytes_) refuse(key, size, kept);
  stats_.young_kept += evict_for(key, size, /*dry=*/false);
}

// Walks fovea's entries least recently used first, as plain LRU would to fit `size` bytes as `key`,
// and returns how many of those it would take are young (kept). Unless `dry`, evicts the old ones
// it takes. Skipped: `key` (replaced by the store) and entries being written by other stores.
uint64_t EcCache::evict_for(const std::string& key, int64_t size, bool dry) {
  const int64_t now = steady_ns();
  int64_t passed = 0;  // bytes of the entries taken but not evicted
  uint64_t kept = 0;
  for (auto it = book_.by_age.begin(); it != book_.by_age.end() && held_with(key, size) - passed > max_bytes_;) {
    const std::string k = (it++)->second;  // on first: evict() erases k's place in by_age
    if (k == key || writing_.count(k)) continue;
    const Book::Entry& e = book_.own.at(k);
    if (young(e, now) || dry) {
      kept += young(e, now);
      passed += e.bytes;
    } else {
      evict(k);
    }
  }
  return kept;
}

void EcCache::refuse(const std::string& key, int64_t size, int64_t kept) {
  stats_.refused += 1;
  stats_.young_kept += evict_for(key, size, /*dry=*/true);
  throw EcCacheFull(fmt::format(
      "encoder cache: not storing '{}' ({} bytes): fovea's files used less than {:g} s ago (and stores in flight) "
      "hold {} bytes of the budget of {} bytes (--ec-storage-max-bytes), and --ec-storage-min-age keeps them (vLLM "
      "may not have loaded them yet); nothing was written or evicted. Raise --ec-storage-max-bytes, or lower "
      "--ec-storage-min-age",
      path_of(key), size, double(min_age_ns_) / 1e9, kept, max_bytes_));
}

// Deletes one of fovea's entries after reading, through a descriptor, that the file there is still a
// regular file fovea wrote. One replaced by another writer's joins theirs (never deleted); one gone,
// or now a symlink or inside one, only leaves the books.
void EcCache::evict(const std::string& key) {
  const std::string path = path_of(key);
  const Fd folder = open_folder_at(dir_fd_.get(), key);
  const Fd file = folder ? open_file_at(folder.get(), kEcCacheFile) : Fd();
  struct stat st {
  }, named{};
  const bool regular = file && ::fstat(file.get(), &st) == 0 && S_ISREG(st.st_mode);
  const bool ours = regular && written_by_fovea(file.get(), st, path);
  // POSIX has no unlink through a descriptor: checking that the name still holds the file just read
  // narrows the window in which another writer's rename could put its own file there; it cannot
  // close it.
  const bool still = ours && ::fstatat(folder.get(), kEcCacheFile, &named, AT_SYMLINK_NOFOLLOW) == 0 &&
                     named.st_dev == st.st_dev && named.st_ino == st.st_ino;
  if (!still) {
    forget_vanished(key);  // gone, or replaced by another writer (not by fovea: its own writes are skipped)
    if (regular && !ours) book_.foreign.insert(key);
    return;
  }
  book_.forget(key);
  if (::unlinkat(folder.get(), kEcCacheFile, 0) != 0) {
    warn(fmt::format("encoder cache: cannot evict '{}': {}", path, std::strerror(errno)));
    return;
  }
  ::unlinkat(dir_fd_.get(), key.c_str(), AT_REMOVEDIR);  // the folder, if nothing else is in it (a symlink is not one)
  stats_.evictions += 1;
}

bool EcCache::lookup(const std::string& key) {
  // A key that cannot name an entry is a miss: looked up, ".." or "a/b" would leave the folder.
  EntryNow now;
  if (ec_key_problem(key).empty()) now = entry_now(dir_fd_.get(), key);
  std::lock_guard lk(mu_);
  if (!now.file) {
    if (book_.own.count(key)) forget_vanished(key);  // removed by someone else, or nothing fovea reads
    book_.forget(key);
    stats_.misses += 1;
    return false;
  }
  stats_.hits += 1;
  if (book_.own.count(key)) {
    book_.touch(key, steady_ns());  // young again: vLLM checks it now and loads it later
    stamp(now.folder.get());
  } else {
    book_.foreign.insert(key);  // another writer's file
  }
  return true;
}

void EcCache::store(const std::string& key, const Bf16Rows& t, const qwen3vl::GridThw& grid,
                    const qwen3vl::VisionConfig& c) {
  if (const std::string why = ec_key_problem(key); !why.empty())
    fail("encoder cache key {}: {}", quote_for_error(key), why);
  const std::string path = path_of(key);
  // The file's exact size is known before anything is written: it decides whether it may be.
  const EntryFile entry = entry_file(t, grid, c, path);
  const int64_t size = entry.size();
  const auto done = [&] {  // with mu_ held: the store's reservation returned
    pending_bytes_ -= size;
    if (--writing_[key] == 0) writing_.erase(key);
  };
  {
    std::lock_guard lk(mu_);
    make_room(key, size);  // EcCacheFull: nothing written, nothing evicted
    pending_bytes_ += size;
    writing_[key] += 1;
  }
  Fd folder;
  try {
    folder = write_key(dir_fd_.get(), dir_, key, path, entry);
  } catch (...) {
    std::lock_guard lk(mu_);
    done();
    throw;
  }
  std::lock_guard lk(mu_);
  done();
  book_.add(key, size, steady_ns());
  stamp(folder.get());
  stats_.writes += 1;
}

EcEntry EcCache::load(const std::string& key, const qwen3vl::GridThw& grid, const qwen3vl::VisionConfig& c,
                      bool with_deepstack) const {
  EcEntry e;
  bool marked = false;
  try {
    e = read_back(key, grid, c, with_deepstack, &marked);
  } catch (...) {
    note_load(key, false, false);
    throw;
  }
  note_load(key, true, marked);
  return e;
}

// What a load tells of the books: a failure is counted, and if fovea's file is gone that is looked
// at (outside the lock) and counted too; a file of fovea's read back without its mark was replaced
// by another writer's, which joins theirs.
void EcCache::note_load(const std::string& key, bool loaded, bool marked) const {
  const bool gone = !loaded && ec_key_problem(key).empty() && !entry_now(dir_fd_.get(), key).file;
  std::lock_guard lk(mu_);
  if (!loaded) stats_.load_failures += 1;
  if (!book_.own.count(key) || !(gone || (loaded && !marked))) return;
  forget_vanished(key);
  if (loaded) book_.foreign.insert(key);
}

EcEntry EcCache::read_back(const std::string& key, const qwen3vl::GridThw& grid, const qwen3vl::VisionConfig& c,
                           bool with_deepstack, bool* marked) const {
  if (const std::string why = ec_key_problem(key); !why.empty())
    fail("encoder cache key {}: {}", quote_for_error(key), why);
  const int64_t tokens = visual_tokens(c, grid), O = c.out_hidden, parts = 1 + int64_t(c.deepstack.size());
  const int64_t width = O * parts;
  const std::string path = path_of(key);
  const std::string bytes = read_entry(dir_fd_.get(), dir_, key, size_t(tokens * width * 2) + (1 << 20));
  *marked = bytes_by_fovea(bytes, path);
  const std::vector<TensorInfo> ts =
      parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path);
  if (ts.size() != 1 || ts[0].name != kEcCacheTensor)
    fail("encoder cache file '{}': holds {} tensor(s), not the one tensor '{}'", path, ts.size(), kEcCacheTensor);
  const TensorInfo& t = ts[0];
  if (t.dtype != DType::BF16 || t.shape != std::vector<int64_t>{tokens, width})
    fail("encoder cache file '{}': '{}' is {} [{}], not BF16 [{}, {}]", path, kEcCacheTensor, dtype_str(t.dtype),
         fmt::join(t.shape, ", "), tokens, width);
  // Row r holds part p at columns [p * O, (p + 1) * O); the entry holds part p's rows one after another.
  const int64_t kept = with_deepstack ? parts : 1;
  const auto* all = reinterpret_cast<const uint16_t*>(t.data);
  EcEntry e;
  e.values.resize(size_t(tokens * O * kept));
  for (int64_t p = 0; p < kept; ++p)
    for (int64_t r = 0; r < tokens; ++r)
      std::memcpy(e.values.data() + (p * tokens + r) * O, all + r * width + p * O, size_t(O) * 2);
  const std::span<const uint16_t> v(e.values);
  e.rows.merged = v.subspan(0, size_t(tokens * O));
  for (int64_t p = 1; p < kept; ++p) e.rows.deepstack.push_back(v.subspan(size_t(p * tokens * O), size_t(tokens * O)));
  return e;
}

EcCache::Stats EcCache::stats() const {
  std::lock_guard lk(mu_);
  recheck();
  Stats s = stats_;
  s.bytes = book_.bytes;
  s.files = int64_t(book_.own.size());
  s.foreign_files = int64_t(book_.foreign.size());
  return s;
}

std::string data_url_key(const std::string& media_type, const std::vector<uint8_t>& bytes) {
  std::string url = "data:" + media_type + ";base64,";
  base64_append(url, bytes.data(), bytes.size());
  return sha256_hex(url);
}

}  // namespace fovea
