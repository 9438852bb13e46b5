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
//
// The folder is a trust boundary: it is shared (vLLM, other hosts), so anything below DIR may have
// been planted. DIR is opened once (its own path may hold symlinks: the operator's choice) and every
// entry is reached from that handle with no symlink followed below it (openat with O_NOFOLLOW,
// mkdirat, renameat, unlinkat, fstatat with AT_SYMLINK_NOFOLLOW). A <key> that is a symlink (to a
// folder or a file), or an encoder_cache.safetensors that is one, is never written, read or deleted
// through: lookup() calls it a miss, load() and store() throw fovea::Error naming it, eviction only
// drops it from the books, and the start-up scan skips it (neither fovea's nor counted as another
// writer's). Eviction deletes a file only after finding fovea's mark in it, read through a
// descriptor of the file at that name.
//
// Accounting follows the folder, not only what this process did: a key whose file is found gone
// (or no longer a regular file reached without symlinks) is dropped from the books by whatever
// operation looks at it: lookup() of that key, eviction of it, and a full re-check (per entry: its
// folder opened without following, one fstatat; linear in the entries, under the lock) that
// stats() and eviction (before deciding anything, once over the budget) run at most once a second,
// so files deleted by others free the budget before any of fovea's is evicted. The re-check also
// takes each of fovea's files at its current size. So stats() counts a file that is gone for at
// most a second.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
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
  // crash's leftovers) are removed; symlinks are skipped, never followed. Throws fovea::Error if
  // the folder cannot be made, opened or read.
  EcCache(std::string dir, int64_t max_bytes);
  ~EcCache();
  EcCache(const EcCache&) = delete;
  EcCache& operator=(const EcCache&) = delete;

  const std::string& dir() const { return dir_; }
  std::string path_of(const std::string& key) const;  // DIR/<key>/encoder_cache.safetensors

  // Whether `key`'s file exists (whoever wrote it) as a regular file reached with no symlink: a
  // symlinked key or file, or a key that cannot name an entry (ec_key_problem), is a miss. A hit on
  // one of fovea's marks it read (its mtime too, so the order survives a restart). Counts hits and
  // misses.
  bool lookup(const std::string& key);
  // Writes one input's entry (replacing a regular file there), then evicts fovea's least recently
  // used entries until what it holds fits the budget; the new entry stays even if it alone does not
  // fit. Throws fovea::Error naming the path and the problem (a full disk, a symlinked key or file,
  // a key that is not a folder); a failed store leaves no temporary file, and removes the <key>
  // folder if it made it (and nothing else has been put there).
  void store(const std::string& key, const Bf16Rows& t, const qwen3vl::GridThw& grid, const qwen3vl::VisionConfig& c);
  // An entry read back and checked (the one tensor "ec_cache", BF16, [tokens of grid, out_hidden x
  // (1 + deepstack outputs)]), cut into the merger output and, if asked for, the deepstack outputs.
  // Throws fovea::Error for a missing, symlinked or malformed entry.
  EcEntry load(const std::string& key, const qwen3vl::GridThw& grid, const qwen3vl::VisionConfig& c,
               bool with_deepstack = true) const;

  struct Stats {
    int64_t bytes = 0, files = 0;  // fovea's files
    int64_t foreign_files = 0;     // files it found and did not write
    uint64_t hits = 0, misses = 0, writes = 0, evictions = 0;
  };
  // Re-checks every entry it counts first (see the accounting rule above).
  Stats stats() const;

 private:
  // What the cache knows of the folder, guarded by mu_. `mutable`: stats(), const to its callers,
  // re-checks the folder and drops what it finds gone.
  struct Book {
    struct Entry {
      int64_t bytes = 0;
      uint64_t tick = 0;  // recency: larger is more recent
    };
    std::unordered_map<std::string, Entry> own;  // fovea's files
    std::map<uint64_t, std::string> by_age;       // tick -> key, oldest first
    std::unordered_set<std::string> foreign;      // other writers' files
    int64_t bytes = 0;                            // of fovea's files
    uint64_t tick = 0;
    void add(const std::string& key, int64_t bytes);  // as the most recently used
    void touch(const std::string& key);                // the most recently used now
    void forget(const std::string& key);               // whoever's it was
  };

  struct Found {  // a file found by the start-up scan
    std::string key;
    int64_t bytes = 0, mtime_ns = 0;
  };
  void scan();                                             // the constructor's reading of the folder
  void scan_key(const std::string& key, std::vector<Found>& found);
  void recheck() const;                                    // with mu_ held: the accounting rule's re-check
  void evict_over_budget(const std::string& keep);         // with mu_ held
  void evict(const std::string& key);                      // with mu_ held: one entry, if still fovea's
  // With mu_ held: sets the modification time of the file in `folder_fd` to now, strictly later than
  // any time this cache set before, so the recency order survives a restart even where the clock is
  // coarse.
  void stamp(int folder_fd);

  const std::string dir_;
  const int64_t max_bytes_;
  const int dir_fd_;  // DIR, opened once; everything below it is reached from here
  mutable std::mutex mu_;
  mutable Book book_;
  int64_t last_stamp_ns_ = 0;  // the latest modification time stamp() set or found
  static constexpr int64_t kRecheckNs = 1'000'000'000;  // re-checks at most once a second
  mutable int64_t last_recheck_ns_ = 0;                  // steady clock, of the last re-check
  Stats stats_;                // the counters (bytes and files are the book's)
};

}  // namespace fovea
