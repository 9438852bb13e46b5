// Fuzzes preprocessor_config.json parsing (fovea::image::parse_preprocess_config, what
// load_preprocess_config runs) and the check against the model: any text gives settings inside the
// documented ranges that smart_resize can use, or a fovea::Error.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "fovea/error.h"
#include "fovea/image.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace im = fovea::image;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const im::PreprocessConfig p = im::parse_preprocess_config(text, "fuzz");
    if (p.min_pixels < 1 || p.max_pixels < p.min_pixels || p.max_pixels > im::kMaxPixelBudget) std::abort();
    for (int i = 0; i < 3; ++i)
      if (!std::isfinite(p.mean[i]) || !(p.std[i] > 0)) std::abort();
    // The budget must be usable: smart_resize of a few image sizes stays within the budget's range.
    for (const auto [h, w] : {std::pair{1, 1}, std::pair{480, 640}, std::pair{100, 20000}, std::pair{16384, 16384}}) {
      try {
        const auto [rh, rw] = im::smart_resize(h, w, p.patch * p.merge, p.min_pixels, p.max_pixels);
        if (rh <= 0 || rw <= 0 || rh % (p.patch * p.merge) || rw % (p.patch * p.merge)) std::abort();
      } catch (const fovea::Error&) {}
    }
    im::check_against_model(p, "fuzz", *fovea::qwen3vl::synthetic_config("synthetic:tiny"));
  } catch (const fovea::Error&) {}
  return 0;
}
