// CPU reference attention for packed varlen batches: exact (fp64), and emulations of the BF16 and
// FP8 GPU kernels (rounding, per-tensor E4M3 quantization, the P scheme). The oracle for every
// backend; see fovea/attention.h for what each mode computes.
#include <algorithm>
#include <cmath>
#include <limits>

#include "fovea/attention.h"
#include "fovea/attention-ref.h"
#include "fovea/bf16.h"
#include "fovea/error.h"
#include "fovea/flash-p.h"
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

std::vector<float> dct_matrix(int n) {
  std::vector<float> m(size_t(n) * size_t(n));
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      m[size_t(i) * n + j] =
          float((i == 0 ? std::sqrt(1.0 / n) : std::sqrt(2.0 / n)) * std::cos(M_PI * (j + 0.5) * i / n));
  return m;
}

namespace {

// The row FP8 quantizes for Q or K: x - shift, times mul where given (the qk_pair smoothing), then
// R (x - shift) when rot is given (fp32, in order; mul and rot never come together).
void fp8_input_row(const float* x, const float* shift, const float* mul, const float* rot, int hd, float* out) {
  if (mul) {
    for (int d = 0; d < hd; ++d) out[d] = (x[d] - shift[d]) * mul[d];
    return;
  }
  if (!rot) {
    for (int d = 0; d < hd; ++d) out[d] = x[d] - shift[d];
    return;
  }
  thread_local std::vector<float> c;
  c.resize(size_t(hd));
  for (int d = 0; d < hd; ++d) c[size_t(d)] = x[d] - shift[d];
  for (int i = 0; i < hd; ++i) {
    float acc = 0.0f;
    for (int d = 0; d < hd; ++d) acc = std::fma(rot[size_t(i) * hd + d], c[size_t(d)], acc);
    out[i] = acc;
  }
}

// Inputs as the kernel sees them, dense [tokens, heads, width] floats: bf16-rounded or E4M3-decoded
// (without the scale: the descales are applied to S and to the output, as in the kernel), zero past
// head_dim. FP8: element (h, d) is quantized as (x - shift[h * hd + d]) * mul[h * hd + d] (mul where not
// empty) with scale[h * hd + d]; with `split` ([H * n] rotary pairs, -1 none) each split channel's
// remainder fills its two padding slots, (lo, hi) for Q (split_q) and (hi, lo) for K, as the prepare
// kernel writes them (fovea/scales.h §split pairs).
std::vector<float> operand(const VarlenShape& sh, ThdView<const float> x, RefMode mode, const std::vector<float>& scale,
                           const std::vector<float>& shift, const std::vector<float>& mul, const float* rot, int width,
                           const std::vector<int32_t>& split = {}, bool split_q = false, bool exact = false) {
  const int64_t n = sh.total_tokens();
  const int hd = sh.head_dim, half = hd / 2;
  const int per_head = split.empty() ? 0 : int(split.size()) / sh.heads;
  std::vector<float> out(size_t(n) * sh.heads * width, 0.0f), row(static_cast<size_t>(hd));
  for (int64_t t = 0; t < n; ++t)
    for (int h = 0; h < sh.heads; ++h) {
      float* o = out.data() + (t * sh.heads + h) * width;
      if (mode != RefMode::FP8) {
        for (int d = 0; d < hd; ++d) o[d] = bf16_round(x.row(t, h)[d]);
        continue;
      }
      fp8_input_row(x.row(t, h), shift.data() + size_t(h) * hd, mul.empty() ? nullptr : mul.data() + size_t(h) * hd,
                    rot, hd, row.data());
      const float* s = scale.data() + size_t(h) * hd;
      for (int d = 0; d < hd; ++d)
        o[d] = exact ? row[size_t(d)] / s[d] : e4m3_to_float(e4m3_quantize(row[size_t(d)], s[d]));
      for (int i = 0; i < per_head && !exact; ++i) {
        const int p = split[size_t(h) * per_head + i];
        for (int j = 0; p >= 0 && j < 2; ++j) {
          const int c = p + j * half, a = fp8_split_slot(hd, i, j);
          const float y = row[size_t(c)] / s[c], hi = e4m3_to_float(e4m3_from_float(y));
          const float lo = e4m3_to_float(e4m3_from_float(y - hi));
          o[a] = split_q ? lo : hi;
          o[a + 1] = split_q ? hi : lo;
        }
      }
    }
  return out;
}

// Q's and K's per-(head, channel) multipliers from qk_pair [H * hd/2]: channel p and p + hd/2 of head h
// take qk_pair[h * hd/2 + p] (Q) and its fp32 reciprocal (K). Throws unless the size fits, every
// factor is finite and > 0, and rotate_qk is off.
void pair_multipliers(const Fp8Fine& fine, int H, int hd, std::vector<float>& q_mul, std::vector<float>& k_mul) {
  const size_t pairs = size_t(H) * size_t(hd / 2);
  if (hd % 2 != 0 || fine.qk_pair.size() != pairs)
    fail("attention: qk_pair holds {} values, not {} ({} heads x {} rotary pairs)", fine.qk_pair.size(), pairs, H,
         hd / 2);
  if (fine.rotate_qk) fail("attention: qk_pair and rotate_qk cannot be combined");
  q_mul.assign(size_t(H) * hd, 1.0f);
  k_mul.assign(size_t(H) * hd, 1.0f);
  for (int h = 0; h < H; ++h)
    for (int p = 0; p < hd / 2; ++p) {
      const float f = fine.qk_pair[size_t(h) * (hd / 2) + p];
      if (!std::isfinite(f) || !(f > 0)) fail("attention: qk_pair must be finite and > 0, got {}", f);
      for (int c : {p, p + hd / 2}) {
        q_mul[size_t(h) * hd + c] = f;
        k_mul[size_t(h) * hd + c] = 1.0f / f;
      }
    }
}

// The per-(head, channel) scale of one tensor: the fine vector where given ([H] or [H * hd]), else
// the per-tensor value. Throws unless every scale is a finite number > 0.
std::vector<float> expand_scale(const VarlenShape& sh, float per_tensor, const std::vector<float>& fine,
                                size_t per_head, const char* name) {
  const size_t H = size_t(sh.heads), hd = size_t(sh.head_dim);
  if (!fine.empty() && fine.size() != H * per_head)
    fail("attention: {} holds {} scales, not {} ({} heads x {})", name, fine.size(), H * per_head, H, per_head);
  std::vector<float> out(H * hd, per_tensor);
  for (size_t i = 0; i < out.size() && !fine.empty(); ++i) out[i] = fine[per_head == 1 ? i / hd : i];
  for (float x : out)
    if (!(x > 0.0f) || !std::isfinite(x)) fail("attention: FP8 {} scale must be a finite number > 0, got {}", name, x);
  return out;
}

// One query row, exact: two-pass softmax in fp64.
void row_exact(const float* q, ThdView<const float> k, ThdView<const float> v, int64_t begin, int64_t end, int h,
               int hd, double scale, std::vector<double>& s, double* out) {
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
// (bf16) or quantized (E4M3, p_scale included) before PV. q, k, v are the dense operand arrays. As the
// kernel does: the row max is taken over the raw scores, each exponent argument is one FMA,
// s * scale - (m - log2 p_scale); FP8 takes exp2_poly3 for the keys fovea/flash-p.h names (bit for bit
// as the kernel, given the same score) and std::exp2 for the others, which stands for the MUFU's
// ex2.approx (relative error below 2^-21, tests/gpu); FP8 sums P V and l per block and folds them with one FMA,
// o = o * corr + block (two-level accumulation), its l being the sum of the E4M3 P when the kernel
// sums on the tensor cores.
void row_flash(const float* q, const float* k, const float* v, int64_t begin, int64_t end, int h, int heads, int hd,
               int qk_width, float qk_scale_log2, const float* out_scale, RefMode mode, const PScheme& ps, bool exact_p,
               std::vector<float>& t, std::vector<float>& acc, std::vector<float>& block, double* out) {
  const int64_t len = end - begin;
  const int64_t nblocks = (len + ps.block_n - 1) / ps.block_n;
  const bool fp8 = mode == RefMode::FP8;
  const float p_shift = fp8 ? std::log2(ps.p_scale) : 0.0f;
  const uint32_t poly = fp8 ? fp8_poly_exp_pairs(hd) : 0u;
  const bool sum_quantized = fp8 && fp8_tensor_row_sum(hd);
  float m = -std::numeric_limits<float>::infinity();
  float l = 0.0f;
  std::fill(acc.begin(), acc.end(), 0.0f);
  for (int64_t bi = 0; bi < nblocks; ++bi) {
    const int64_t b = ps.reverse_kv ? nblocks - 1 - bi : bi;
    const int64_t j0 = begin + b * ps.block_n, j1 = std::min(end, j0 + ps.block_n);
    float bmax = -std::numeric_limits<float>::infinity();
    for (int64_t j = j0; j < j1; ++j) {
      const float* kr = k + (j * heads + h) * qk_width;
      float s = 0.0f;
      for (int d = 0; d < qk_width; ++d) s += q[d] * kr[d];
      t[size_t(j - j0)] = s;
      bmax = std::max(bmax, s);
    }
    const float m_new = std::max(m, bmax * qk_scale_log2);
    const float corr = std::exp2(m - m_new);  // 0 on the first block (m = -inf)
    m = m_new;
    const float shift = m - p_shift;
    if (!fp8)
      for (auto& a : acc) a *= corr;
    std::fill(block.begin(), block.end(), 0.0f);
    float lb = 0.0f;
    for (int64_t j = j0; j < j1; ++j) {
      const float arg = std::fma(t[size_t(j - j0)], qk_scale_log2, -shift);
      const bool on_fma = (poly >> ((j - j0) % 128 / 8)) & 1u;
      const float p = on_fma ? exp2_poly3(arg) : std::exp2(arg);
      const float pq = !fp8 ? bf16_round(p) : exact_p ? p : e4m3_to_float(e4m3_from_float(p));
      lb += sum_quantized ? pq : p;
      const float* vr = v + (j * heads + h) * hd;
      float* dst = fp8 ? block.data() : acc.data();
      for (int d = 0; d < hd; ++d) dst[d] += pq * vr[d];
    }
    l = std::fma(l, corr, lb);
    if (fp8)
      for (int d = 0; d < hd; ++d) acc[size_t(d)] = std::fma(acc[size_t(d)], corr, block[size_t(d)]);
  }
  for (int d = 0; d < hd; ++d) out[d] = bf16_round(acc[size_t(d)] * (out_scale[d] / l));
}

}  // namespace

void attention(const VarlenShape& sh, ThdView<const float> q, ThdView<const float> k, ThdView<const float> v,
               const RefOptions& opt, double* out) {
  sh.validate();
  if (!q.data || !k.data || !v.data || !out) fail("attention: null input or output pointer");
  if (opt.mode != RefMode::EXACT && opt.p.block_n <= 0) fail("attention: P scheme block_n must be > 0");
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
    parallel_for(
        rows,
        [&](int64_t r) {
          thread_local std::vector<double> s;
          const int64_t t = r / H;
          const int h = int(r % H);
          s.resize(size_t(sh.max_seqlen()));
          const int sg = seg[size_t(t)];
          row_exact(q.row(t, h), k, v, sh.cu_seqlens[size_t(sg)], sh.cu_seqlens[size_t(sg) + 1], h, hd, scale, s,
                    out + r * hd);
        },
        opt.threads, grain);
    return;
  }

