// CPU reference attention for packed varlen batches: exact (fp64), and emulations of the BF16 and
// FP8 GPU kernels (rounding, per-tensor E4M3 quantization, the P scheme). The oracle for every
// backend; see fovea/attention.h for what each mode computes.
#include <algorithm>
#include <cmath>
#include <limits>

#include "fovea/attention.h"
#include "fovea/bf16.h"
#include "fovea/error.h"
#include "fovea/fp8.h"
#include "fovea/threads.h"

namespace fovea::cpu {

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

}  // namespace fovea::cpu
