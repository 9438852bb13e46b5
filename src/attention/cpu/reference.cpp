// CPU reference attention for packed varlen batches: exact (fp64), and emulations of the BF16 and
// FP8 GPU kernels (rounding, per-tensor E4M3 quantization, the P scheme). The oracle for every
// backend; see fovea/attention.h for what each mode computes.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

#include "fovea/attention.h"
#include "fovea/bf16.h"
#include "fovea/error.h"
#include "fovea/fp8.h"
#include "fovea/threads.h"

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
      fail("attention: segment {} is empty or negative (cu_seqlens[{}] = {}, cu_seqlens[{}] = {})", i - 1,
           i - 1, cu_seqlens[i - 1], i, cu_seqlens[i]);
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
        if (!std::isfinite(a)) nonfinite = true;
        else m = std::max(m, a);
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

namespace cpu {

const char* ref_mode_name(RefMode m) {
  switch (m) {
    case RefMode::EXACT: return "exact";
    case RefMode::BF16: return "bf16";
    case RefMode::FP8: return "fp8";
  }
  return "?";
}

namespace {

// Inputs as the kernel sees them, dense [tokens, heads, hd] floats: bf16-rounded or E4M3-decoded
// (without the scale: the descales are applied to S and to the output, as in the kernel).
std::vector<float> operand(const VarlenShape& sh, ThdView<const float> x, RefMode mode, float scale) {
  const int64_t n = sh.total_tokens();
  std::vector<float> out(size_t(n) * sh.heads * sh.head_dim);
  for (int64_t t = 0; t < n; ++t)
    for (int h = 0; h < sh.heads; ++h) {
      const float* r = x.row(t, h);
      float* o = out.data() + (t * sh.heads + h) * sh.head_dim;
      for (int d = 0; d < sh.head_dim; ++d)
        o[d] = mode == RefMode::FP8 ? e4m3_to_float(e4m3_quantize(r[d], scale)) : bf16_round(r[d]);
    }
  return out;
}

// One query row, exact: two-pass softmax in fp64.
void row_exact(const float* q, ThdView<const float> k, ThdView<const float> v, int64_t begin, int64_t end,
               int h, int hd, double scale, std::vector<double>& s, double* out) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = begin; j < end; ++j) {
    const float* kr = k.row(j, h);
    double acc = 0;
    for (int d = 0; d < hd; ++d) acc += double(q[d]) * double(kr[d]);
    s[size_t(j - begin)] = acc * scale;
    m = std::max(m, s[size_t(j - begin)]);
  }
  double l = 0;
  std::fill(out, out + hd, 0.0);
  for (int64_t j = begin; j < end; ++j) {
    const double p = std::exp(s[size_t(j - begin)] - m);
    l += p;
    const float* vr = v.row(j, h);
    for (int d = 0; d < hd; ++d) out[d] += p * double(vr[d]);
  }
  for (int d = 0; d < hd; ++d) out[d] /= l;
}

// One query row as the flash kernel computes it: online softmax over KV blocks in fp32, P rounded
// (bf16) or quantized (E4M3 x p_scale) before PV. q, k, v are the dense operand arrays.
void row_flash(const float* q, const float* k, const float* v, int64_t begin, int64_t end, int h, int heads,
               int hd, float qk_scale_log2, float out_scale, RefMode mode, const PScheme& ps,
               std::vector<float>& t, std::vector<float>& acc, double* out) {
  const int64_t len = end - begin;
  const int64_t nblocks = (len + ps.block_n - 1) / ps.block_n;
  const float p_scale = mode == RefMode::FP8 ? ps.p_scale : 1.0f;
  float m = -std::numeric_limits<float>::infinity();
  float l = 0.0f;
  std::fill(acc.begin(), acc.end(), 0.0f);
  for (int64_t bi = 0; bi < nblocks; ++bi) {
    const int64_t b = ps.reverse_kv ? nblocks - 1 - bi : bi;
    const int64_t j0 = begin + b * ps.block_n, j1 = std::min(end, j0 + ps.block_n);
    float bmax = -std::numeric_limits<float>::infinity();
    for (int64_t j = j0; j < j1; ++j) {
      const float* kr = k + (j * heads + h) * hd;
      float s = 0.0f;
      for (int d = 0; d < hd; ++d) s += q[d] * kr[d];
      t[size_t(j - j0)] = s * qk_scale_log2;  // logits in log2 units
      bmax = std::max(bmax, t[size_t(j - j0)]);
    }
    const float m_new = std::max(m, bmax);
    const float corr = std::exp2(m - m_new);  // 0 on the first block (m = -inf)
    l *= corr;
    for (auto& a : acc) a *= corr;
    m = m_new;
    for (int64_t j = j0; j < j1; ++j) {
      const float p = std::exp2(t[size_t(j - j0)] - m);
      l += p;
      const float pq = mode == RefMode::FP8 ? e4m3_to_float(e4m3_from_float(p * p_scale)) : bf16_round(p);
      const float* vr = v + (j * heads + h) * hd;
      for (int d = 0; d < hd; ++d) acc[size_t(d)] += pq * vr[d];
    }
  }
  const float inv = out_scale / (p_scale * l);
  for (int d = 0; d < hd; ++d) out[d] = bf16_round(acc[size_t(d)] * inv);
}

}  // namespace

