// The GPU encoder's batch plumbing (fovea/encoder.h): plan() lays the batch's buffers out in one
// arena and computes its grid tables, the pixel uploads go through double-buffered pinned staging,
// and download() / collect() bring the outputs (and the FP8 rings) back through pinned slots.
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "fovea/bf16.h"
#include "fovea/error.h"
#include "fovea/threads.h"
#include "model/qwen3vl/encoder-impl.cuh"

namespace fovea::qwen3vl::cuda {

void Encoder::Impl::layout_arena(int64_t n) {
  const int64_t D = cfg.hidden, I = cfg.intermediate, M4 = cfg.merged_dim(), O = cfg.out_hidden;
  // FP8 linears: fc2's K is I, rounded up to 128 with block-scaled weights, whose activation scales
  // are repeated per 128 of K (the widest: fc2's).
  const bool blocked = opt.fp8_linears && !blocks.empty() && blocks.front().fc2.blocks;
  const int64_t K2 = blocked ? blocks.front().fc2.k : I;
  const int64_t scale_copies = blocked ? std::max<int64_t>(D, K2) / kFp8Block : 1;
  struct Slice {
    void** ptr;
    size_t bytes;
  };
  ds.assign(deepstack.size(), nullptr);
  std::vector<Slice> slices = {{(void**)&raw, size_t(n) * cfg.patch_dim() / cfg.temporal_patch},
                               {(void**)&pixels, size_t(n) * cfg.patch_dim() * 2},
                               {(void**)&x, size_t(n * D) * 2},
                               {(void**)&ln, size_t(n * D) * 2},
                               {(void**)&qkv, size_t(n * 3 * D) * 2},
                               {(void**)&att, size_t(n * D) * 2},
                               {(void**)&h, size_t(n * I) * 2},
                               {(void**)&m1, size_t(n / 4 * M4) * 2},
                               {(void**)&m2, size_t(n / 4 * M4) * 2},
                               {(void**)&merged, size_t(n / 4 * O) * 2},
                               {(void**)&pe, size_t(n * D) * 2},
                               {(void**)&cos, size_t(n) * cfg.head_dim() / 2 * 4},
                               {(void**)&sin, size_t(n) * cfg.head_dim() / 2 * 4},
                               {(void**)&act8, opt.fp8_linears ? size_t(n) * size_t(std::max(D, K2)) : 0},
                               {(void**)&act_scale, opt.fp8_linears ? size_t(n) * 4 * size_t(scale_copies) : 0}};
  for (auto& d : ds) slices.push_back({(void**)&d, size_t(n / 4 * O) * 2});
  constexpr size_t kAlign = 256;  // cuBLASLt and TMA want 16-byte aligned rows; 256 keeps every slice apart
  size_t total = 0;
  for (const Slice& sl : slices) total += (sl.bytes + kAlign - 1) / kAlign * kAlign;
  // The graphs' buffers live in `arena`, which then never moves: a larger batch takes `spill`.
  fovea::cuda::DeviceBuffer<uint8_t>& mem = !graphs.empty() && total > arena.count() ? spill : arena;
  if (mem.count() < total) mem.reset(total);
  size_t at = 0;
  for (const Slice& sl : slices) {
    *sl.ptr = mem.data() + at;
    at += (sl.bytes + kAlign - 1) / kAlign * kAlign;
  }
}

void Encoder::reserve(int64_t patches, bool with_deepstack, int batches) {
  if (patches <= 0) return;
  Impl& m = *impl_;
  m.layout_arena(patches);
  const size_t raw = size_t(patches) * m.cfg.patch_dim() / m.cfg.temporal_patch;
  const size_t outputs = 1 + (with_deepstack ? m.cfg.deepstack.size() : 0);
  const size_t rings = m.amax ? sizeof(LayerAmax) * size_t(m.cfg.depth) : 0;
  const size_t out_bytes =
      m.fine_history_bytes() + m.guard_bytes() + size_t(patches / 4) * m.cfg.out_hidden * 2 * outputs + rings;
  for (int k = 0; k < std::clamp(batches, 0, 2); ++k) {  // the slots the next batches take, in order
    const int px = (m.next_pixels + k) % 2;
    if (!(m.staged && m.staged_slot == px)) m.pixels_in[px].reserve(raw);
    Impl::OutSlot& o = m.out[(m.next_ticket + k) % 2];
    if (o.ticket < 0) o.mem.reserve(out_bytes);  // never under a download waiting to be collected
  }
}

void Encoder::Impl::grid_tables(const std::vector<GridThw>& grids, cudaStream_t stream) {
  const int quarter = cfg.head_dim() / 4;
  int side = 0;
  for (const auto& g : grids) side = std::max({side, g[1], g[2]});
  if (side > rope_side) {  // grown rarely (a larger image side than any yet): a synchronous upload
    std::vector<float> c, s;
    rope_side = std::max(side, 2 * rope_side);
    rope_frequency_table(rope_side, cfg.head_dim(), c, s);
    c.insert(c.end(), s.begin(), s.end());
    rope_freq.reset(c.size());
    FOVEA_CUDA_CHECK(cudaMemcpy(rope_freq.data(), c.data(), c.size() * 4, cudaMemcpyHostToDevice));
  }
  if (images.count() < grids.size()) images.reset(std::max(grids.size(), size_t(64)));
  fovea::cuda::StagingSlot& st = plan_in[next_plan];
  next_plan ^= 1;
  auto* desc = reinterpret_cast<ImageDesc*>(st.take(grids.size() * sizeof(ImageDesc)));
  int64_t base = 0;
  for (size_t k = 0; k < grids.size(); ++k) {
    desc[k] = {base, grids[k][0], grids[k][1], grids[k][2], 0};
    base += int64_t(grids[k][0]) * grids[k][1] * grids[k][2];
  }
  FOVEA_CUDA_CHECK(
      cudaMemcpyAsync(images.data(), desc, grids.size() * sizeof(ImageDesc), cudaMemcpyHostToDevice, stream));
  st.release(stream);
  compute_grid_tables(images.data(), int(grids.size()), base, pos_table, cfg.pos_side(), cfg.hidden, rope_freq.data(),
                      rope_freq.data() + size_t(rope_side) * quarter, quarter, pe, cos, sin, stream);
}

void Encoder::plan(const std::vector<GridThw>& grids, cudaStream_t stream) {
  Impl& m = *impl_;
  const GridShape shape = check_grids(grids, "encoder");
  if (shape.patches > std::numeric_limits<int32_t>::max())
    fail_cat("encoder: ", shape.patches, " patches in one batch; cu_seqlens are int32");
  if (m.n > 0 && m.grids == grids) return;  // the same batch shape: buffers and tables stand
  m.n = 0;  // forward() refuses to run until this plan is complete (a throw below leaves no dangling plan)
  m.grids = grids;
  const int64_t merged = shape.patches / (int64_t(m.cfg.merge) * m.cfg.merge);
  m.budget = m.graphs.empty() ? -1 : m.opt.graphs.pick(merged, int64_t(shape.seqlens.size()));
  m.rows = m.budget >= 0 ? m.graphs[size_t(m.budget)].patches : shape.patches;
  m.layout_arena(m.rows);
  m.grid_tables(grids, stream);
  if (m.budget >= 0) {
    m.plan_budget(m.budget, shape.seqlens, shape.patches, stream);
  } else {
    std::vector<int32_t> cu = {0};
    for (const int len : shape.seqlens) cu.push_back(cu.back() + len);
    m.attn->plan(cu, stream);
  }
  m.n = shape.patches;
}

void Encoder::Impl::plan_budget(int k, const std::vector<int>& seqlens, int64_t patches, cudaStream_t stream) {
  BudgetGraph& g = graphs[size_t(k)];
  const int items = opt.graphs.max_items;
  fovea::cuda::StagingSlot& st = cu_in[next_cu];
  next_cu ^= 1;
  auto* cu = reinterpret_cast<int32_t*>(st.take(sizeof(int32_t) * size_t(items + 1)));
  cu[0] = 0;  // the segments, then empty ones up to max_items (the last offset repeated)
  for (int i = 0; i < items; ++i) cu[i + 1] = cu[i] + (size_t(i) < seqlens.size() ? seqlens[size_t(i)] : 0);
  FOVEA_CUDA_CHECK(
      cudaMemcpyAsync(g.cu.data(), cu, sizeof(int32_t) * size_t(items + 1), cudaMemcpyHostToDevice, stream));
  st.release(stream);
  // The rows past the batch: zero pixels, position embedding and attention output, so the GEMMs
  // and norms over the budget's rows see finite values (the attention itself reads none of them).
  const int64_t tail = g.patches - patches, D = cfg.hidden;
  if (tail <= 0) return;
  FOVEA_CUDA_CHECK(cudaMemsetAsync(pixels + patches * cfg.patch_dim(), 0, size_t(tail * cfg.patch_dim()) * 2, stream));
  FOVEA_CUDA_CHECK(cudaMemsetAsync(pe + patches * D, 0, size_t(tail * D) * 2, stream));
  FOVEA_CUDA_CHECK(cudaMemsetAsync(att + patches * D, 0, size_t(tail * D) * 2, stream));
}

void Encoder::grid_tables(std::vector<uint16_t>& pe, std::vector<float>& cos, std::vector<float>& sin) const {
  const Impl& m = *impl_;
  if (m.n == 0) fail_cat("encoder: grid_tables() before plan()");
  pe.resize(size_t(m.n) * m.cfg.hidden);
  cos.resize(size_t(m.n) * (m.cfg.head_dim() / 2));
  sin.resize(cos.size());
  FOVEA_CUDA_CHECK(cudaMemcpy(pe.data(), m.pe, pe.size() * 2, cudaMemcpyDeviceToHost));
  FOVEA_CUDA_CHECK(cudaMemcpy(cos.data(), m.cos, cos.size() * 4, cudaMemcpyDeviceToHost));
  FOVEA_CUDA_CHECK(cudaMemcpy(sin.data(), m.sin, sin.size() * 4, cudaMemcpyDeviceToHost));
}

void* Encoder::Impl::take_staging(size_t bytes) {
  if (n == 0) fail_cat("encoder: pixel staging before plan()");
  staged_slot = next_pixels;
  next_pixels ^= 1;
  staged = pixels_in[staged_slot].take(bytes);
  return staged;
}

void Encoder::Impl::upload_from_staging(void* to, size_t bytes, cudaStream_t stream) {
  if (!staged) fail_cat("encoder: upload without pixel staging");
  FOVEA_CUDA_CHECK(cudaMemcpyAsync(to, staged, bytes, cudaMemcpyHostToDevice, stream));
  pixels_in[staged_slot].release(stream);
  staged = nullptr;
}

uint16_t* Encoder::pixel_staging() {
  return static_cast<uint16_t*>(impl_->take_staging(size_t(impl_->n) * impl_->cfg.patch_dim() * 2));
}

void Encoder::upload_staged(cudaStream_t stream) {
  Impl& m = *impl_;
  m.upload_from_staging(m.pixels, size_t(m.n) * m.cfg.patch_dim() * 2, stream);
}

uint8_t* Encoder::raw_staging() {
  return static_cast<uint8_t*>(
      impl_->take_staging(size_t(impl_->n) * impl_->cfg.patch_dim() / impl_->cfg.temporal_patch));
}

void Encoder::upload_raw(const float mean[3], const float std[3], cudaStream_t stream) {
  Impl& m = *impl_;
  const int T = m.cfg.temporal_patch, plane = m.cfg.patch * m.cfg.patch;
  m.upload_from_staging(m.raw, size_t(m.n) * m.cfg.patch_dim() / T, stream);
  normalize_pixels(m.raw, m.pixels, m.n, plane, T, mean, std, stream);
}

void Encoder::upload_pixels(const std::vector<float>& pixels, cudaStream_t stream) {
  Impl& m = *impl_;
  if (int64_t(pixels.size()) != m.n * m.cfg.patch_dim())
    fail_cat("encoder: pixel_values has ", pixels.size(), " values, the plan expects ", m.n * m.cfg.patch_dim());
  to_bf16(pixels.data(), pixels.size(), pixel_staging());
  upload_staged(stream);
}

int64_t Encoder::download(bool with_deepstack, cudaStream_t stream) {
  Impl& m = *impl_;
  if (m.n == 0) fail_cat("encoder: download() before plan()");
  const int64_t ticket = m.next_ticket;
  Impl::OutSlot& o = m.out[ticket % 2];
  if (o.ticket >= 0) fail_cat("encoder: the outputs of download ", o.ticket, " were never collected");
  std::vector<const bf16*> from = {m.merged};
  if (with_deepstack) from.insert(from.end(), m.ds.begin(), m.ds.end());
  o.count = size_t(m.n / 4 * m.cfg.out_hidden);
  o.outputs = from.size();
  o.amax = m.amax != nullptr;
  const size_t rings = o.amax ? sizeof(LayerAmax) * size_t(m.cfg.depth) : 0, hist = m.fine_history_bytes();
  o.fine = hist > 0;
  o.guard = m.guard != nullptr;
  uint8_t* h = o.mem.take(o.count * 2 * o.outputs + rings + hist + m.guard_bytes());
  for (size_t k = 0; k < from.size(); ++k)
    FOVEA_CUDA_CHECK(cudaMemcpyAsync(h + k * o.count * 2, from[k], o.count * 2, cudaMemcpyDeviceToHost, stream));
  if (rings)
    FOVEA_CUDA_CHECK(cudaMemcpyAsync(h + o.count * 2 * o.outputs, m.amax, rings, cudaMemcpyDeviceToHost, stream));
  if (o.fine) {
    uint8_t* at = h + o.count * 2 * o.outputs + rings;
    for (const auto& fh : m.fine_hist) {
      FOVEA_CUDA_CHECK(cudaMemcpyAsync(at, fh.data(), fh.bytes(), cudaMemcpyDeviceToHost, stream));
      at += fh.bytes();
    }
  }
  if (o.guard)
    FOVEA_CUDA_CHECK(cudaMemcpyAsync(h + o.count * 2 * o.outputs + rings + hist, m.guard, m.guard_bytes(),
                                     cudaMemcpyDeviceToHost, stream));
  o.mem.release(stream);
  o.ticket = ticket;
  m.next_ticket += 1;
  return ticket;
}

// Waits for download `ticket`; its outputs' views in the pinned slot. The FP8 rings (and the static
// guard's counts) copied with the outputs go to the scale book.
std::vector<std::span<const uint16_t>> Encoder::Impl::collect_views(int64_t ticket) {
  OutSlot& o = out[ticket % 2];
  if (ticket < 0 || o.ticket != ticket) fail_cat("encoder: download ", ticket, " is not waiting to be collected");
  o.mem.wait();
  o.ticket = -1;
  const auto* h = reinterpret_cast<const uint16_t*>(o.mem.data());
  std::vector<std::span<const uint16_t>> views;
  for (size_t k = 0; k < o.outputs; ++k) views.emplace_back(h + k * o.count, o.count);
  const auto* bytes = reinterpret_cast<const uint8_t*>(h + o.count * o.outputs);
  if (o.amax) {
    auto& state = opt.scales->amax_state();
    std::memcpy(state.data(), bytes, sizeof(LayerAmax) * state.size());
    bytes += sizeof(LayerAmax) * state.size();
  }
  if (o.fine) {
    auto& state = opt.scales->fine_state();
    for (size_t l = 0; l < fine_hist.size(); bytes += fine_hist[l].bytes(), ++l) fine_hist[l].unpack(bytes, state[l]);
  }
  if (o.guard) take_guard_counts(bytes);
  return views;
}

// The device's counts are running totals from the book's: the book takes each layer's larger, so a
// download collected after a later one (or sync_scales) never moves a count back.
void Encoder::Impl::take_guard_counts(const void* host) {
  std::vector<GuardCounts> counts(size_t(cfg.depth));
  std::memcpy(counts.data(), host, guard_bytes());
  for (int l = 0; l < cfg.depth; ++l) {
    const GuardCounts had = opt.scales->guarded(l), now = counts[size_t(l)];
    opt.scales->set_guarded(l, {std::max(had.q, now.q), std::max(had.k, now.k), std::max(had.v, now.v)});
  }
}

// collect_views(), then one vector per output filled on every core: bf16 bits as they are, or
// widened to fp32. Vectors that already hold enough keep their (warm) memory: no page faults on reuse.
template <class T>
void Encoder::Impl::collect(int64_t ticket, std::vector<std::vector<T>>& dst) {
  const std::vector<std::span<const uint16_t>> views = collect_views(ticket);
  dst.resize(views.size());
  for (size_t k = 0; k < views.size(); ++k) {
    dst[k].resize(views[k].size());
    const uint16_t* src = views[k].data();
    T* to = dst[k].data();
    parallel_ranges(int64_t(views[k].size()), kBf16ConvertGrain, [&](int64_t b, int64_t e) {
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t i = b; i < e; ++i) to[i] = bf16_to_float(src[i]);
      } else {
        std::memcpy(to + b, src + b, size_t(e - b) * 2);
      }
    });
  }
}

void Encoder::collect(int64_t ticket, std::vector<std::vector<uint16_t>>& out) { impl_->collect(ticket, out); }
std::vector<std::span<const uint16_t>> Encoder::collect_views(int64_t ticket) { return impl_->collect_views(ticket); }

void Encoder::outputs_bf16(bool with_deepstack, std::vector<std::vector<uint16_t>>& out, cudaStream_t stream) {
  collect(download(with_deepstack, stream), out);
}

std::vector<float> Encoder::merged(cudaStream_t stream) {
  std::vector<std::vector<float>> out;
  impl_->collect(download(false, stream), out);
  return std::move(out[0]);
}

std::vector<std::vector<float>> Encoder::deepstack(cudaStream_t stream) {
  std::vector<std::vector<float>> out;
  impl_->collect(download(true, stream), out);
  out.erase(out.begin());  // the merged output comes first
  return out;
}
}  // namespace fovea::qwen3vl::cuda