  const bool fp8 = opt.mode == RefMode::FP8;
  const Fp8Fine& fine = opt.fp8_fine;
  const std::vector<float> ones(size_t(H) * hd, 1.0f), zeros(size_t(H) * hd, 0.0f);
  std::vector<float> sq = ones, sk = ones, sv = ones, k_shift = zeros;
  if (fp8) {
    sq = expand_scale(sh, opt.fp8_scales.q, fine.q_head, 1, "q");
    sk = expand_scale(sh, opt.fp8_scales.k, fine.k_head, 1, "k");
    sv = expand_scale(sh, opt.fp8_scales.v, fine.v_channel, size_t(hd), "v");
    if (!fine.k_mean.empty()) {
      if (fine.k_mean.size() != size_t(H) * hd)
        fail("attention: k_mean holds {} values, not {} ({} heads x {})", fine.k_mean.size(), size_t(H) * hd, H, hd);
      for (float x : fine.k_mean)
        if (!std::isfinite(x)) fail("attention: k_mean must be finite, got {}", x);
      k_shift = fine.k_mean;
    }
  } else if (!fine.empty()) {
    fail("attention: fine FP8 scales given for {} mode", ref_mode_name(opt.mode));
  }
  std::vector<float> q_mul, k_mul;
  if (fp8 && !fine.qk_pair.empty()) pair_multipliers(fine, H, hd, q_mul, k_mul);
  if (fp8 && !fine.qk_split.empty()) {
    check_split_pairs(fine.qk_split, H, hd, "attention: qk_split");
    if (fine.rotate_qk || !fine.qk_pair.empty())
      fail("attention: qk_split cannot be combined with rotate_qk or qk_pair");
  }
  const std::vector<float> rot = fp8 && fine.rotate_qk ? dct_matrix(hd) : std::vector<float>();
  const float* r = rot.empty() ? nullptr : rot.data();
  // The FP8 rows' zero padding, split pairs there (the robust scheme's rows are wider at 64 and 128).
  const int qk_width = !fp8 ? hd : fine.qk_split.empty() ? fp8_qk_width(hd) : fp8_robust_qk_width(hd);
  const Fp8Exact& ex = opt.fp8_exact;
  const std::vector<float> q8 = operand(sh, q, opt.mode, sq, zeros, q_mul, r, qk_width, fine.qk_split, true, ex.qk);
  const std::vector<float> k8 = operand(sh, k, opt.mode, sk, k_shift, k_mul, r, qk_width, fine.qk_split, false, ex.qk);
  const std::vector<float> v8 = operand(sh, v, opt.mode, sv, zeros, {}, nullptr, hd, {}, false, ex.v);
  std::vector<float> qk_scale_log2(static_cast<size_t>(H));  // per head: the Q and K descales fold into the score scale
  for (int h = 0; h < H; ++h)
    qk_scale_log2[size_t(h)] =
        float(scale * M_LOG2E * (fp8 ? double(sq[size_t(h) * hd]) * double(sk[size_t(h) * hd]) : 1.0));
  parallel_for(
      rows,
      [&](int64_t r) {
        thread_local std::vector<float> t, acc, block;
        t.resize(size_t(opt.p.block_n));
        acc.resize(size_t(hd));
        block.resize(size_t(hd));
        const int64_t tok = r / H;
        const int h = int(r % H);
        const int sg = seg[size_t(tok)];
        row_flash(q8.data() + r * qk_width, k8.data(), v8.data(), sh.cu_seqlens[size_t(sg)],
                  sh.cu_seqlens[size_t(sg) + 1], h, H, hd, qk_width, qk_scale_log2[size_t(h)],
                  sv.data() + size_t(h) * hd, opt.mode, opt.p, opt.fp8_exact.p, t, acc, block, out + r * hd);
      },
      opt.threads, grain);
}

