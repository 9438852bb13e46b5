// EncoderRunner (fovea/pipeline.h): the CPU or GPU encoder forward the engine configuration selects,
// pipelined on the GPU (start() enqueues, finish() waits for the oldest batch).
#include <cstring>

#include "fovea/bf16.h"
#include "fovea/clock.h"
#include "fovea/encoder.h"
#include "fovea/error.h"
#include "fovea/pipeline.h"
#include "fovea/threads.h"
#if FOVEA_HAVE_CUDA
#include "fovea/cuda-support.h"
#endif

namespace fovea {

namespace {
// Milliseconds since t; t moves to now.
double lap(Clock::time_point& t) { return ms_since(std::exchange(t, Clock::now())); }

std::vector<uint16_t> narrow(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  to_bf16(v.data(), v.size(), b.data());
  return b;
}
}  // namespace

struct EncoderRunner::Gpu {
#if FOVEA_HAVE_CUDA
  qwen3vl::cuda::Encoder enc;
  Gpu(const qwen3vl::Model& m, const qwen3vl::cuda::EncoderOptions& o) : enc(m, o) {}
#endif
};

// One started batch: the CPU's outputs, or the GPU download's ticket and the events that time it.
struct EncoderRunner::Flight {
  bool with_deepstack = false;
  Timings host;  // plan and upload: host time of start()
  std::optional<qwen3vl::ForwardResult> cpu;
#if FOVEA_HAVE_CUDA
  int64_t ticket = -1;
  std::vector<cuda::Event> ev;  // GPU only: before the upload, after it, after the forward, after the copy back
  void make_events() {
    for (int i = 0; i < 4; ++i) ev.emplace_back();
  }
  double between(int a, int b) const { return ev[size_t(b)].ms_since(ev[size_t(a)]); }
#endif
};

EncoderRunner::EncoderRunner(const qwen3vl::Model& m, const EngineConfig& cfg) : model_(m), cfg_(cfg) {
  if (cfg.dtype == AttnDtype::FP8) {
    book_ = make_scale_book(cfg, m.config.depth);
    plan_ = cfg.fp8_plan(m.config.depth, m.config.heads, m.config.head_dim());
  }
  if (cfg.device == Device::CUDA) {
#if FOVEA_HAVE_CUDA
    gpu_ = std::make_unique<Gpu>(m, qwen3vl::cuda::EncoderOptions{cfg.dtype, book(), cfg.fp8_linears,
                                                                  book_ ? &plan_ : nullptr, cfg.backend, cfg.graphs});
#else
    fail("--device cuda: this fovea was built without CUDA");
#endif
  }
}

EncoderRunner::~EncoderRunner() = default;

void EncoderRunner::reserve(int64_t visual_tokens, bool with_deepstack, int batches) {
#if FOVEA_HAVE_CUDA
  if (!gpu_) return;
  gpu_->enc.reserve(visual_tokens * model_.config.merge * model_.config.merge, with_deepstack, batches);
  capture_graphs();  // after the arena is sized: the graphs share it
#else
  (void)visual_tokens, (void)with_deepstack, (void)batches;
#endif
}

void EncoderRunner::capture_graphs() {
#if FOVEA_HAVE_CUDA
  if (gpu_ && !graphs_captured_) gpu_->enc.capture_graphs(nullptr);  // a throw leaves it to try again
#endif
  graphs_captured_ = true;
}

qwen3vl::GraphCounts EncoderRunner::graph_counts() const {
#if FOVEA_HAVE_CUDA
  if (gpu_) return gpu_->enc.graph_counts();
#endif
  return {};
}

size_t EncoderRunner::in_flight() const { return flights_.size(); }

void EncoderRunner::start_cpu(const Batch& batch, bool with_deepstack) {
  if (flights_.size() >= kInFlight) fail("encoder: {} batches started and not finished", flights_.size());
  auto f = std::make_unique<Flight>();
  f->with_deepstack = with_deepstack;
  auto t = Clock::now();
  qwen3vl::ForwardOptions o;
  o.attention = cfg_.dtype == AttnDtype::FP8 ? cpu::RefMode::FP8 : cpu::RefMode::BF16;
  o.scales = book();
  o.fp8_linears = cfg_.fp8_linears;
  o.fp8_plan = book_ ? &plan_ : nullptr;
  o.keep_intermediates = intermediates_ != nullptr;
  f->cpu = qwen3vl::forward_cpu(model_, batch.pixels, batch.grids, o);
  f->host.forward = f->host.gpu = lap(t);
  flights_.push_back(std::move(f));
}

void EncoderRunner::start_gpu(const std::vector<qwen3vl::GridThw>& grids, bool with_deepstack, bool raw,
                              const std::function<void(void*)>& pack, const image::Patches::Normalization* norm) {
#if FOVEA_HAVE_CUDA
  if (flights_.size() >= kInFlight) fail("encoder: {} batches started and not finished", flights_.size());
  auto f = std::make_unique<Flight>();
  f->with_deepstack = with_deepstack;
  f->make_events();
  auto& enc = gpu_->enc;
  cudaStream_t s = nullptr;
  capture_graphs();
  auto t = Clock::now();
  enc.plan(grids, s);
  f->host.plan = lap(t);
  pack(raw ? static_cast<void*>(enc.raw_staging()) : enc.pixel_staging());
  f->host.upload = lap(t);
  FOVEA_CUDA_CHECK(cudaEventRecord(f->ev[0], s));
  if (raw)
    enc.upload_raw(norm->mean, norm->std, s);
  else
    enc.upload_staged(s);
  FOVEA_CUDA_CHECK(cudaEventRecord(f->ev[1], s));
  enc.forward(s);
  FOVEA_CUDA_CHECK(cudaEventRecord(f->ev[2], s));
  f->ticket = enc.download(with_deepstack, s);
  FOVEA_CUDA_CHECK(cudaEventRecord(f->ev[3], s));
  flights_.push_back(std::move(f));
#else
  (void)grids, (void)with_deepstack, (void)raw, (void)pack, (void)norm;
#endif
}

void EncoderRunner::start(const Batch& batch, bool with_deepstack) {
  if (!gpu_) return start_cpu(batch, with_deepstack);
  start_gpu(
      batch.grids, with_deepstack, false,
      [&](void* dst) { to_bf16(batch.pixels.data(), batch.pixels.size(), static_cast<uint16_t*>(dst)); }, nullptr);
}

void EncoderRunner::start(const std::vector<const image::Patches*>& images, bool with_deepstack) {
  if (images.empty()) fail("encoder: a batch of no inputs");
  // Raw uint8 patches are uploaded as they are only when the whole batch is raw and normalized
  // alike; a batch that also holds fp32 patches (a video clip's: its frames differ within each
  // temporal patch, which the raw form cannot hold) takes its raw images normalized on the host,
  // bit for bit what the device would compute (image::normalize_raw).
  bool raw = true;
  std::vector<qwen3vl::GridThw> grids;
  for (const image::Patches* p : images) {
    if (p->raw.empty() && p->pixels.empty())
      fail("encoder: an input of grid ({}, {}, {}) without pixels", p->grid[0], p->grid[1], p->grid[2]);
    raw = raw && !p->raw.empty() && std::memcmp(&p->norm, &images[0]->norm, sizeof p->norm) == 0;
    grids.push_back(p->grid);
  }
  // One image's fp32 rows: its own, or its raw samples normalized into `scratch`.
  const auto fp32_rows = [](const image::Patches& p, image::Patches& scratch) -> const std::vector<float>& {
    if (p.raw.empty()) return p.pixels;
    scratch.raw = p.raw;
    scratch.norm = p.norm;
    scratch.grid = p.grid;
    image::normalize_raw(scratch);
    return scratch.pixels;
  };
  if (!gpu_) {
    Batch b;
    for (const image::Patches* p : images) {
      image::Patches scratch;
      const std::vector<float>& px = fp32_rows(*p, scratch);
      b.pixels.insert(b.pixels.end(), px.begin(), px.end());
      b.grids.push_back(p->grid);
    }
    return start_cpu(b, with_deepstack);
  }
  start_gpu(
      grids, with_deepstack, raw,
      [&](void* dst) {
        auto* at = static_cast<uint8_t*>(dst);
        for (const image::Patches* p : images) {  // straight into place: raw bytes copied, fp32 rounded on every core
          if (raw) {
            std::memcpy(at, p->raw.data(), p->raw.size());
            at += p->raw.size();
          } else {
            image::Patches scratch;
            const std::vector<float>& px = fp32_rows(*p, scratch);
            to_bf16(px.data(), px.size(), reinterpret_cast<uint16_t*>(at));
            at += px.size() * 2;
          }
        }
      },
      raw ? &images[0]->norm : nullptr);
}

void EncoderRunner::finish_oldest(const std::function<void(qwen3vl::ForwardResult&, bool)>& cpu,
                                  const std::function<void(int64_t)>& gpu) {
  if (flights_.empty()) fail("encoder: finish() with no batch started");
  std::unique_ptr<Flight> f = std::move(flights_.front());
  flights_.pop_front();
  timings_ = f->host;
  if (f->cpu) {
    if (intermediates_) *intermediates_ = std::move(f->cpu->intermediates);
    cpu(*f->cpu, f->with_deepstack);
    return calibrate();
  }
#if FOVEA_HAVE_CUDA
  FOVEA_CUDA_CHECK(cudaEventSynchronize(f->ev[3]));  // the batch is done on the GPU
  auto t = Clock::now();
  gpu(f->ticket);
  const double unpack = lap(t);
  calibrate();  // the GPU's amax rings came back with the outputs
  timings_.upload += f->between(0, 1);
  timings_.forward = f->between(1, 2);
  timings_.download = f->between(2, 3) + unpack;
  timings_.gpu = f->between(0, 3);
#else
  (void)gpu;
#endif
}

namespace {
void narrow_into(EncoderOutputsBf16& out, const qwen3vl::ForwardResult& r, bool with_deepstack) {
  out.merged = narrow(r.merged);
  out.deepstack.clear();
  if (with_deepstack)
    for (const auto& d : r.deepstack) out.deepstack.push_back(narrow(d));
}
}  // namespace

void EncoderRunner::finish(EncoderOutputsBf16& out) {
  finish_oldest([&](qwen3vl::ForwardResult& r, bool ds) { narrow_into(out, r, ds); },
                [&](int64_t ticket) {
#if FOVEA_HAVE_CUDA
                  std::vector<std::vector<uint16_t>> v;  // out's vectors, reused
                  v.push_back(std::move(out.merged));
                  for (auto& d : out.deepstack) v.push_back(std::move(d));
                  gpu_->enc.collect(ticket, v);
                  out.merged = std::move(v[0]);
                  out.deepstack.clear();
                  for (size_t k = 1; k < v.size(); ++k) out.deepstack.push_back(std::move(v[k]));
#else
                  (void)ticket;
#endif
                });
}

void EncoderRunner::calibrate() {
  if (book_ && book_->mode() == ScaleMode::CALIBRATE) book_->after_forward();
}

Bf16Rows EncoderRunner::finish_views() {
  Bf16Rows view;
  finish_oldest(
      [&](qwen3vl::ForwardResult& r, bool ds) {
        narrow_into(cpu_views_, r, ds);
        view.merged = cpu_views_.merged;
        for (const auto& d : cpu_views_.deepstack) view.deepstack.emplace_back(d);
      },
      [&](int64_t ticket) {
#if FOVEA_HAVE_CUDA
        const std::vector<std::span<const uint16_t>> v = gpu_->enc.collect_views(ticket);
        view.merged = v[0];
        view.deepstack.assign(v.begin() + 1, v.end());
#else
        (void)ticket;
#endif
      });
  return view;
}

EncoderOutputs EncoderRunner::run(const Batch& batch, bool with_deepstack) {
  if (!flights_.empty()) fail("encoder: run() with {} batches started and not finished", flights_.size());
  EncoderOutputs out;
  if (!gpu_) {  // the CPU's fp32 as computed
    start_cpu(batch, with_deepstack);
    finish_oldest(
        [&](qwen3vl::ForwardResult& r, bool ds) {
          out.merged = std::move(r.merged);
          if (ds) out.deepstack = std::move(r.deepstack);
        },
        {});
    return out;
  }
  EncoderOutputsBf16 b = run_bf16(batch, with_deepstack);
  out.merged = widen_bf16(b.merged);
  for (const auto& d : b.deepstack) out.deepstack.push_back(widen_bf16(d));
  return out;
}

namespace {
// The CPU forward's batch: fp32 patches, raw ones normalized exactly.
Batch fp32_batch(const std::vector<const image::Patches*>& inputs) {
  Batch b;
  for (const image::Patches* p : inputs) {
    image::Patches fp32 = *p;
    if (fp32.pixels.empty()) image::normalize_raw(fp32);
    b.add(std::move(fp32));
  }
  return b;
}
}  // namespace

void EncoderRunner::keep_intermediates(std::map<std::string, std::vector<float>>* into) {
  if (gpu_ && into) fail("encoder: the intermediates come from the CPU forward: run it with --device cpu");
  intermediates_ = into;
}

EncoderOutputs EncoderRunner::run(const std::vector<const image::Patches*>& inputs, bool with_deepstack) {
  if (!gpu_) return run(fp32_batch(inputs), with_deepstack);  // the CPU's fp32 as computed
  if (!flights_.empty()) fail("encoder: run() with {} batches started and not finished", flights_.size());
  start(inputs, with_deepstack);
  const Bf16Rows v = finish_views();
  EncoderOutputs out{widen_bf16(v.merged), {}};
  for (const auto& d : v.deepstack) out.deepstack.push_back(widen_bf16(d));
  return out;
}

void EncoderRunner::run_bf16(const Batch& batch, bool with_deepstack, EncoderOutputsBf16& out) {
  if (!flights_.empty()) fail("encoder: run() with {} batches started and not finished", flights_.size());
  start(batch, with_deepstack);
  finish(out);
}

EncoderOutputsBf16 EncoderRunner::run_bf16(const Batch& batch, bool with_deepstack) {
  EncoderOutputsBf16 out;
  run_bf16(batch, with_deepstack, out);
  return out;
}

GuardCounts EncoderRunner::static_guarded() const {
  return book_ && book_->mode() == ScaleMode::STATIC ? book_->guarded() : GuardCounts{};
}

uint64_t EncoderRunner::nonfinite_amax() const {
  if (!book_ || book_->mode() == ScaleMode::STATIC) return 0;
  uint64_t n = 0;
  for (int l = 0; l < book_->num_layers(); ++l) n += book_->nonfinite_count(l);
  return n;
}

}  // namespace fovea
