// fovea/safetensors.h: read-only access to Hugging Face safetensors checkpoints, memory-mapped.
// A checkpoint is one `*.safetensors` file or a sharded set listed by `model.safetensors.index.json`.
// Every malformed input (truncated file, corrupt header, offsets outside the data, an index that names
// a missing shard) is a fovea::Error naming the file and the problem.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fovea {

enum class DType { BF16, F16, F32 };  // the dtypes a vision checkpoint may hold
const char* dtype_str(DType d);     // "BF16", "F16", "F32" (safetensors spelling)

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // inside the mapping, little-endian
  size_t bytes = 0;
  std::string file;               // the file that holds it
  int64_t numel() const;
  // The values as fp32 (bf16 and f16 widened exactly).
  std::vector<float> to_float() const;
};

class SafetensorsFile;  // one mapped file

// All tensors of a checkpoint: a single file, a folder with one *.safetensors or with
// model.safetensors.index.json, or an index file itself.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& path);
  ~Checkpoint();
  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;

  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;

 private:
  Checkpoint() = default;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorInfo> tensors_;
};

// Limits, each a fovea::Error naming the file: a header of at most 100,000,000 bytes (the format's
// own cap) holding at most 2^18 tensors of at most 16 dimensions, nesting depth 4; every tensor's
// [begin, end) inside the data, end - begin == numel x dtype size (computed with overflow checks),
// and no two tensors overlapping. An index of at most 64 MiB and 2^18 tensors naming at most 4096
// shards, each one plain file name beside the index (no '/', no "..": never a path elsewhere).
// Only regular files are opened (a FIFO or device named as a shard fails at once, never blocks).

// The tensor table of a whole safetensors file held in memory (TensorInfo::data points into
// `bytes`); `file` names it in messages. What Checkpoint::open runs on each mapped file.
std::vector<TensorInfo> parse_safetensors(const uint8_t* bytes, size_t size, const std::string& file);
// An index file's text (`file` names it in messages): tensor name -> shard file name, validated.
std::map<std::string, std::string> parse_checkpoint_index(std::string_view text, const std::string& file);

// Writes tensors as one safetensors file (atomically), for tests, tools and `fovea encode -o`.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;      // little-endian, numel * element size
  std::span<const uint8_t> view{};  // used instead when `bytes` is empty: the caller's memory, which
                                   // must outlive the write (no copy of large outputs)
  std::span<const uint8_t> data() const { return bytes.empty() ? view : std::span<const uint8_t>(bytes); }
};
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// The same file's bytes, in memory (`fovea serve` replies with them); `name` is used in errors.
std::string safetensors_bytes(const std::string& name, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});
// Only the file's head (header length, header, padding), from the tensors' names, dtypes and shapes
// (their data is not looked at); `data_bytes` gets what the data takes after it, in the given order.
// For writers that lay the data out themselves, straight after it.
std::string safetensors_header(const std::string& name, const std::vector<TensorToWrite>& tensors,
                               const std::map<std::string, std::string>& metadata, size_t* data_bytes);

}  // namespace fovea
