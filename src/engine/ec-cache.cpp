// vLLM's encoder-cache files (see fovea/ec-cache.h).
#include "fovea/ec-cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstring>
#include <filesystem>
#include <vector>

#include <fmt/format.h>

#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/json.h"
#include "fovea/safetensors.h"
#include "fovea/threads.h"

namespace fovea {

namespace fs = std::filesystem;

namespace {

constexpr const char* kWriterKey = "writer";
constexpr const char* kWriter = "fovea";
// write_safetensors' temporary files: ".<name>.tmp.XXXXXX" beside the target (fovea/io.h).
const std::string kTempPrefix = std::string(".") + kEcCacheFile + ".tmp.";
constexpr auto kStaleTemp = std::chrono::minutes(10);

// Whether the safetensors file at `path` says fovea wrote it (its header's __metadata__). Any file
// that cannot be read as one, or with a header over 1 MiB, is not fovea's.
bool written_by_fovea(const std::string& path) {
  struct stat st {};
  int fd = -1;
  try {
    fd = open_regular_file(path, "encoder cache file", &st);
  } catch (const Error&) {
    return false;
  }
  uint8_t len8[8];
  bool ours = false;
  if (::pread(fd, len8, 8, 0) == 8) {
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = n << 8 | len8[i];
    if (n > 0 && n <= (1u << 20) && n + 8 <= uint64_t(st.st_size)) {
      std::string head(n, '\0');
      if (::pread(fd, head.data(), n, 8) == ssize_t(n)) {
        try {
          const nlohmann::json j = parse_json_bounded(head, {}, path);
          const auto m = j.find("__metadata__");
          ours = m != j.end() && m->is_object() && m->value(kWriterKey, std::string()) == kWriter;
        } catch (const Error&) {
        }
      }
    }
  }
  ::close(fd);
  return ours;
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

std::vector<uint16_t> ec_cache_rows(const Bf16Rows& t, int out_hidden) {
  const size_t O = size_t(out_hidden), parts = 1 + t.deepstack.size(), W = O * parts;
  if (O == 0 || t.merged.size() % O != 0) fail("encoder cache: {} values are not rows of {}", t.merged.size(), O);
  const size_t rows = t.merged.size() / O;
  for (const auto& d : t.deepstack)
    if (d.size() != t.merged.size()) fail("encoder cache: a deepstack output has {} values, not {}", d.size(), t.merged.size());
  std::vector<uint16_t> out(rows * W);
  parallel_ranges(int64_t(rows), 256, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (size_t p = 0; p < parts; ++p) {
        const std::span<const uint16_t> src = p == 0 ? t.merged : t.deepstack[p - 1];
        std::memcpy(out.data() + size_t(r) * W + p * O, src.data() + size_t(r) * O, O * 2);
      }
  });
  return out;
}

EcCache::EcCache(std::string dir, int64_t max_bytes) : dir_(std::move(dir)), max_bytes_(max_bytes) {
  if (max_bytes_ < 0) fail("encoder cache: a byte budget of {} (0 means no bound)", max_bytes_);
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (!fs::is_directory(dir_, ec)) fail("encoder cache '{}': not a folder and cannot be made one ({})", dir_, ec.message());
  struct Found {
    std::string key;
    int64_t bytes;
    fs::file_time_type mtime;
  };
  std::vector<Found> found;
  const auto now = fs::file_time_type::clock::now();
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    if (!it->is_directory(ec)) continue;
    const std::string key = it->path().filename().string();
    if (!ec_key_problem(key).empty()) continue;
    for (fs::directory_iterator f(it->path(), ec); !ec && f != end; f.increment(ec)) {
      const std::string name = f->path().filename().string();
      if (name.rfind(kTempPrefix, 0) == 0 && f->is_regular_file(ec) && now - f->last_write_time(ec) > kStaleTemp)
        fs::remove(f->path(), ec);
    }
    ec.clear();
    // A file that vanishes while the folder is read (another process evicting) is skipped.
    std::error_code gone;
    const std::string path = path_of(key);
    if (!fs::is_regular_file(path, gone)) continue;
    if (!written_by_fovea(path)) {
      foreign_[key] = true;
      continue;
    }
    const auto bytes = fs::file_size(path, gone);
    const auto mtime = fs::last_write_time(path, gone);
    if (!gone) found.push_back({key, int64_t(bytes), mtime});
  }
  if (ec) fail("encoder cache '{}': cannot read the folder: {}", dir_, ec.message());
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.mtime < b.mtime; });
  if (!found.empty()) {
    const auto newest = std::chrono::file_clock::to_sys(found.back().mtime);
    last_stamp_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(newest.time_since_epoch()).count();
  }
  for (const Found& f : found) {
    own_[f.key] = {f.bytes, ++tick_};
    by_age_[tick_] = f.key;
    stats_.bytes += f.bytes;
  }
  std::lock_guard lk(mu_);
  evict_over_budget("");
}

