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
// Eviction rule. vLLM's consumer checks a file's existence when its scheduler takes the request and
// loads it later in a worker (after the proxy's round trip, prefill and its queue), so an entry
// fovea wrote or found (a hit) less than `min_age` ago is young and never evicted. Age counts from
// the end of the last write or from the last hit (lookup(), which precedes the reply by at most the
// request's own time), on the steady clock; an entry found by the start-up scan counts from its
// mtime (stamped at each write and hit) against the wall clock, a future mtime as now. A store
// knows its file's exact size before writing (the header is built first; the rows are streamed
// into the file a few at a time), and decides under the lock, before writing anything:
//   - fovea's files (the key's current file excepted: it is replaced), the stores in flight and
//     this one fit the budget: it writes;
//   - else, if evicting old entries can make them fit, or nothing but old entries is there besides
//     the new one (a lone entry bigger than the whole budget is still stored): it evicts old entries,
//     least recently used first, only as many as needed, then writes;
//   - else (young entries, stores in flight or entries another store is replacing hold so much that
//     this one cannot fit): it throws EcCacheFull, having written and evicted nothing. Old entries
//     stay: evicting them for a store that does not happen would only lose hits, and the next store
//     that fits takes them.
// A store's bytes stay reserved from that decision until its file is in place, and the key it
// writes is never evicted meanwhile, so concurrent stores never overshoot together. Old entries
// evicted for a store whose write then fails (a full disk) stay evicted: they were the next to go.
// Refused stores, young entries that plain LRU would have evicted, fovea's files found gone or
// replaced by another writer, and failed loads are counted (Stats). With min_age 0 nothing is young
// and the rule is plain LRU.
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
// Accounting follows the folder, not only what this process did: a key whose file is found gone (or
// no longer a regular file reached without symlinks) is dropped from the books by whatever
// operation looks at it: lookup() or a failed load() of that key, eviction of it, and a full
// re-check (per entry: its folder opened without following, one fstatat; linear in the entries,
// under the lock) that stats() and eviction (before deciding anything, once over the budget) run at
// most once a second, so files deleted by others free the budget before any of fovea's is evicted.
// The re-check also takes each of fovea's files at its current size. So stats() counts a file that
// is gone for at most a second.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/model.h"
#include "fovea/pipeline.h"

namespace fovea {

// A store refused because young entries (see the eviction rule) fill the byte budget: nothing was
// written. The caller may retry later, when they have aged.
class EcCacheFull : public Error {
 public:
  using Error::Error;
};

inline constexpr const char* kEcCacheFile = "encoder_cache.safetensors";
inline constexpr const char* kEcCacheTensor = "ec_cache";

// Why `key` cannot name an entry, or "" if it can: a key is one folder name, 1 to 255 bytes, with no
// '/', '\\', NUL or other control byte (below 0x20, or 0x7F), and neither "." nor "..".
std::string ec_key_problem(std::string_view key);

// The identifier vLLM's consumer looks an item up by (vllm/multimodal/processing/inputs.py,
// get_mm_item_hash, and vllm/multimodal/hasher.py with the framing of PR #54283): the item's `uuid`
// itself when the request's kwargs say nothing for its modality; otherwise the BLAKE3 hex digest of
// MultiModalHasher.hash_kwargs(model_id=model_id, <modality>=uuid, media_io_kwargs={<modality>:
// its options} if not empty, mm_processor_kwargs=the processor kwargs without the other modalities'
// "images_kwargs" / "videos_kwargs" / "audio_kwargs", if not empty). The hasher's byte stream: for
// each argument in name order, the name framed (its length as 8 bytes little-endian, then its UTF-8
// bytes) and its value: null 0x00; a list 0x01, its length (8 bytes), its values; a mapping 0x02,
// its size (8 bytes), then each key framed and its value, in the mapping's order; anything else 0x03
// and its bytes framed: a string's UTF-8, a bool 1 byte, an integer 8 bytes (int64; uint64 above
// it), a float 8 bytes (float64), all little-endian as numpy writes them.
std::string vllm_mm_hash(const std::string& model_id, InputKind modality, const std::string& uuid, const MmKwargs& k);
// The uuid vLLM's EPD proxy gives an item sent as a data URL: the sha256 (hex) of
// "data:<media_type>;base64,<bytes in standard base64>", the string it hashes (`fovea serve` keys a
// request's data URL so; `encode --uuid-from data-url` a file so).
std::string data_url_key(const std::string& media_type, const std::vector<uint8_t>& bytes);

// Throws fovea::Error naming --ec-storage-min-age unless `seconds` is finite and not negative.
void check_ec_min_age(double seconds);

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
  // no bound), never evicting one used less than `min_age_s` seconds ago (0: no protection; see the
  // eviction rule). Reads the folder: fovea's files, ordered by when they were last written or read
  // (their mtime); other files, counted only; fovea's temporary files older than ten minutes (a
  // crash's leftovers) are removed; symlinks are skipped, never followed; then evicts old entries
  // down to the budget (young ones stay, even over it). Throws fovea::Error if the folder cannot be
  // made, opened or read, or for a negative or non-finite min_age_s.
  EcCache(std::string dir, int64_t max_bytes, double min_age_s = 0);
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
  // Writes one input's entry (replacing a regular file there), after evicting as many of fovea's
  // least recently used old entries as the budget needs (the eviction rule); the new entry stays
  // even if it alone does not fit. Throws EcCacheFull, having written and evicted nothing, when
  // young entries keep the budget from fitting it; fovea::Error naming the path and the problem (a
  // full disk, a symlinked key or file, a key that is not a folder); a failed store leaves no
  // temporary file, and removes the <key> folder if it made it (and nothing else has been put
  // there).
  void store(const std::string& key, const Bf16Rows& t, const qwen3vl::GridThw& grid, const qwen3vl::VisionConfig& c);
  // An entry read back and checked (the one tensor "ec_cache", BF16, [tokens of grid, out_hidden x
  // (1 + deepstack outputs)]), cut into the merger output and, if asked for, the deepstack outputs.
  // Throws fovea::Error for a missing, symlinked or malformed entry (counted: load_failures; the
  // caller encodes again). A file of fovea's found gone, or read back without fovea's mark, leaves
  // its books (vanished).
  EcEntry load(const std::string& key, const qwen3vl::GridThw& grid, const qwen3vl::VisionConfig& c,
               bool with_deepstack = true) const;