void attention(const VarlenShape& sh, ThdView<const float> q, ThdView<const float> k, ThdView<const float> v,
               const RefOptions& opt, double* out) {
  sh.validate();
  if (!q.data || !k.data || !v.data || !out) fail("attention: null input or output pointer");
  if (opt.mode != RefMode::EXACT && opt.p.block_n <= 0) fail("attention: P scheme block_n must be > 0");
  if (opt.mode == RefMode::FP8)
    for (int i = 0; i < 3; ++i)
      if (!(opt.fp8_scales[i] > 0.0f) || !std::isfinite(opt.fp8_scales[i]))
        fail("attention: FP8 {} scale must be a finite number > 0, got {}", kQkvNames[i], opt.fp8_scales[i]);
  const int H = sh.heads, hd = sh.head_dim;
  const int64_t N = sh.total_tokens();
  const double scale = opt.softmax_scale > 0 ? opt.softmax_scale : 1.0 / std::sqrt(double(hd));

  // Segment of each token, so every (token, head) row is an independent task.
  std::vector<int32_t> seg(static_cast<size_t>(N));
  for (int s = 0; s < sh.num_segments(); ++s)
    for (int32_t t = sh.cu_seqlens[size_t(s)]; t < sh.cu_seqlens[size_t(s) + 1]; ++t) seg[size_t(t)] = s;

  const int64_t rows = N * H;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max(1, sh.max_seqlen()));
  if (opt.mode == RefMode::EXACT) {
    parallel_for(rows, [&](int64_t r) {
      thread_local std::vector<double> s;
      const int64_t t = r / H;
      const int h = int(r % H);
      s.resize(size_t(sh.max_seqlen()));
      const int sg = seg[size_t(t)];
      row_exact(q.row(t, h), k, v, sh.cu_seqlens[size_t(sg)], sh.cu_seqlens[size_t(sg) + 1], h, hd, scale, s,
                out + r * hd);
    }, opt.threads, grain);
    return;
  }

  const bool fp8 = opt.mode == RefMode::FP8;
  const std::vector<float> q8 = operand(sh, q, opt.mode, opt.fp8_scales.q);
  const std::vector<float> k8 = operand(sh, k, opt.mode, opt.fp8_scales.k);
  const std::vector<float> v8 = operand(sh, v, opt.mode, opt.fp8_scales.v);
  const float qk_scale_log2 =
      float(scale * M_LOG2E * (fp8 ? double(opt.fp8_scales.q) * double(opt.fp8_scales.k) : 1.0));
  const float out_scale = fp8 ? opt.fp8_scales.v : 1.0f;
  parallel_for(rows, [&](int64_t r) {
    thread_local std::vector<float> t, acc;
    t.resize(size_t(opt.p.block_n));
    acc.resize(size_t(hd));
    const int64_t tok = r / H;
    const int h = int(r % H);
    const int sg = seg[size_t(tok)];
    row_flash(q8.data() + r * hd, k8.data(), v8.data(), sh.cu_seqlens[size_t(sg)], sh.cu_seqlens[size_t(sg) + 1],
              h, H, hd, qk_scale_log2, out_scale, opt.mode, opt.p, t, acc, out + r * hd);
  }, opt.threads, grain);
}

}  // namespace cpu
}  // namespace fovea
