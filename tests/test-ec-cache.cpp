// The encoder cache in vLLM's layout (fovea/ec-cache.h) and SHA-256 (fovea/sha256.h): the file's
// name, tensor, dtype, shape and column order read back with fovea's safetensors reader; atomic
// writes under a polling reader; a write that fails leaves nothing; the byte budget evicts the least
// recently written or read of fovea's files and never another writer's; a restart rebuilds it. And
// the folder as a trust boundary: symlinks planted below it are never written, read or deleted
// through, and files others delete leave the accounting. And --ec-storage-min-age: entries used
// less than that ago are never evicted, a store they keep out is refused before writing anything,
// and the race counters (refused, young kept, vanished, load failures) count.
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "fovea/ec-cache.h"
#include "fovea/io.h"
#include "fovea/safetensors.h"
#include "fovea/sha256.h"
#include "test-util.h"

namespace {

using namespace fovea;
using fovea::test::error_of;
using fovea::test::TempDir;
namespace fs = std::filesystem;

std::span<const uint8_t> bytes_of(std::string_view s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

TEST(Sha256, KnownAnswers) {
  EXPECT_EQ(sha256_hex(bytes_of("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex(bytes_of("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex(std::string_view("abc")), sha256_hex(bytes_of("abc")))
      << "the text overload hashes the same bytes";
  EXPECT_EQ(
      sha256_hex(bytes_of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),  // 56 bytes: two tail blocks
      "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(bytes_of(std::string(1000000, 'a'))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(EcCache, KeysAreOneSafeFolderName) {
  for (const std::string& ok :
       std::vector<std::string>{"a", "0c4f-uuid", "sha256:abc", std::string(255, 'k'), ".hidden", "a b"})
    EXPECT_EQ(ec_key_problem(ok), "") << ok;
  EXPECT_HAS(ec_key_problem(""), "empty");
  EXPECT_HAS(ec_key_problem(std::string(256, 'k')), "256 bytes");
  EXPECT_HAS(ec_key_problem("."), "not a folder name");
  EXPECT_HAS(ec_key_problem(".."), "not a folder name");
  EXPECT_HAS(ec_key_problem("a/b"), "'/'");
  EXPECT_HAS(ec_key_problem("../x"), "'/'");
  EXPECT_HAS(ec_key_problem("a\\b"), "'\\'");
  EXPECT_HAS(ec_key_problem(std::string("a\0b", 3)), "0x00");
  EXPECT_HAS(ec_key_problem("a\nb"), "0x0A");
  EXPECT_HAS(ec_key_problem("a\x7f"), "0x7F");
}

// An image's outputs: `tokens` rows of `o` random bf16 values, merged and k deepstack outputs.
struct Outputs : EncoderOutputsBf16 {
  Bf16Rows view() const { return rows_of(*this); }
};
Outputs random_outputs(size_t tokens, size_t o, size_t k, unsigned seed) {
  std::mt19937 rng(seed);
  Outputs out;
  out.merged.resize(tokens * o);
  for (auto& v : out.merged) v = uint16_t(rng());
  out.deepstack.resize(k, std::vector<uint16_t>(tokens * o));
  for (auto& d : out.deepstack)
    for (auto& v : d) v = uint16_t(rng());
  return out;
}

qwen3vl::VisionConfig config_with(int out_hidden, size_t deepstack) {
  qwen3vl::VisionConfig c;
  c.out_hidden = out_hidden;
  c.deepstack.assign(deepstack, 0);
  return c;
}

// Small entries for the tests of what the folder holds: 8 tokens of 16 values, one deepstack output.
constexpr size_t kTokens = 8;
const qwen3vl::GridThw kGrid{1, 2, int(kTokens) * 2};
void store_small(EcCache& cache, const std::string& key, unsigned seed = 1) {
  cache.store(key, random_outputs(kTokens, 16, 1, seed).view(), kGrid, config_with(16, 1));
}
int64_t small_entry_bytes(const TempDir& dir) {  // one small entry's file size, from a cache of its own
  EcCache probe(dir.file("size-probe"), 0);
  store_small(probe, "x");
  return probe.stats().bytes;
}
// A file marked as fovea's, of the small entries' shape: what someone could plant outside the cache
// folder and point a symlink in it at (fovea must still never read, write or delete it).
std::string plant_fovea_file(const fs::path& p) {
  fs::create_directories(p.parent_path());
  const std::vector<uint8_t> values(kTokens * 32 * 2, 7);
  write_safetensors(p.string(), {{"ec_cache", DType::BF16, {int64_t(kTokens), 32}, values, {}}}, {{"writer", "fovea"}});
  return test::slurp(p);
}
std::vector<std::string> names_in(const fs::path& folder) {  // hidden ones included, sorted
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(folder)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// The file as vLLM's consumer reads it: one tensor "ec_cache", BF16, [tokens, O * (1 + k)], each row
// the merger's output and then deepstack 0..k-1 (what torch.split(x, [O, O * k], -1) undoes);
// load() gives the same bits; the metadata marks fovea as the writer; nothing else in the folder.
TEST(EcCache, FileIsVllmsLayout) {
  TempDir dir;
  for (const size_t k : {size_t(3), size_t(0)}) {  // Qwen3-VL (deepstack) and Qwen3.5 (none)
    SCOPED_TRACE(k);
    const size_t tokens = 37, O = 24, W = O * (1 + k);
    const Outputs out = random_outputs(tokens, O, k, unsigned(k + 1));
    EcCache cache(dir.file("cache"), 0);
    const std::string key = "img-" + std::to_string(k);
    EXPECT_FALSE(cache.lookup(key));
    cache.store(key, out.view(), {1, 2, int(tokens) * 2}, config_with(int(O), k));
    EXPECT_TRUE(cache.lookup(key));
    const std::string path = cache.path_of(key);
    EXPECT_EQ(path, (fs::path(dir.file("cache")) / key / "encoder_cache.safetensors").string());
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(fs::path(path).parent_path()))
      names.push_back(e.path().filename().string());
    EXPECT_EQ(names, std::vector<std::string>{"encoder_cache.safetensors"});
    const std::string bytes = test::slurp(path);
    const auto ts = parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path);
    ASSERT_EQ(ts.size(), 1u);
    EXPECT_EQ(ts[0].name, "ec_cache");
    EXPECT_EQ(ts[0].dtype, DType::BF16);
    EXPECT_EQ(ts[0].shape, (std::vector<int64_t>{int64_t(tokens), int64_t(W)}));
    const auto* v = reinterpret_cast<const uint16_t*>(ts[0].data);
    size_t wrong = 0;
    for (size_t r = 0; r < tokens; ++r)
      for (size_t c = 0; c < W; ++c) {
        const size_t part = c / O, j = c % O;
        const uint16_t want = part == 0 ? out.merged[r * O + j] : out.deepstack[part - 1][r * O + j];
        wrong += v[r * W + c] != want;
      }
    EXPECT_EQ(wrong, 0u);
    EXPECT_NE(bytes.find("\"writer\":\"fovea\""), std::string::npos);
    const qwen3vl::VisionConfig cfg = config_with(int(O), k);
    const EcEntry back = cache.load(key, {1, 2, int(tokens) * 2}, cfg);  // the rows as stored, cut apart again
    EXPECT_TRUE(std::equal(back.rows.merged.begin(), back.rows.merged.end(), out.merged.begin(), out.merged.end()));
    ASSERT_EQ(back.rows.deepstack.size(), k);
    for (size_t d = 0; d < k; ++d)
      EXPECT_TRUE(std::equal(back.rows.deepstack[d].begin(), back.rows.deepstack[d].end(), out.deepstack[d].begin(),
                             out.deepstack[d].end()))
          << "deepstack " << d;
    EXPECT_TRUE(cache.load(key, {1, 2, int(tokens) * 2}, cfg, /*with_deepstack=*/false).rows.deepstack.empty());
    EXPECT_HAS(error_of([&] { cache.load(key, {1, 2, int(tokens + 1) * 2}, cfg); }), "not BF16 [38");
    const EcCache::Stats s = cache.stats();
    EXPECT_EQ(s.hits, 1u);
    EXPECT_EQ(s.misses, 1u);
    EXPECT_EQ(s.writes, 1u);
  }
  EXPECT_HAS(
      error_of([&] {
        EcCache(dir.file("cache"), 0).store("a/b", random_outputs(1, 4, 0, 1).view(), {1, 2, 2}, config_with(4, 0));
      }),
      "'/'");
}

// A reader polling for the file while entries are rewritten never opens a partial one.
TEST(EcCache, ReaderNeverSeesAPartialFile) {
  TempDir dir;
  EcCache cache(dir.file("c"), 0);
  const std::string path = cache.path_of("k");
  std::atomic<bool> done{false};
  std::atomic<int> opened{0}, partial{0};
  std::thread reader([&] {
    while (!done) {
      std::error_code ec;
      if (!fs::exists(path, ec)) continue;
      std::string bytes;
      try {
        bytes = read_file(path);
      } catch (const Error&) {
        continue;  // replaced between the check and the open
      }
      opened += 1;
      try {
        const auto ts = parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path);
        if (ts.size() != 1 || ts[0].shape.size() != 2 || ts[0].shape[1] != 64) partial += 1;
      } catch (const Error&) {
        partial += 1;
      }
    }
  });
  for (int i = 0; i < 40; ++i)
    cache.store("k", random_outputs(size_t(200 + 97 * (i % 5)), 16, 3, unsigned(i)).view(), {1, 2, 2},
                config_with(16, 3));
  done = true;
  reader.join();
  EXPECT_GT(opened, 0);
  EXPECT_EQ(partial, 0);
}

// A write that fails part way (here: the file-size limit, as a full disk would; it holds for root
// too) is an error naming the file, and leaves neither the file nor a temporary one, nor the <key>
// folder the store made; a folder that was there before stays.
TEST(EcCache, FailedWriteLeavesNothing) {
  TempDir dir;
  EcCache cache(dir.file("c"), 0);
  fs::create_directories(fs::path(dir.file("c")) / "was-there");
  struct sigaction ignore {
  }, old{};
  ignore.sa_handler = SIG_IGN;
  sigaction(SIGXFSZ, &ignore, &old);
  rlimit saved{};
  getrlimit(RLIMIT_FSIZE, &saved);
  rlimit small = saved;
  small.rlim_cur = 4096;
  setrlimit(RLIMIT_FSIZE, &small);
  const auto big = random_outputs(512, 64, 3, 1);
  const std::string msg = error_of([&] { cache.store("big", big.view(), {1, 2, 2}, config_with(64, 3)); });
  const std::string msg2 = error_of([&] { cache.store("was-there", big.view(), {1, 2, 2}, config_with(64, 3)); });
  setrlimit(RLIMIT_FSIZE, &saved);
  sigaction(SIGXFSZ, &old, nullptr);
  EXPECT_HAS(msg, "encoder_cache.safetensors");
  EXPECT_HAS(msg, "write failed");
  EXPECT_HAS(msg2, "write failed");
  EXPECT_FALSE(fs::exists(fs::path(dir.file("c")) / "big"));  // the folder this store made, gone with it
  EXPECT_EQ(names_in(fs::path(dir.file("c")) / "was-there"), std::vector<std::string>{});  // kept, empty
  EXPECT_FALSE(cache.lookup("big"));
  EXPECT_EQ(cache.stats().files, 0);
  EXPECT_EQ(cache.stats().writes, 0u);
}

// Writes that fail however the caller runs (root included): a plain file under the key's name, a
// folder under the entry file's name. Each is an error naming the path; nothing is left behind,
// and nothing that was there is touched.
TEST(EcCache, FailedStoreOnWhatIsThereLeavesNothing) {
  TempDir dir;
  const fs::path root = dir.file("c");
  EcCache cache(root.string(), 0);
  std::ofstream(root / "plain") << "someone's file";
  const std::string msg = error_of([&] { store_small(cache, "plain"); });
  EXPECT_HAS(msg, (root / "plain").string());
  EXPECT_HAS(msg, "is not a folder");
  EXPECT_EQ(test::slurp(root / "plain"), "someone's file");
  fs::create_directories(root / "k" / "encoder_cache.safetensors");
  const std::string msg2 = error_of([&] { store_small(cache, "k"); });
  EXPECT_HAS(msg2, cache.path_of("k"));
  EXPECT_HAS(msg2, "is a folder");
  EXPECT_EQ(names_in(root / "k"), std::vector<std::string>{"encoder_cache.safetensors"});  // no temporary file
  EXPECT_EQ(names_in(root), (std::vector<std::string>{"k", "plain"}));
  EXPECT_FALSE(cache.lookup("plain"));
  EXPECT_FALSE(cache.lookup("k"));
  EXPECT_EQ(cache.stats().files, 0);
}

// Budget: the least recently written or read of fovea's files goes first; another writer's file is
// counted and never deleted; a restart rebuilds the same state (order from mtimes) and removes
// stale temporary files only.
TEST(EcCache, BudgetEvictsLeastRecentlyUsedAndRestartRebuilds) {
  TempDir dir;
  const std::string root = dir.file("c");
  const auto cfg = config_with(32, 1);
  const auto outputs = [&](unsigned seed) { return random_outputs(64, 32, 1, seed); };
  int64_t one = 0;
  {
    EcCache probe(dir.file("size"), 0);
    probe.store("x", outputs(0).view(), {1, 2, 2}, cfg);
    one = probe.stats().bytes;
  }
  ASSERT_GT(one, 64 * 64 * 2);
  // Another writer's entry (no "writer": "fovea" in its metadata), larger than the whole budget.
  fs::create_directories(fs::path(root) / "vllm-own");
  write_safetensors((fs::path(root) / "vllm-own" / "encoder_cache.safetensors").string(),
                    {{"ec_cache", DType::BF16, {512, 64}, std::vector<uint8_t>(512 * 64 * 2), {}}});
  {
    EcCache cache(root, 2 * one + one / 2);  // room for two of fovea's files
    EXPECT_EQ(cache.stats().foreign_files, 1);
    cache.store("a", outputs(1).view(), {1, 2, 2}, cfg);
    cache.store("b", outputs(2).view(), {1, 2, 2}, cfg);
    EXPECT_TRUE(cache.lookup("a"));  // a is now more recent than b
    cache.store("c", outputs(3).view(), {1, 2, 2}, cfg);
    EXPECT_FALSE(fs::exists(cache.path_of("b")));
    EXPECT_FALSE(fs::exists(fs::path(root) / "b"));  // its folder too
    EXPECT_TRUE(cache.lookup("a"));
    EXPECT_TRUE(cache.lookup("c"));
    EXPECT_TRUE(cache.lookup("vllm-own"));
    const EcCache::Stats s = cache.stats();
    EXPECT_EQ(s.files, 2);
    EXPECT_EQ(s.bytes, 2 * one);
    EXPECT_EQ(s.evictions, 1u);
    EXPECT_EQ(s.foreign_files, 1);
  }
  // A crash's temporary files: an old one is removed at start-up, a fresh one (a live writer's) kept.
  const fs::path old_tmp = fs::path(root) / "a" / ".encoder_cache.safetensors.tmp.OLD123";
  const fs::path new_tmp = fs::path(root) / "a" / ".encoder_cache.safetensors.tmp.NEW123";
  std::ofstream(old_tmp) << "partial";
  std::ofstream(new_tmp) << "partial";
  fs::last_write_time(old_tmp, fs::file_time_type::clock::now() - std::chrono::hours(1));
  {
    EcCache cache(root, 2 * one + one / 2);
    EXPECT_FALSE(fs::exists(old_tmp));
    EXPECT_TRUE(fs::exists(new_tmp));
    EcCache::Stats s = cache.stats();
    EXPECT_EQ(s.files, 2);
    EXPECT_EQ(s.bytes, 2 * one);
    EXPECT_EQ(s.foreign_files, 1);
    // c was read after a, so a is the oldest now: the next entry evicts it.
    cache.store("d", outputs(4).view(), {1, 2, 2}, cfg);
    EXPECT_FALSE(fs::exists(cache.path_of("a")));
    EXPECT_TRUE(fs::exists(cache.path_of("c")));
    EXPECT_TRUE(fs::exists(cache.path_of("vllm-own")));
  }
  {  // a smaller budget at start-up evicts down to it at once, oldest first; never the other writer's
    EcCache cache(root, one + one / 2);
    EXPECT_FALSE(fs::exists(cache.path_of("c")));
    EXPECT_TRUE(fs::exists(cache.path_of("d")));
    EXPECT_TRUE(fs::exists(cache.path_of("vllm-own")));
    EXPECT_EQ(cache.stats().files, 1);
  }
}

// The folder is shared, so what is below it may have been planted. A <key> that is a symlink (to a
// folder or to a file) outside is never written or read through: store() refuses, naming it;
// lookup() is a miss even where a file of fovea's lies behind it; the start-up scan skips it.
TEST(EcCache, SymlinkedKeyIsNeverWrittenOrReadThrough) {
  TempDir dir;
  const fs::path root = dir.file("c"), outside = dir.file("outside");
  const std::string in_folder = plant_fovea_file(outside / "encoder_cache.safetensors");
  const std::string a_file = plant_fovea_file(dir.file("outside-file"));
  fs::create_directories(root);
  fs::create_directory_symlink(outside, root / "to-folder");
  fs::create_symlink(dir.file("outside-file"), root / "to-file");
  EcCache cache(root.string(), 0);
  EXPECT_EQ(cache.stats().files, 0);  // not counted as fovea's, nor as another writer's
  EXPECT_EQ(cache.stats().foreign_files, 0);
  for (const std::string key : {"to-folder", "to-file"}) {
    SCOPED_TRACE(key);
    EXPECT_FALSE(cache.lookup(key));
    EXPECT_HAS(error_of([&] { cache.load(key, kGrid, config_with(16, 1)); }), "symbolic link");
    const std::string msg = error_of([&] { store_small(cache, key); });
    EXPECT_HAS(msg, (root / key).string());
    EXPECT_HAS(msg, "symbolic link");
    EXPECT_TRUE(fs::is_symlink(root / key));
  }
  EXPECT_EQ(test::slurp(outside / "encoder_cache.safetensors"), in_folder);
  EXPECT_EQ(names_in(outside), std::vector<std::string>{"encoder_cache.safetensors"});  // no temporary file
  EXPECT_EQ(test::slurp(dir.file("outside-file")), a_file);
  const EcCache::Stats s = cache.stats();
  EXPECT_EQ(s.files, 0);
  EXPECT_EQ(s.writes, 0u);
  EXPECT_EQ(s.hits, 0u);
}

// An encoder_cache.safetensors that is a symlink, in a real <key> folder: not a hit, not read, not
// written through and not replaced; the scan counts it nowhere.
TEST(EcCache, SymlinkedEntryFileIsNeverWrittenOrReadThrough) {
  TempDir dir;
  const fs::path root = dir.file("c"), target = dir.file("outside.safetensors");
  const std::string planted = plant_fovea_file(target);
  fs::create_directories(root / "k");
  fs::create_symlink(target, root / "k" / "encoder_cache.safetensors");
  EcCache cache(root.string(), 0);
  EXPECT_EQ(cache.stats().files, 0);
  EXPECT_EQ(cache.stats().foreign_files, 0);
  EXPECT_FALSE(cache.lookup("k"));
  EXPECT_HAS(error_of([&] { cache.load("k", kGrid, config_with(16, 1)); }), "symbolic link");
  const std::string msg = error_of([&] { store_small(cache, "k"); });
  EXPECT_HAS(msg, cache.path_of("k"));
  EXPECT_HAS(msg, "symbolic link");
  EXPECT_TRUE(fs::is_symlink(root / "k" / "encoder_cache.safetensors"));
  EXPECT_EQ(names_in(root / "k"), std::vector<std::string>{"encoder_cache.safetensors"});  // no temporary file
  EXPECT_EQ(test::slurp(target), planted);
}

// Eviction never deletes through a symlink: entries of fovea's swapped for symlinks to files marked
// as fovea's outside the folder (a <key> folder, or the file itself) are skipped by the scan after a
// restart and dropped from the books, not deleted, when swapped in while the cache runs.
TEST(EcCache, EvictionNeverDeletesThroughSymlinks) {
  TempDir dir;
  const fs::path root = dir.file("c"), outside = dir.file("outside");
  const int64_t one = small_entry_bytes(dir);
  {
    EcCache cache(root.string(), 0);
    for (const std::string key : {"a", "b", "c"}) store_small(cache, key);
  }
  const std::string a = plant_fovea_file(outside / "a" / "encoder_cache.safetensors");
  const std::string b = plant_fovea_file(outside / "b.safetensors");
  fs::remove_all(root / "a");
  fs::create_directory_symlink(outside / "a", root / "a");
  fs::remove(root / "b" / "encoder_cache.safetensors");
  fs::create_symlink(outside / "b.safetensors", root / "b" / "encoder_cache.safetensors");
  {
    EcCache cache(root.string(), one + one / 2);  // room for one entry: evicts at start-up if it counts more
    EXPECT_EQ(cache.stats().files, 1);
    EXPECT_TRUE(fs::exists(cache.path_of("c")));
    store_small(cache, "d");
    EXPECT_FALSE(fs::exists(cache.path_of("c")));
    EXPECT_EQ(cache.stats().evictions, 1u);
  }
  EXPECT_EQ(test::slurp(outside / "a" / "encoder_cache.safetensors"), a);
  EXPECT_EQ(test::slurp(outside / "b.safetensors"), b);
  {  // swapped while the cache runs: the oldest entry becomes a symlink to an outside file of fovea's
    EcCache cache(root.string(), 2 * one + one / 2);
    store_small(cache, "e");
    fs::remove_all(root / "d");
    fs::create_directory_symlink(outside / "a", root / "d");
    store_small(cache, "f");
    store_small(cache, "g");
    EXPECT_EQ(test::slurp(outside / "a" / "encoder_cache.safetensors"), a);
    EXPECT_TRUE(fs::is_symlink(root / "d"));
    EXPECT_EQ(cache.stats().files, 2);
  }
}

// Only what is below DIR is untrusted: DIR itself may be reached through a symlink (the operator's
// choice), and the cache works there as anywhere.
TEST(EcCache, DirItselfMayBeASymlink) {
  TempDir dir;
  fs::create_directories(dir.file("real"));
  fs::create_directory_symlink(dir.file("real"), dir.file("link"));
  {
    EcCache cache(dir.file("link"), 0);
    store_small(cache, "a");
    EXPECT_TRUE(cache.lookup("a"));
  }
  EXPECT_TRUE(fs::is_regular_file(fs::path(dir.file("real")) / "a" / "encoder_cache.safetensors"));
  EcCache again(dir.file("link"), 0);
  EXPECT_EQ(again.stats().files, 1);
  EXPECT_EQ(again.load("a", kGrid, config_with(16, 1)).rows.merged.size(), kTokens * 16);
}

// The start-up scan does not follow a symlinked <key> folder: a stale temporary file in the folder
// outside that it points to stays, as does the file a stale-looking symlink in a real folder names.
TEST(EcCache, StartupScanFollowsNoSymlink) {
  TempDir dir;
  const fs::path root = dir.file("c"), outside = dir.file("outside");
  const auto an_hour_ago = fs::file_time_type::clock::now() - std::chrono::hours(1);
  const fs::path old_tmp = outside / ".encoder_cache.safetensors.tmp.OLD123";
  fs::create_directories(outside);
  std::ofstream(old_tmp) << "someone's";
  fs::last_write_time(old_tmp, an_hour_ago);
  fs::create_directories(root / "k");
  fs::create_directory_symlink(outside, root / "x");
  const fs::path link_tmp = root / "k" / ".encoder_cache.safetensors.tmp.LNK123";
  fs::create_symlink(old_tmp, link_tmp);
  EcCache cache(root.string(), 0);
  EXPECT_TRUE(fs::exists(old_tmp));
  EXPECT_TRUE(fs::is_symlink(link_tmp));
  EXPECT_EQ(cache.stats().files, 0);
}

// Files others delete leave the accounting at the next look: stats() re-checks what it counts, and
// eviction re-checks before deciding, so a deleted entry frees the budget instead of one of fovea's.
TEST(EcCache, ExternalDeletionShowsInStatsAndBudget) {
  TempDir dir;
  const fs::path root = dir.file("c");
  const int64_t one = small_entry_bytes(dir);
  EcCache cache(root.string(), 2 * one + one / 2);  // room for two
  store_small(cache, "a");
  store_small(cache, "b");
  plant_fovea_file(root / "other" / "encoder_cache.safetensors");
  EXPECT_TRUE(cache.lookup("other"));  // found after start-up: counted as another writer's
  EcCache::Stats s = cache.stats();
  EXPECT_EQ(s.files, 2);
  EXPECT_EQ(s.bytes, 2 * one);
  EXPECT_EQ(s.foreign_files, 1);
  fs::remove(cache.path_of("b"));
  fs::remove_all(root / "other");
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // the re-check runs at most once a second
  s = cache.stats();
  EXPECT_EQ(s.files, 1);
  EXPECT_EQ(s.bytes, one);
  EXPECT_EQ(s.foreign_files, 0);
  fs::remove_all(root / "a");  // gone unseen, then a store goes over the budget as it was counted
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  store_small(cache, "c");
  store_small(cache, "d");
  s = cache.stats();
  EXPECT_EQ(s.evictions, 0u);
  EXPECT_EQ(s.files, 2);
  EXPECT_TRUE(fs::exists(cache.path_of("c")));
  EXPECT_TRUE(fs::exists(cache.path_of("d")));
}

// --ec-storage-min-age: a negative or non-finite age is an error naming the flag, at the cache too.
TEST(EcCacheMinAge, NegativeOrNonFiniteIsAnError) {
  TempDir dir;
  for (const double bad : {-1.0, -0.001, std::nan(""), std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(bad);
    EXPECT_HAS(error_of([&] { check_ec_min_age(bad); }), "--ec-storage-min-age");
    EXPECT_HAS(error_of([&] { EcCache(dir.file("c"), 0, bad); }), "--ec-storage-min-age");
  }
  check_ec_min_age(0);
  check_ec_min_age(1e300);  // finite: forever, in effect
  EcCache(dir.file("c"), 0, 1e300);
}

// Entries used less than min_age ago are never evicted: a store they keep from fitting the budget
// is refused with EcCacheFull, before anything is written (no file, no temporary file, no <key>
// folder; a folder that was there stays, empty) and without evicting anything; its message says
// what the young files hold, the budget and both flags. A lone entry bigger than the whole budget
// is still stored when nothing else is there, but not beside a young one.
TEST(EcCacheMinAge, YoungEntriesAreKeptAndAStoreTheyFillIsRefused) {
  TempDir dir;
  const fs::path root = dir.file("c");
  const int64_t one = small_entry_bytes(dir), budget = 2 * one + one / 2;  // room for two
  EcCache cache(root.string(), budget, 3600);
  store_small(cache, "a");
  store_small(cache, "b");
  fs::create_directories(root / "was-there");
  for (const std::string key : {"c", "was-there"}) {
    SCOPED_TRACE(key);
    std::string msg;
    try {
      store_small(cache, key);
    } catch (const EcCacheFull& e) {
      msg = e.what();
    }
    EXPECT_HAS(msg, cache.path_of(key));
    EXPECT_HAS(msg, fmt::format("hold {} bytes", 2 * one));
    EXPECT_HAS(msg, fmt::format("budget of {} bytes", budget));
    EXPECT_HAS(msg, "--ec-storage-max-bytes");
    EXPECT_HAS(msg, "--ec-storage-min-age");
  }
  EXPECT_EQ(names_in(root), (std::vector<std::string>{"a", "b", "was-there"}));
  EXPECT_EQ(names_in(root / "was-there"), std::vector<std::string>{});
  EXPECT_EQ(names_in(root / "a"), std::vector<std::string>{"encoder_cache.safetensors"});
  store_small(cache, "a", 2);  // replacing a young entry frees its own bytes: fits
  EcCache::Stats s = cache.stats();
  EXPECT_EQ(s.files, 2);
  EXPECT_EQ(s.writes, 3u);
  EXPECT_EQ(s.evictions, 0u);
  EXPECT_EQ(s.refused, 2u);
  EXPECT_EQ(s.young_kept, 2u);  // plain LRU would have evicted a, once per refused store
  // The lone-entry rule: bigger than the whole budget, stored when nothing else is there...
  EcCache small(dir.file("small"), one / 2, 3600);
  store_small(small, "x");
  EXPECT_TRUE(fs::exists(small.path_of("x")));
  // ...but not beside a young entry, however large.
  EXPECT_THROW(store_small(small, "y"), EcCacheFull);
  EXPECT_FALSE(fs::exists(fs::path(dir.file("small")) / "y"));
  EXPECT_EQ(small.stats().files, 1);
}

// With min_age 0 the budget is plain LRU, as before: nothing is refused or kept.
TEST(EcCacheMinAge, ZeroIsPlainLru) {
  TempDir dir;
  const int64_t one = small_entry_bytes(dir);
  EcCache cache(dir.file("c"), 2 * one + one / 2, 0);
  for (const std::string key : {"a", "b", "c", "d"}) store_small(cache, key);
  EXPECT_FALSE(fs::exists(cache.path_of("a")));
  EXPECT_FALSE(fs::exists(cache.path_of("b")));
  const EcCache::Stats s = cache.stats();
  EXPECT_EQ(s.files, 2);
  EXPECT_EQ(s.evictions, 2u);
  EXPECT_EQ(s.refused, 0u);
  EXPECT_EQ(s.young_kept, 0u);
}

// Age counts from the last write or hit: an entry is evictable once min_age has passed, a hit
// protects it again for min_age, and a refused store leaves old entries alone.
TEST(EcCacheMinAge, OldEntriesGoAndAHitProtectsAgain) {
  TempDir dir;
  const double min_age = 0.5 * test::kTimeScale;
  const auto past_min_age = std::chrono::duration<double>(min_age + 0.1);
  const int64_t one = small_entry_bytes(dir);
  EcCache cache(dir.file("c"), 2 * one + one / 2, min_age);  // room for two
  store_small(cache, "a");
  store_small(cache, "b");
  EXPECT_THROW(store_small(cache, "c"), EcCacheFull);
  std::this_thread::sleep_for(past_min_age);  // a and b are old now
  EXPECT_TRUE(cache.lookup("a"));             // a is young again
  store_small(cache, "c");                    // b, old, goes
  EXPECT_FALSE(fs::exists(cache.path_of("b")));
  EXPECT_THROW(store_small(cache, "d"), EcCacheFull);  // a (the hit) and c are young
  EXPECT_TRUE(fs::exists(cache.path_of("a")));
  std::this_thread::sleep_for(past_min_age);
  EXPECT_TRUE(cache.lookup("c"));  // c young, a old: a store c alone keeps from fitting is refused...
  EXPECT_THROW(
      cache.store("big", random_outputs(kTokens * 2, 16, 1, 9).view(), {1, 2, int(kTokens) * 4}, config_with(16, 1)),
      EcCacheFull);
  EXPECT_TRUE(fs::exists(cache.path_of("a")));  // ...and a, old, is not evicted for nothing
  store_small(cache, "d");                      // one that fits once a goes: a goes
  EXPECT_FALSE(fs::exists(cache.path_of("a")));
  const EcCache::Stats s = cache.stats();
  EXPECT_EQ(s.evictions, 2u);
  EXPECT_EQ(s.refused, 3u);
  EXPECT_EQ(s.files, 2);
}

// After a restart an entry's age is its mtime's (stamped at each write and hit) on the wall clock:
// files just written are young and stay, even over a smaller budget; one last used an hour ago goes.
TEST(EcCacheMinAge, RestartDatesEntriesByMtime) {
  TempDir dir;
  const fs::path root = dir.file("c");
  const int64_t one = small_entry_bytes(dir);
  {
    EcCache cache(root.string(), 0, 3600);
    store_small(cache, "a");
    store_small(cache, "b");
  }
  {
    EcCache cache(root.string(), one + one / 2, 3600);  // room for one
    const EcCache::Stats s = cache.stats();
    EXPECT_EQ(s.files, 2);
    EXPECT_EQ(s.evictions, 0u);
    EXPECT_EQ(s.young_kept, 1u);  // plain LRU would have evicted a
  }
  const auto an_hour_ago = fs::file_time_type::clock::now() - std::chrono::hours(1);
  fs::last_write_time(root / "a" / "encoder_cache.safetensors", an_hour_ago);
  EcCache cache(root.string(), one + one / 2, 3600);
  EXPECT_FALSE(fs::exists(cache.path_of("a")));
  EXPECT_TRUE(fs::exists(cache.path_of("b")));
  EXPECT_EQ(cache.stats().evictions, 1u);
}

// The race counters: fovea's files found gone or replaced by someone else (by lookup, the re-check,
// load and eviction), once each; load() calls that throw.
TEST(EcCacheMinAge, CountersCountVanishedFilesAndLoadFailures) {
  TempDir dir;
  const fs::path root = dir.file("c");
  const qwen3vl::VisionConfig cfg = config_with(16, 1);
  const int64_t one = small_entry_bytes(dir);
  EcCache cache(root.string(), 0);
  for (const std::string key : {"a", "b", "c", "d", "e"}) store_small(cache, key);
  fs::remove(cache.path_of("a"));
  fs::remove_all(root / "b");
  EXPECT_FALSE(cache.lookup("a"));
  EXPECT_FALSE(cache.lookup("a"));
  EXPECT_EQ(cache.stats().vanished, 2u);  // a by the first lookup, once; b by stats' first re-check
  const std::string good = test::slurp(cache.path_of("c"));
  std::ofstream(cache.path_of("c"), std::ios::binary | std::ios::trunc) << good.substr(0, good.size() / 2);
  EXPECT_THROW(cache.load("c", kGrid, cfg), Error);  // damaged, still there: a failure, not vanished
  fs::remove(cache.path_of("d"));
  EXPECT_THROW(cache.load("d", kGrid, cfg), Error);        // gone: both
  const std::vector<uint8_t> values(kTokens * 32 * 2, 7);  // another writer's file, no mark, in e's place
  write_safetensors(cache.path_of("e"), {{"ec_cache", DType::BF16, {int64_t(kTokens), 32}, values, {}}});
  EXPECT_EQ(cache.load("e", kGrid, cfg).rows.merged.size(), kTokens * 16);  // read, and now another writer's
  EcCache::Stats s = cache.stats();
  EXPECT_EQ(s.vanished, 4u);
  EXPECT_EQ(s.load_failures, 2u);
  EXPECT_EQ(s.files, 1);          // c
  EXPECT_EQ(s.foreign_files, 1);  // e
  // Eviction finding its file replaced by another writer's: not deleted, counted.
  EcCache budget(dir.file("b"), 2 * one + one / 2, 0);
  store_small(budget, "x");
  store_small(budget, "y");
  write_safetensors(budget.path_of("x"), {{"ec_cache", DType::BF16, {int64_t(kTokens), 32}, values, {}}});
  store_small(budget, "z");
  EXPECT_TRUE(fs::exists(budget.path_of("x")));
  s = budget.stats();
  EXPECT_EQ(s.vanished, 1u);
  EXPECT_EQ(s.evictions, 0u);
  EXPECT_EQ(s.foreign_files, 1);
  EXPECT_EQ(s.files, 2);
}

}  // namespace

// vLLM's identifier for an item sent with kwargs (fovea::vllm_mm_hash), against digests of vLLM's
// framed byte stream built by an independent port of MultiModalHasher (Python) and hashed by b3sum.
TEST(VllmMmHash, MatchesVllmsHasher) {
  fovea::MmKwargs k;
  EXPECT_EQ(fovea::vllm_mm_hash("synthetic:tiny", fovea::InputKind::IMAGE, "abc", k), "abc");  // nothing: the uuid
  k.processor = nlohmann::ordered_json::object();
  k.media_io = nlohmann::ordered_json::parse(R"({"image": {}, "video": null})");
  EXPECT_EQ(fovea::vllm_mm_hash("synthetic:tiny", fovea::InputKind::IMAGE, "abc", k),
            "abc");  // {} and null say nothing
  k.processor = nlohmann::ordered_json::parse(R"({"max_pixels": 40000})");
  EXPECT_EQ(fovea::vllm_mm_hash("synthetic:tiny", fovea::InputKind::IMAGE, "abc", k),
            "0bdbb3792a85f586bb922c2aa5e2634801cd0a31ee208ece60351a3b23567a0e");
  // Nested values, null, a bool, a float, a list, key order as sent; the other modality's scoped
  // kwargs (videos_kwargs) left out of an image's identifier.
  k.processor = nlohmann::ordered_json::parse(
      R"({"max_pixels": 65536, "size": {"longest_edge": 65536, "shortest_edge": 4096}, "fps": 1.5,
          "videos_kwargs": {"num_frames": 4}, "images_kwargs": {"min_pixels": 1024}, "do_x": null, "flag": true,
          "list": [1, {"a": "b"}]})");
  EXPECT_EQ(fovea::vllm_mm_hash("synthetic:tiny", fovea::InputKind::IMAGE, "photo-1", k),
            "2c50c4d6a52a3545844ce0f5ad2cbc4537b8c8d11cfbe519ea1c01cbd499fd54");
  // Key order is part of the identifier (vLLM hashes the mapping in its order).
  k.processor = nlohmann::ordered_json::parse(R"({"size": {"shortest_edge": 4096, "longest_edge": 65536}})");
  fovea::MmKwargs swapped;
  swapped.processor = nlohmann::ordered_json::parse(R"({"size": {"longest_edge": 65536, "shortest_edge": 4096}})");
  EXPECT_NE(fovea::vllm_mm_hash("m", fovea::InputKind::IMAGE, "u", k),
            fovea::vllm_mm_hash("m", fovea::InputKind::IMAGE, "u", swapped));
  // Only videos_kwargs: an image's identifier is its uuid, a clip's is hashed.
  k.processor = nlohmann::ordered_json::parse(R"({"videos_kwargs": {"fps": 1}})");
  EXPECT_EQ(fovea::vllm_mm_hash("m", fovea::InputKind::IMAGE, "u", k), "u");
  EXPECT_EQ(fovea::vllm_mm_hash("m", fovea::InputKind::VIDEO, "u", k).size(), 64u);
}

// apply_mm_kwargs: what a request may lower, what it may not raise, what fovea refuses by name.
TEST(MmKwargs, AppliedWithinTheServersLimits) {
  fovea::InputConfig server = fovea::load_input_config("synthetic:tiny");
  const auto apply = [&](const char* processor, const char* media_io = "") {
    return fovea::apply_mm_kwargs(server, fovea::parse_mm_kwargs(processor, media_io));
  };
  const auto refused = [&](const char* processor, const char* media_io, const std::string& says) {
    try {
      apply(processor, media_io);
      ADD_FAILURE() << processor << " " << media_io << " was accepted";
    } catch (const fovea::Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  EXPECT_EQ(apply("{}").image.max_pixels, server.image.max_pixels);
  EXPECT_EQ(apply("null", "null").image.max_pixels, server.image.max_pixels);
  const fovea::InputConfig lower = apply(R"({"max_pixels": 40000, "fps": 1, "num_frames": 4})");
  EXPECT_EQ(lower.image.max_pixels, 40000);
  EXPECT_LE(lower.image.min_pixels, 40000);
  EXPECT_EQ(lower.video.fps, 1);
  EXPECT_EQ(lower.video.num_frames, 4);
  EXPECT_EQ(lower.video.max_pixels, server.video.max_pixels);  // flat max_pixels: images only
  const fovea::InputConfig sized =
      apply(R"({"size": {"longest_edge": 50000}, "videos_kwargs": {"max_pixels": 60000}})");
  EXPECT_EQ(sized.image.max_pixels, 50000);
  EXPECT_EQ(sized.video.max_pixels, 60000);
  EXPECT_EQ(apply(R"({"images_kwargs": {"min_pixels": 1024, "max_pixels": 2048}})").image.min_pixels, 1024);
  refused(R"({"max_pixels": 100000000})", "", "raises the server's limit");
  refused(R"({"max_pixels": 1000000000})", "", "out of range");
  refused(R"({"size": {"longest_edge": 999999999}})", "", "size.longest_edge");
  refused(R"({"max_pixels": "big"})", "", "mm_processor_kwargs.max_pixels: must be an integer");
  refused(R"({"max_pixels": 1.5})", "", "must be an integer");
  refused(R"({"min_pixels": 70000, "max_pixels": 60000})", "", "above the largest budget");
  refused(R"({"fps": 1e300})", "", "mm_processor_kwargs.fps");
  refused(R"({"fps": -1})", "", "out of range");
  refused(R"({"num_frames": 100000})", "", "num_frames");
  refused(R"({"do_resize": false})", "", "mm_processor_kwargs.do_resize: not implemented");
  refused(R"({"size": {"height": 10}})", "", "size.height: not implemented");
  refused(R"({"images_kwargs": {"fps": 2}})", "", "images_kwargs.fps: not implemented");
  refused(R"({"videos_kwargs": []})", "", "must be an object");
  refused("[]", "", "mm_processor_kwargs: must be an object");
  refused("{}", R"({"video": {"num_frames": 8}})", "media_io_kwargs.video.num_frames: not implemented");
  refused("{}", R"({"audio": {}})", "media_io_kwargs.audio: not implemented");
  refused("{}", R"({"image": 3})", "must be an object");
}
