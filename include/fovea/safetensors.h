// fovea/safetensors.h: read-only access to Hugging Face safetensors checkpoints, memory-mapped.
// A checkpoint is one `*.safetensors` file or a sharded set listed by `model.safetensors.index.json`.
// Every malformed input (truncated file, corrupt header, offsets outside the data, an index that names
// a missing shard) is a fovea::Error naming the file and the problem.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
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

// Writes tensors as one safetensors file (atomically), for tests, tools and `fovea encode -o`.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // little-endian, numel * element size
};
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// The same file's bytes, in memory (`fovea serve` replies with them); `name` is used in errors.
std::string safetensors_bytes(const std::string& name, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace fovea
