// fovea/safetensors.h: read-only access to Hugging Face safetensors checkpoints, memory-mapped.
// A checkpoint is one `*.safetensors` file or a sharded set listed by `model.safetensors.index.json`.
// Every malformed input (truncated file, corrupt header, offsets outside the data, an index that names
// a missing shard) is a fovea::Error naming the file and the problem.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fovea {

// The dtypes fovea reads: BF16, F16 and F32 widen exactly to fp32; F8_E4M3 (FP8 releases' linear
// weights) only with its scale, through the model loader (docs/encoder.md §FP8 releases).
enum class DType { BF16, F16, F32, F8_E4M3 };
const char* dtype_str(DType d);  // "BF16", "F16", "F32", "F8_E4M3" (safetensors spelling)
size_t dtype_size(DType d);      // bytes per element: 2, 2, 4, 1

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // inside the mapping, little-endian
  size_t bytes = 0;
  std::string file;  // the file that holds it
  int64_t numel() const;
  // The values as fp32 (bf16 and f16 widened exactly). An F8_E4M3 tensor is an error: its values
  // mean nothing without its scale.
  std::vector<float> to_float() const;
};

class SafetensorsFile;  // one mapped file

// Which tensors a reader keeps, by name (empty: all). A tensor not kept is validated like every
// other (its entry, dtype, shape, offsets and size within the file, no overlap; any dtype of the
// safetensors format, FP8 and integer ones included) but never looked at again: a vision encoder
// skips an FP8 release's language model this way before its dtype matters.
using TensorFilter = std::function<bool(const std::string& name)>;

// All tensors of a checkpoint: a single file, a folder with one *.safetensors or with
// model.safetensors.index.json, or an index file itself.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& path, const TensorFilter& keep = {});
  ~Checkpoint();
  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;

  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;
  // The tensors `keep` turned away: name -> the file that holds it.
  const std::map<std::string, std::string>& skipped() const { return skipped_; }

 private:
  Checkpoint() = default;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> skipped_;
};

// Limits, each a fovea::Error naming the file: a header of at most 100,000,000 bytes (the format's
// own cap) holding at most 2^18 tensors of at most 16 dimensions, nesting depth 4; every tensor's
// [begin, end) inside the data, end - begin == numel x dtype size (computed with overflow checks),
// and no two tensors overlapping. An index of at most 64 MiB and 2^18 tensors naming at most 4096
// shards, each one plain file name beside the index (no '/', no "..": never a path elsewhere).
// Only regular files are opened (a FIFO or device named as a shard fails at once, never blocks).
// A kept tensor's dtype must be one of DType; a skipped one's any dtype the format defines (BOOL,
// U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64, C64, and
// the packed F4, F6_E2M3, F6_E3M2 whose bits must fill whole bytes).

// The tensor table of a whole safetensors file held in memory (TensorInfo::data points into
// `bytes`); `file` names it in messages. What Checkpoint::open runs on each mapped file. Tensors
// `keep` turns away are validated, then only their names go to `skipped` (when given).
std::vector<TensorInfo> parse_safetensors(const uint8_t* bytes, size_t size, const std::string& file,
                                          const TensorFilter& keep = {}, std::vector<std::string>* skipped = nullptr);
// An index file's text (`file` names it in messages): tensor name -> shard file name, validated.
std::map<std::string, std::string> parse_checkpoint_index(std::string_view text, const std::string& file);

// Writes tensors as one safetensors file (atomically), for tests, tools and `fovea encode -o`.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;       // little-endian, numel * element size
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
