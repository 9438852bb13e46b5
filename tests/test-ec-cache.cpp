// The encoder cache in vLLM's layout (fovea/ec-cache.h) and SHA-256 (fovea/sha256.h): the file's
// name, tensor, dtype, shape and column order read back with fovea's safetensors reader; atomic
// writes under a polling reader; a write that fails leaves nothing; the byte budget evicts the least
// recently written or read of fovea's files and never another writer's; a restart rebuilds it.
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <atomic>
#include <filesystem>
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
  EXPECT_EQ(sha256_hex(bytes_of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),  // 56 bytes: two tail blocks
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(bytes_of(std::string(1000000, 'a'))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(EcCache, KeysAreOneSafeFolderName) {
  for (const std::string& ok : std::vector<std::string>{"a", "0c4f-uuid", "sha256:abc", std::string(255, 'k'), ".hidden", "a b"})
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
    for (const auto& e : fs::directory_iterator(fs::path(path).parent_path())) names.push_back(e.path().filename().string());
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
                             out.deepstack[d].end())) << "deepstack " << d;
    EXPECT_TRUE(cache.load(key, {1, 2, int(tokens) * 2}, cfg, /*with_deepstack=*/false).rows.deepstack.empty());
    EXPECT_HAS(error_of([&] { cache.load(key, {1, 2, int(tokens + 1) * 2}, cfg); }), "not BF16 [38");
    const EcCache::Stats s = cache.stats();
    EXPECT_EQ(s.hits, 1u);
    EXPECT_EQ(s.misses, 1u);
    EXPECT_EQ(s.writes, 1u);
  }
  EXPECT_HAS(error_of([&] {
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
    cache.store("k", random_outputs(size_t(200 + 97 * (i % 5)), 16, 3, unsigned(i)).view(), {1, 2, 2}, config_with(16, 3));
  done = true;
  reader.join();
  EXPECT_GT(opened, 0);
  EXPECT_EQ(partial, 0);
}

// A write that fails part way (here: the file-size limit, as a full disk would) is an error naming
// the file, and leaves neither the file nor a temporary one.
TEST(EcCache, FailedWriteLeavesNothing) {
  TempDir dir;
  EcCache cache(dir.file("c"), 0);
  struct sigaction ignore {}, old {};
  ignore.sa_handler = SIG_IGN;
  sigaction(SIGXFSZ, &ignore, &old);
  rlimit saved{};
  getrlimit(RLIMIT_FSIZE, &saved);
  rlimit small = saved;
  small.rlim_cur = 4096;
  setrlimit(RLIMIT_FSIZE, &small);
  const std::string msg = error_of([&] {
    cache.store("big", random_outputs(512, 64, 3, 1).view(), {1, 2, 2}, config_with(64, 3));
  });
  setrlimit(RLIMIT_FSIZE, &saved);
  sigaction(SIGXFSZ, &old, nullptr);
  EXPECT_HAS(msg, "encoder_cache.safetensors");
  EXPECT_HAS(msg, "write failed");
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(fs::path(dir.file("c")) / "big")) left.push_back(e.path().filename().string());
  EXPECT_TRUE(left.empty()) << left.front();
  EXPECT_FALSE(cache.lookup("big"));
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

}  // namespace