float qk_pair_factor(float q_amax, float k_amax) {
  if (!(q_amax > 0) || !(k_amax > 0)) return 1.0f;
  const int e = int(std::lround(0.5 * std::log2(double(k_amax) / double(q_amax))));
  return std::ldexp(1.0f, std::clamp(e, -kQkPairMaxLog2, kQkPairMaxLog2));
}

Fp8Fine current_fine_scales(const VarlenShape& shape, ThdView<const float> q, ThdView<const float> k,
                            ThdView<const float> v, Fp8FineParts parts) {
  shape.validate();
  const int H = shape.heads, hd = shape.head_dim;
  const int64_t N = shape.total_tokens();
  const size_t cells = size_t(H) * hd;
  // f(h, row) for every (token, head) row of x, after checking that the row is finite.
  const auto each_row = [&](ThdView<const float> x, const char* name, auto&& f) {
    for (int64_t t = 0; t < N; ++t)
      for (int h = 0; h < H; ++h) {
        const float* r = x.row(t, h);
        for (int d = 0; d < hd; ++d)
          if (!std::isfinite(r[d])) fail("FP8 scales: {} holds a non-finite value ({})", name, r[d]);
        f(size_t(h), r);
      }
  };
  const auto to_scale = [](std::vector<float> amax) {
    for (float& a : amax) a = std::max(a / kE4M3Max, kMinScale);
    return amax;
  };
  Fp8Fine f;
  std::vector<float> mean(cells, 0.0f);
  if (parts.smooth_k) {
    std::vector<double> sum(cells, 0.0);
    each_row(k, "k", [&](size_t h, const float* r) {
      for (int d = 0; d < hd; ++d) sum[h * hd + d] += r[d];
    });
    for (size_t i = 0; i < cells; ++i) mean[i] = float(sum[i] / double(N));
    f.k_mean = mean;
  }
  f.rotate_qk = parts.rotate_qk;
  const bool per_pair = parts.smooth_qk_pairs || parts.split_pairs;
  if (per_pair && parts.rotate_qk) fail("FP8 scales: smooth_qk_pairs / split_pairs and rotate_qk cannot be combined");
  if (parts.smooth_qk_pairs && parts.split_pairs)
    fail("FP8 scales: smooth_qk_pairs and split_pairs cannot be combined");
  if (per_pair && hd % 2 != 0) fail("FP8 scales: rotary pairs need an even head_dim, got {}", hd);
  const std::vector<float> zeros(cells, 0.0f);
  std::vector<float> q_mul, k_mul;
  if (per_pair) {  // Q's and K - mean's amax per channel
    std::vector<float> qa(cells, 0.0f), ka(cells, 0.0f);
    each_row(q, "q", [&](size_t h, const float* r) {
      for (int d = 0; d < hd; ++d) qa[h * hd + d] = std::max(qa[h * hd + d], std::fabs(r[d]));
    });
    each_row(k, "k", [&](size_t h, const float* r) {
      for (int d = 0; d < hd; ++d) ka[h * hd + d] = std::max(ka[h * hd + d], std::fabs(r[d] - mean[h * hd + d]));
    });
    if (parts.split_pairs && fp8_split_pairs(hd) > 0) f.qk_split = pick_split_pairs(H, hd, qa.data(), ka.data());
    if (parts.smooth_qk_pairs) {
      const int half = hd / 2;
      f.qk_pair.resize(cells / 2);
      for (size_t i = 0; i < cells / 2; ++i) {
        const size_t h = i / size_t(half), p = i % size_t(half);
        f.qk_pair[i] = qk_pair_factor(std::max(qa[h * hd + p], qa[h * hd + p + half]),
                                      std::max(ka[h * hd + p], ka[h * hd + p + half]));
      }
      pair_multipliers(f, H, hd, q_mul, k_mul);
    }
  }
  if (parts.per_head_qk || parts.smooth_k || parts.rotate_qk || per_pair) {  // Q and K change range
    const std::vector<float> rot = parts.rotate_qk ? dct_matrix(hd) : std::vector<float>();
    std::vector<float> row(static_cast<size_t>(hd));
    // The per-head amax of x as quantized: minus shift, times mul, rotated where asked.
    const auto head_amax = [&](ThdView<const float> x, const char* name, const std::vector<float>& shift,
                               const std::vector<float>& mul) {
      std::vector<float> amax(size_t(H), 0.0f);
      each_row(x, name, [&](size_t h, const float* r) {
        fp8_input_row(r, shift.data() + h * hd, mul.empty() ? nullptr : mul.data() + h * hd,
                      rot.empty() ? nullptr : rot.data(), hd, row.data());
        for (int d = 0; d < hd; ++d) amax[h] = std::max(amax[h], std::fabs(row[size_t(d)]));
      });
      if (!parts.per_head_qk) std::fill(amax.begin(), amax.end(), *std::max_element(amax.begin(), amax.end()));
      return amax;
    };
    f.q_head = to_scale(head_amax(q, "q", zeros, q_mul));
    f.k_head = to_scale(head_amax(k, "k", mean, k_mul));
  }
  if (parts.per_channel_v) {
    std::vector<float> amax(cells, 0.0f);
    each_row(v, "v", [&](size_t h, const float* r) {
      for (int d = 0; d < hd; ++d) amax[h * hd + d] = std::max(amax[h * hd + d], std::fabs(r[d]));
    });
    f.v_channel = to_scale(amax);
  }
  return f;
}

