// What every attention backend shares (fovea/attention.h): backend and dtype names, the varlen
// batch shape and its checks, per-tensor amax, and the error statistics backends are judged by.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

#include "fovea/attention.h"
#include "fovea/error.h"

namespace fovea {

const char* backend_name(AttnBackend b) {
  switch (b) {
    case AttnBackend::AUTO: return "AUTO";
    case AttnBackend::FOVEA: return "FOVEA";
    case AttnBackend::CUDNN: return "CUDNN";
    case AttnBackend::CPU: return "CPU";
  }
  return "?";
}

const char* dtype_name(AttnDtype d) {
  switch (d) {
    case AttnDtype::AUTO: return "auto";
    case AttnDtype::BF16: return "bf16";
    case AttnDtype::FP8: return "fp8";
  }
  return "?";
}

namespace {
std::string lower(std::string s) {
  for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
}  // namespace

std::optional<AttnBackend> parse_backend(const std::string& s) {
  const std::string l = lower(s);
  if (l == "auto") return AttnBackend::AUTO;
  if (l == "fovea") return AttnBackend::FOVEA;
  if (l == "cudnn" || l == "flashinfer") return AttnBackend::CUDNN;
  if (l == "cpu") return AttnBackend::CPU;
  return std::nullopt;
}

std::optional<AttnDtype> parse_dtype(const std::string& s) {
  const std::string l = lower(s);
  if (l == "auto") return AttnDtype::AUTO;
  if (l == "bf16" || l == "bfloat16") return AttnDtype::BF16;
  if (l == "fp8" || l == "fp8_e4m3") return AttnDtype::FP8;
  return std::nullopt;
}

int VarlenShape::max_seqlen() const {
  int m = 0;
  for (size_t i = 1; i < cu_seqlens.size(); ++i) m = std::max(m, cu_seqlens[i] - cu_seqlens[i - 1]);
  return m;
}

double VarlenShape::flops() const {
  double s2 = 0;
  for (size_t i = 1; i < cu_seqlens.size(); ++i) {
    const double s = cu_seqlens[i] - cu_seqlens[i - 1];
    s2 += s * s;
  }
  return 4.0 * s2 * head_dim * heads;
}

void VarlenShape::validate() const {
  if (heads <= 0) fail("attention: heads must be > 0, got {}", heads);
  if (head_dim <= 0) fail("attention: head_dim must be > 0, got {}", head_dim);
  if (cu_seqlens.size() < 2) fail("attention: cu_seqlens needs at least 2 entries, got {}", cu_seqlens.size());
  if (cu_seqlens[0] != 0) fail("attention: cu_seqlens[0] must be 0, got {}", cu_seqlens[0]);
  for (size_t i = 1; i < cu_seqlens.size(); ++i)
    if (cu_seqlens[i] <= cu_seqlens[i - 1])
      fail("attention: segment {} is empty or negative (cu_seqlens[{}] = {}, cu_seqlens[{}] = {})", i - 1, i - 1,
           cu_seqlens[i - 1], i, cu_seqlens[i]);
}

VarlenShape varlen_from_seqlens(const std::vector<int>& seqlens, int heads, int head_dim) {
  VarlenShape s;
  s.heads = heads;
  s.head_dim = head_dim;
  s.cu_seqlens.push_back(0);
  for (int n : seqlens) {
    if (n < 1) fail("attention: segment lengths must be >= 1, got {}", n);
    if (int64_t(s.cu_seqlens.back()) + n > std::numeric_limits<int32_t>::max())
      fail("attention: total tokens exceed int32");
    s.cu_seqlens.push_back(s.cu_seqlens.back() + n);
  }
  s.validate();
  return s;
}

float amax(const VarlenShape& shape, ThdView<const float> x) {
  float m = 0.0f;
  bool nonfinite = false;
  for (int64_t t = 0; t < shape.total_tokens(); ++t)
    for (int h = 0; h < shape.heads; ++h) {
      const float* r = x.row(t, h);
      for (int d = 0; d < shape.head_dim; ++d) {
        const float a = std::fabs(r[d]);
        if (!std::isfinite(a))
          nonfinite = true;
        else
          m = std::max(m, a);
      }
    }
  return nonfinite ? std::numeric_limits<float>::infinity() : m;
}

ErrorStats compare(const double* out, const double* ref, int64_t n) {
  ErrorStats e;
  double num = 0, den = 0, sum_abs = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(out[i])) {
      ++e.nonfinite;
      continue;
    }
    const double d = std::fabs(out[i] - ref[i]);
    num += d * d;
    den += ref[i] * ref[i];
    sum_abs += d;
    e.max_abs = std::max(e.max_abs, d);
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  e.rel_l2 = e.nonfinite ? nan : (den > 0 ? std::sqrt(num / den) : std::sqrt(num));
  if (e.nonfinite) e.max_abs = nan;
  e.mean_abs = n ? sum_abs / double(n) : 0;
  return e;
}

}  // namespace fovea
