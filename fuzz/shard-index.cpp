// Fuzzes the sharded-checkpoint index reader (fovea::parse_checkpoint_index, what Checkpoint::open
// runs on model.safetensors.index.json): any text gives tensor -> shard names that are each one
// plain file name beside the index, or a fovea::Error.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "fovea/error.h"
#include "fovea/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    for (const auto& [name, shard] : fovea::parse_checkpoint_index(text, "fuzz"))
      if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos) std::abort();
  } catch (const fovea::Error&) {}
  return 0;
}
