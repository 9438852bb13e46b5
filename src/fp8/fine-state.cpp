// The robust scheme's state of one layer: a forward recorded into it (record_fine), and the state as
// one block of bytes (the C ABI's robust state, DeviceFineHistory's memory) with its checks.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "fovea/error.h"
#include "fovea/scales.h"

namespace fovea {

FineScales record_fine(FineHistory& f, const FineBatch& b, const std::string& what) {
  const int H = f.heads;
  const size_t cells = size_t(H) * size_t(f.head_dim);
  if (b.k_sum.size() != cells || b.k_hi.size() != cells || b.k_lo.size() != cells || b.v_amax.size() != cells ||
      b.q_amax.size() != cells || b.tokens <= 0)
    fail("{}: a batch's statistics are not for {} heads of {} channels", what, H, f.head_dim);
  FineCounts& c = f.counts;
  const bool keep = b.finite;
  const int slot = c.pos, filled = keep ? std::min(c.filled + 1, kAmaxHistoryLen) : c.filled;
  FineScales out;
  out.k_mean.resize(cells);
  out.v_channel.resize(cells);
  out.q_head.resize(size_t(H));
  out.k_head.resize(size_t(H));
  std::vector<float> dev(size_t(H), 0.0f), qa(size_t(H), 0.0f), k_chan(cells);
  for (size_t i = 0; i < cells; ++i) {
    const float mean = float(b.k_sum[i] / double(b.tokens));
    out.k_mean[i] = mean;
    k_chan[i] = smoothed_amax(b.k_hi[i], b.k_lo[i], mean);
    float& d = dev[i / size_t(f.head_dim)];
    d = std::max(d, k_chan[i]);
    float& q = qa[i / size_t(f.head_dim)];
    q = std::max(q, b.q_amax[i]);
    out.v_channel[i] =
        fine_ring_scale(fine_ring_prev(f.v_ring.data() + i, int(cells), filled, slot, keep), keep, b.v_amax[i]);
  }
  if (fp8_split_pairs(f.head_dim) > 0) out.qk_split = pick_split_pairs(H, f.head_dim, b.q_amax.data(), k_chan.data());
  for (int h = 0; h < H; ++h) {
    out.q_head[size_t(h)] =
        fine_ring_scale(fine_ring_prev(f.q_ring.data() + h, H, filled, slot, keep), keep, qa[size_t(h)]);
    out.k_head[size_t(h)] =
        fine_ring_scale(fine_ring_prev(f.k_ring.data() + h, H, filled, slot, keep), keep, dev[size_t(h)]);
  }
  c.updates += 1;
  if (!keep) {
    c.nonfinite += 1;
    return out;
  }
  for (int h = 0; h < H; ++h) {
    f.q_ring[size_t(slot) * H + h] = qa[size_t(h)];
    f.k_ring[size_t(slot) * H + h] = dev[size_t(h)];
  }
  for (size_t i = 0; i < cells; ++i) {
    f.v_ring[size_t(slot) * cells + i] = b.v_amax[i];
    f.k_sum[i] += b.k_sum[i];
    f.k_hi[i] = std::max(f.k_hi[i], b.k_hi[i]);
    f.k_lo[i] = std::min(f.k_lo[i], b.k_lo[i]);
    f.q_hi[i] = std::max(f.q_hi[i], b.q_amax[i]);
  }
  c.pos = (slot + 1) % kAmaxHistoryLen;
  c.filled = filled;
  c.tokens += double(b.tokens);
  return out;
}

FineStateLayout::FineStateLayout(int heads, int head_dim) {
  cells = size_t(heads) * size_t(head_dim);
  k_sum = 16;                  // after the header
  counts = k_sum + cells * 8;  // FineCounts holds a double: 8-byte aligned here
  k_hi = counts + sizeof(FineCounts);
  k_lo = k_hi + cells * 4;
  q_hi = k_lo + cells * 4;
  q = q_hi + cells * 4;
  k = q + size_t(kAmaxHistoryLen) * size_t(heads) * 4;
  v = k + size_t(kAmaxHistoryLen) * size_t(heads) * 4;
  bytes = v + size_t(kAmaxHistoryLen) * cells * 4;
}

namespace {
void check_shape(const FineHistory& h) {
  const size_t cells = size_t(h.heads) * size_t(h.head_dim), ring = size_t(kAmaxHistoryLen) * size_t(h.heads);
  if (h.q_ring.size() != ring || h.k_ring.size() != ring || h.v_ring.size() != kAmaxHistoryLen * cells ||
      h.k_sum.size() != cells || h.k_hi.size() != cells || h.k_lo.size() != cells || h.q_hi.size() != cells)
    fail("robust state: the arrays of a history of {} heads x {} have other sizes", h.heads, h.head_dim);
}

bool finite(double x) { return std::isfinite(x); }
}  // namespace

void pack_fine_state(const FineHistory& h, void* block) {
  check_shape(h);
  const FineStateLayout l(h.heads, h.head_dim);
  auto* b = static_cast<uint8_t*>(block);
  const int32_t header[4] = {int32_t(kFineStateMagic), h.heads, h.head_dim, 0};
  std::memcpy(b, header, sizeof header);
  const auto put = [&](size_t at, const auto& v) { std::memcpy(b + at, v.data(), v.size() * sizeof(v[0])); };
  put(l.k_sum, h.k_sum), put(l.k_hi, h.k_hi), put(l.k_lo, h.k_lo), put(l.q_hi, h.q_hi);
  put(l.q, h.q_ring), put(l.k, h.k_ring), put(l.v, h.v_ring);
  std::memcpy(b + l.counts, &h.counts, sizeof(FineCounts));
}

FineHistory unpack_fine_state(const void* block, int heads, int head_dim, const std::string& what) {
  const auto* b = static_cast<const uint8_t*>(block);
  int32_t header[4];
  std::memcpy(header, b, sizeof header);
  if (uint32_t(header[0]) != kFineStateMagic)
    fail("{}: not a robust state (its first 4 bytes are {:#010x}; fovea_attn_robust_state_init writes one)", what,
         uint32_t(header[0]));
  if (header[1] != heads || header[2] != head_dim)
    fail("{}: a robust state for {} heads of {}, not {} of {}", what, header[1], header[2], heads, head_dim);
  FineHistory h(heads, head_dim);
  const FineStateLayout l(heads, head_dim);
  const auto get = [&](auto& v, size_t at) { std::memcpy(v.data(), b + at, v.size() * sizeof(v[0])); };
  get(h.k_sum, l.k_sum), get(h.k_hi, l.k_hi), get(h.k_lo, l.k_lo), get(h.q_hi, l.q_hi);
  get(h.q_ring, l.q), get(h.k_ring, l.k), get(h.v_ring, l.v);
  std::memcpy(&h.counts, b + l.counts, sizeof(FineCounts));
  const FineCounts& c = h.counts;
  if (c.pos < 0 || c.pos >= kAmaxHistoryLen) fail("{}: pos = {} is outside [0, {})", what, c.pos, kAmaxHistoryLen);
  if (c.filled < 0 || c.filled > kAmaxHistoryLen)
    fail("{}: filled = {} is outside [0, {}]", what, c.filled, kAmaxHistoryLen);
  if (c.filled < kAmaxHistoryLen && c.pos != c.filled)
    fail("{}: pos = {} with filled = {} (the rings fill in order until they wrap)", what, c.pos, c.filled);
  if (!finite(c.tokens) || c.tokens < 0) fail("{}: tokens = {} is not a finite number >= 0", what, c.tokens);
  const auto live = [&](const std::vector<float>& ring, size_t stride, const char* name) {
    for (size_t j = 0; j < size_t(c.filled); ++j)
      for (size_t i = 0; i < stride; ++i) {
        const float x = ring[j * stride + i];
        if (!finite(x) || x < 0)
          fail("{}: {} ring slot {} cell {} = {} is not a finite number >= 0", what, name, j, i, x);
      }
  };
  live(h.q_ring, size_t(heads), "Q's"), live(h.k_ring, size_t(heads), "K's"), live(h.v_ring, l.cells, "V's");
  for (size_t i = 0; i < l.cells; ++i) {
    const bool empty = h.k_hi[i] == -INFINITY && h.k_lo[i] == INFINITY;
    if (!finite(h.k_sum[i]) || !(empty || (finite(h.k_hi[i]) && finite(h.k_lo[i]) && h.k_lo[i] <= h.k_hi[i])))
      fail("{}: K's statistics of cell {} (sum {}, range [{}, {}]) are not finite and ordered", what, i, h.k_sum[i],
           h.k_lo[i], h.k_hi[i]);
    if (!finite(h.q_hi[i]) || h.q_hi[i] < 0)
      fail("{}: Q's amax of cell {} = {} is not finite and >= 0", what, i, h.q_hi[i]);
  }
  return h;
}

}  // namespace fovea
