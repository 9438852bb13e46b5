// Fuzzes the safetensors reader (fovea::parse_safetensors, src/model/safetensors.cpp, the function
// Checkpoint::open runs on each mapped file): any file bytes give a tensor table whose every tensor
// lies inside the file, disjoint from the others, or a fovea::Error.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "fovea/error.h"
#include "fovea/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A copy of exactly `size` bytes, so ASan sees a read past the end of the "file".
  const std::vector<uint8_t> file(data, data + size);
  try {
    const std::vector<fovea::TensorInfo> ts = fovea::parse_safetensors(file.data(), file.size(), "fuzz");
    std::vector<std::pair<const uint8_t*, const uint8_t*>> spans;
    for (const fovea::TensorInfo& t : ts) {
      if (t.data < file.data() || t.data + t.bytes > file.data() + file.size()) std::abort();
      if (t.bytes) spans.push_back({t.data, t.data + t.bytes});
      if (t.numel() <= (1 << 16)) {
        const std::vector<float> v = t.to_float();  // reads every byte of the tensor
        if (v.size() != size_t(t.numel())) std::abort();
      }
    }
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i)
      if (spans[i].first < spans[i - 1].second) std::abort();
  } catch (const fovea::Error&) {}
  return 0;
}
