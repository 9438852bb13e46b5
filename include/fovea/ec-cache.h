// fovea/ec-cache.h: vLLM's encoder cache on disk, in the layout its disaggregated-encoding consumer
// (ECExampleConnector, shared_storage_path) reads: DIR/<key>/encoder_cache.safetensors holding one
// BF16 tensor "ec_cache" [tokens, out_hidden * (1 + deepstack outputs)], each row the merger's
// output followed by deepstack outputs 0..k-1, rows in the merger's token order. The consumer takes
// a file's existence as a hit and loads it whole; it never deletes one.
//
// fovea writes each file atomically (a temporary file beside it, fsync, rename: a reader never
// opens a partial file), marks it as its own in the file's metadata ("writer": "fovea"), and keeps
// what it wrote within a byte budget, evicting the least recently written or read first; files it
// did not write are counted and never deleted. The state is rebuilt from the folder when it opens.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "fovea/model.h"
#include "fovea/pipeline.h"

namespace fovea {

inline constexpr const char* kEcCacheFile = "encoder_cache.safetensors";
inline constexpr const char* kEcCacheTensor = "ec_cache";

// Why `key` cannot name an entry, or "" if it can: a key is one folder name, 1 to 255 bytes, with no
// '/', '\\', NUL or other control byte (below 0x20, or 0x7F), and neither "." nor "..".
std::string ec_key_problem(std::string_view key);

// One input's rows as the consumer loads them: [tokens, out_hidden * (1 + k)] bf16 bits, the
// merger's output then each deepstack output, row by row.
std::vector<uint16_t> ec_cache_rows(const Bf16Rows& t, int out_hidden);

// An entry read back, in the engine's layout: `rows` views `values` (merged [tokens, out_hidden],
// then each deepstack output asked for). Moving it keeps the views valid; copying is not allowed.
struct EcEntry {
  std::vector<uint16_t> values;
  Bf16Rows rows;
  EcEntry() = default;
  EcEntry(EcEntry&&) = default;
  EcEntry& operator=(EcEntry&&) = default;
  EcEntry(const EcEntry&) = delete;
  EcEntry& operator=(const EcEntry&) = delete;
};

class EcCache {
 public:
  // Opens the cache in `dir` (created if missing) holding at most `max_bytes` of fovea's files (0:
  // no bound). Reads the folder: fovea's files, ordered by when they were last written or read
  // (their mtime); other files, counted only; fovea's temporary files older than ten minutes (a
  // crash's leftovers) are removed. Throws fovea::Error if the folder cannot be made or read.
  EcCache(std::string dir, int64_t max_bytes);

  const std::string& dir() const { return dir_; }
  std::string path_of(const std::string& key) const;  // DIR/<key>/encoder_cache.safetensors

  // Whether `key`'s file exists (whoever wrote it). A hit on one of fovea's marks it read (its
  // mtime too, so the order survives a restart). Counts hits and misses.
  bool lookup(const std::string& key);
  // Writes one input's entry (replacing one there), then evicts fovea's least recently used entries
  // until what it holds fits the budget; the new entry stays even if it alone does not fit. Throws
  // fovea::Error naming the file (a full disk, say) and leaves no partial file.
  void store(const std::string& key, const Bf16Rows& t, const qwen3vl::GridThw& grid, const qwen3vl::VisionConfig& c);
  // An entry read back and checked (the one tensor "ec_cache", BF16, [tokens of grid, out_hidden x
  // (1 + deepstack outputs)]), cut into the merger output and, if asked for, the deepstack outputs.
  EcEntry load(const std::string& key, const qwen3vl::GridThw& grid, const qwen3vl::VisionConfig& c,
               bool with_deepstack = true) const;

  struct Stats {
    int64_t bytes = 0, files = 0;  // fovea's files
    int64_t foreign_files = 0;     // files it found and did not write
    uint64_t hits = 0, misses = 0, writes = 0, evictions = 0;
  };
  Stats stats() const;

 private:
  void touch(const std::string& key);  // with mu_ held: the most recently used now
  void evict_over_budget(const std::string& keep);  // with mu_ held
  void forget(const std::string& key);  // with mu_ held
  // With mu_ held: sets the file's modification time to now, strictly later than any time this
  // cache set before, so the recency order survives a restart even where the clock is coarse.
  void stamp(const std::string& path);

  const std::string dir_;
  const int64_t max_bytes_;
  mutable std::mutex mu_;
  struct Entry {
    int64_t bytes = 0;
    uint64_t tick = 0;  // recency: larger is more recent
  };
  std::unordered_map<std::string, Entry> own_;
  std::map<uint64_t, std::string> by_age_;  // tick -> key, oldest first
  std::unordered_map<std::string, bool> foreign_;
  uint64_t tick_ = 0;
  int64_t last_stamp_ns_ = 0;  // the latest modification time stamp() set or found
  Stats stats_;
};

}  // namespace fovea