std::string EcCache::path_of(const std::string& key) const { return (fs::path(dir_) / key / kEcCacheFile).string(); }

void EcCache::touch(const std::string& key) {
  Entry& e = own_.at(key);
  by_age_.erase(e.tick);
  e.tick = ++tick_;
  by_age_[e.tick] = key;
}

void EcCache::stamp(const std::string& path) {
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  const int64_t ns = std::max(int64_t(now.tv_sec) * 1000000000 + now.tv_nsec, last_stamp_ns_ + 1000);
  last_stamp_ns_ = ns;
  const timespec times[2] = {{ns / 1000000000, ns % 1000000000}, {ns / 1000000000, ns % 1000000000}};
  ::utimensat(AT_FDCWD, path.c_str(), times, 0);  // best effort: only the order after a restart rests on it
}

void EcCache::forget(const std::string& key) {
  const auto it = own_.find(key);
  if (it == own_.end()) return;
  stats_.bytes -= it->second.bytes;
  by_age_.erase(it->second.tick);
  own_.erase(it);
}

void EcCache::evict_over_budget(const std::string& keep) {
  while (max_bytes_ > 0 && stats_.bytes > max_bytes_ && !by_age_.empty()) {
    const std::string key = by_age_.begin()->second;
    if (key == keep) {
      if (by_age_.size() == 1) break;  // the newest entry alone is over the budget: kept
      touch(key);
      continue;
    }
    std::error_code ec;
    fs::remove(path_of(key), ec);
    fs::remove(fs::path(dir_) / key, ec);  // the folder, if nothing else is in it
    forget(key);
    stats_.evictions += 1;
  }
  stats_.files = int64_t(own_.size());
  stats_.foreign_files = int64_t(foreign_.size());
}

bool EcCache::lookup(const std::string& key) {
  const std::string path = path_of(key);
  std::error_code ec;
  const bool exists = fs::is_regular_file(path, ec);
  std::lock_guard lk(mu_);
  if (!exists) {
    forget(key);  // removed by someone else
    stats_.misses += 1;
    stats_.files = int64_t(own_.size());
    return false;
  }
  stats_.hits += 1;
  if (own_.count(key)) {
    touch(key);
    stamp(path);
  } else if (!foreign_.count(key)) {
    foreign_[key] = true;  // another writer's file
    stats_.foreign_files = int64_t(foreign_.size());
  }
  return true;
}

void EcCache::store(const std::string& key, const Bf16Rows& t, const qwen3vl::GridThw& grid,
                    const qwen3vl::VisionConfig& c) {
  if (const std::string why = ec_key_problem(key); !why.empty()) fail("encoder cache key {}: {}", quote_for_error(key), why);
  const std::vector<uint16_t> rows = ec_cache_rows(t, c.out_hidden);
  const int64_t width = int64_t(c.out_hidden) * int64_t(1 + t.deepstack.size());
  TensorToWrite tensor{kEcCacheTensor, DType::BF16, {int64_t(rows.size()) / width, width}, {}, {}};
  tensor.view = {reinterpret_cast<const uint8_t*>(rows.data()), rows.size() * 2};
  const std::map<std::string, std::string> meta = {
      {kWriterKey, kWriter}, {"grid_thw", fmt::format("[{}, {}, {}]", grid[0], grid[1], grid[2])},
      {"layout", "merger output, then deepstack 0..k-1, along the last dimension"}};
  std::error_code ec;
  const fs::path folder = fs::path(dir_) / key;
  fs::create_directories(folder, ec);
  if (!fs::is_directory(folder, ec)) fail("encoder cache: cannot make the folder '{}' ({})", folder.string(), ec.message());
  const std::string path = path_of(key);
  write_safetensors(path, {tensor}, meta);  // atomic; throws naming the file
  const int64_t bytes = int64_t(fs::file_size(path, ec));
  std::lock_guard lk(mu_);
  forget(key);
  foreign_.erase(key);
  own_[key] = {bytes, 0};
  touch(key);
  stamp(path);
  stats_.bytes += bytes;
  stats_.writes += 1;
  evict_over_budget(key);
}

EcEntry EcCache::load(const std::string& key, const qwen3vl::GridThw& grid, const qwen3vl::VisionConfig& c,
                      bool with_deepstack) const {
  const int64_t tokens = visual_tokens(c, grid), O = c.out_hidden, parts = 1 + int64_t(c.deepstack.size());
  const int64_t width = O * parts;
  const std::string path = path_of(key);
  const std::string bytes = read_file(path, "encoder cache file", size_t(tokens * width * 2) + (1 << 20));
  const std::vector<TensorInfo> ts = parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path);
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
  return stats_;
}

}  // namespace fovea