  struct Stats {
    int64_t bytes = 0, files = 0;  // fovea's files
    int64_t foreign_files = 0;     // files it found and did not write
    uint64_t hits = 0, misses = 0, writes = 0, evictions = 0;
    uint64_t refused = 0;        // stores refused with EcCacheFull
    uint64_t vanished = 0;       // fovea's files found gone or replaced by another writer, once each
    uint64_t load_failures = 0;  // load() calls that threw
    // Entries plain LRU would have evicted (to fit a store, or at start-up) but that were kept as
    // young: per entry, per store refused or eviction pass.
    uint64_t young_kept = 0;
  };
  // Re-checks every entry it counts first (see the accounting rule above).
  Stats stats() const;

 private:
  // What the cache knows of the folder, guarded by mu_. `mutable`: stats(), const to its callers,
  // re-checks the folder and drops what it finds gone.
  struct Book {
    struct Entry {
      int64_t bytes = 0;
      uint64_t tick = 0;    // recency: larger is more recent
      int64_t used_ns = 0;  // steady clock, of the last write or hit (young entries: min_age_)
    };
    std::unordered_map<std::string, Entry> own;  // fovea's files
    std::map<uint64_t, std::string> by_age;      // tick -> key, oldest first
    std::unordered_set<std::string> foreign;     // other writers' files
    int64_t bytes = 0;                           // of fovea's files
    uint64_t tick = 0;
    void add(const std::string& key, int64_t bytes, int64_t used_ns);  // as the most recently used
    void touch(const std::string& key, int64_t used_ns);               // the most recently used now
    void forget(const std::string& key);                               // whoever's it was
  };

  struct Found {  // a file found by the start-up scan
    std::string key;
    int64_t bytes = 0, mtime_ns = 0;
  };
  void scan();  // the constructor's reading of the folder
  void scan_key(const std::string& key, std::vector<Found>& found);
  void recheck() const;  // with mu_ held: the accounting rule's re-check
  // With mu_ held: what fovea's files would hold with `size` bytes written as `key` (its file now
  // replaced) beside the stores in flight.
  int64_t held_with(const std::string& key, int64_t size) const;
  bool young(const Book::Entry& e, int64_t now_ns) const { return now_ns - e.used_ns < min_age_ns_; }
  int64_t kept_bytes(const std::string& key) const;                    // with mu_ held: what no eviction frees
  void make_room(const std::string& key, int64_t size);                // with mu_ held: the eviction rule's decision
  uint64_t evict_for(const std::string& key, int64_t size, bool dry);  // with mu_ held
  [[noreturn]] void refuse(const std::string& key, int64_t size, int64_t kept);  // with mu_ held
  void evict(const std::string& key);                                      // with mu_ held: one entry, if still fovea's
  void forget_vanished(const std::string& key) const;                      // with mu_ held: one of fovea's found gone
  void note_load(const std::string& key, bool loaded, bool marked) const;  // the books after a load
  // load() without the counting; *marked: whether the file carries fovea's mark.
  EcEntry read_back(const std::string& key, const qwen3vl::GridThw& grid, const qwen3vl::VisionConfig& c,
                    bool with_deepstack, bool* marked) const;
  // With mu_ held: sets the modification time of the file in `folder_fd` to now, strictly later than
  // any time this cache set before, so the recency order survives a restart even where the clock is
  // coarse.
  void stamp(int folder_fd);

  const std::string dir_;
  const int64_t max_bytes_;
  const int64_t min_age_ns_;  // entries used more recently are young: never evicted
  const Fd dir_fd_;           // DIR, opened once; everything below it is reached from here
  mutable std::mutex mu_;
  mutable Book book_;
  int64_t last_stamp_ns_ = 0;                           // the latest modification time stamp() set or found
  static constexpr int64_t kRecheckNs = 1'000'000'000;  // re-checks at most once a second
  mutable int64_t last_recheck_ns_ = 0;                 // steady clock, of the last re-check
  int64_t pending_bytes_ = 0;                     // reserved by stores between their decision and their file in place
  std::unordered_map<std::string, int> writing_;  // their keys (stores of each): never evicted meanwhile
  mutable Stats stats_;                           // the counters (bytes and files are the book's); load() counts too
};

}  // namespace fovea