FineBatch fine_batch(const VarlenShape& shape, ThdView<const float> q, ThdView<const float> k, ThdView<const float> v) {
  shape.validate();
  const int H = shape.heads, hd = shape.head_dim;
  const size_t cells = size_t(H) * size_t(hd);
  FineBatch b;
  b.tokens = shape.total_tokens();
  b.k_sum.assign(cells, 0.0);
  b.k_hi.assign(cells, -INFINITY);
  b.k_lo.assign(cells, INFINITY);
  b.v_amax.assign(cells, 0.0f);
  b.q_amax.assign(cells, 0.0f);
  const auto finite = [](float x) { return (float_bits(x) & 0x7F800000u) != 0x7F800000u; };
  for (int64_t t = 0; t < b.tokens; ++t)
    for (int h = 0; h < H; ++h) {
      const float *qr = q.row(t, h), *kr = k.row(t, h), *vr = v.row(t, h);
      for (int d = 0; d < hd; ++d) {
        const size_t i = size_t(h) * hd + d;
        b.finite = b.finite && finite(qr[d]) && finite(kr[d]) && finite(vr[d]);
        b.q_amax[i] = std::max(b.q_amax[i], std::fabs(qr[d]));
        b.k_sum[i] += kr[d];
        b.k_hi[i] = std::max(b.k_hi[i], kr[d]);
        b.k_lo[i] = std::min(b.k_lo[i], kr[d]);
        b.v_amax[i] = std::max(b.v_amax[i], std::fabs(vr[d]));
      }
    }
  return b;
}

}  // namespace fovea::cpu
