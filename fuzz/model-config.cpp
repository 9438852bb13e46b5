// Fuzzes config.json parsing (fovea::qwen3vl::parse_config, what load_model runs): any text gives a
// vision config inside the documented ranges, or a fovea::Error naming the field.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "fovea/error.h"
#include "fovea/model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace q = fovea::qwen3vl;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const q::VisionConfig c = q::parse_config(text, "fuzz");
    if (c.depth < 1 || c.depth > q::kMaxDepth || c.hidden < 1 || c.hidden > q::kMaxHidden || c.hidden % c.heads ||
        c.head_dim() % 4 || c.pos_side() * c.pos_side() != c.num_pos_embeddings)
      std::abort();
    for (int d : c.deepstack)
      if (d < 0 || d >= c.depth) std::abort();
    (void)c.patch_dim();
    (void)c.merged_dim();
    const auto tensors = q::expected_tensors(c);  // every shape is computed from the config
    if (tensors.empty()) std::abort();
  } catch (const fovea::Error&) {}
  return 0;
}
