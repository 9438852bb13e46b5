// The batching worker of `fovea serve`: a bounded queue of requests and one thread that owns the
// encoder (fovea/pipeline.h's EncoderRunner: created on that thread, used by it alone) and packs the images of queued
// requests, first come first served, into one varlen forward of at most max_batch_tokens visual
// tokens. An image is never split; one larger than the limit runs alone. A request's images may
// spread over several forwards. A forward that throws fails only the requests in it.
// The worker is a two-deep pipeline (EncoderRunner::start / finish): it starts forward n+1 (packing
// its pixels into pinned memory, enqueueing it behind forward n) before it waits for forward n and
// hands out its outputs, so the GPU runs back to back while requests keep coming.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "fovea/engine.h"
#include "fovea/image.h"
#include "fovea/model.h"
#include "fovea/pipeline.h"

namespace fovea::server {

using Clock = std::chrono::steady_clock;

// One image's outputs: its rows of the forward it was in. The forward's bf16 outputs are shared by
// the images in it (no copy per image); deepstack is there if any job in that forward asked for it.
struct ImageOutput {
  std::shared_ptr<const EncoderOutputsBf16> forward;
  size_t first_row = 0;                       // this image's first row in them
  int64_t tokens = 0;                         // its rows
  std::span<const uint16_t> merged(int out_hidden) const { return rows(forward->merged, out_hidden); }
  std::span<const uint16_t> deepstack(size_t k, int out_hidden) const { return rows(forward->deepstack[k], out_hidden); }
  std::span<const uint16_t> rows(const std::vector<uint16_t>& v, int out_hidden) const {
    return {v.data() + first_row * size_t(out_hidden), size_t(tokens) * size_t(out_hidden)};
  }
  double queue_ms = 0;                        // submit -> start of its forward
  double forward_ms = 0;                      // the GPU time of the forward it was part of
  int batch_images = 0;                       // images in that forward
  int64_t batch_tokens = 0;                   // visual tokens in that forward
};

// One request in the queue. The worker writes outputs; the waiting thread reads them once done.
struct Job {
  std::vector<image::Patches> images;  // as image::preprocess gives them; emptied into the forward
  std::vector<ImageOutput> outputs;
  Clock::time_point submitted;
  bool deepstack = false;  // the client asked for the deepstack features
  // Guarded by the Batcher's mutex:
  size_t next = 0;         // first image not yet taken into a forward
  size_t done = 0;         // images finished
  std::string error;       // set if a forward it was in failed: its other images are dropped
  bool abandoned = false;  // its client gave up (timeout): images not yet run are dropped
};

class Batcher {
 public:
  // Starts the worker, which creates the encoder; throws (the encoder's error) if that fails.
  Batcher(const qwen3vl::Model& model, const EngineConfig& cfg, size_t max_queue, int64_t max_queue_tokens,
          int64_t max_batch_tokens);
  ~Batcher();  // stop()

  // Queues a request; nullptr, with the reason in `refused`, if max_queue requests are already
  // waiting, if its visual tokens would take the queue past max_queue_tokens (an empty queue takes
  // any request), or if the worker stopped. The deepstack features are copied back from the device
  // only for forwards with a job that asked for them (each is as large as the visual tokens).
  std::shared_ptr<Job> submit(std::vector<image::Patches> images, bool deepstack, std::string& refused);

  enum class Wait { DONE, FAILED, TIMED_OUT };
  // Blocks until the job is done, failed (`error` says why), or the deadline passed (the job is
  // then abandoned: its images not yet started are dropped).
  Wait wait(Job& job, Clock::time_point deadline, std::string& error);

  // Finishes every queued request, then joins the worker. Idempotent.
  void stop();

  // For /metrics.
  size_t queue_depth() const;  // requests waiting, partly started ones included
  uint64_t forwards() const { return forwards_; }
  uint64_t images_encoded() const { return images_; }
  uint64_t tokens_encoded() const { return tokens_; }
  double forward_seconds() const { return forward_us_ / 1e6; }  // GPU time of the forwards (upload to copy back)
  uint64_t failed_forwards() const { return failed_forwards_; }
  uint64_t nonfinite_amax() const { return nonfinite_; }

 private:
  struct Slot {  // one image of one job in the forward being assembled
    std::shared_ptr<Job> job;
    size_t index;
  };
  void worker(std::promise<void>& ready);
  std::vector<Slot> take_batch();  // with mu_ held
  int64_t queued_tokens() const;   // with mu_ held: visual tokens of the images not yet taken
  struct Started {  // a forward in flight
    std::vector<Slot> slots;
    std::vector<qwen3vl::GridThw> grids;
    bool deepstack = false;
    Clock::time_point start;
  };
  // Starts the forward of `slots` (their pixels are freed once packed); nullopt if that threw, the
  // slots' jobs failed.
  std::optional<Started> start_batch(EncoderRunner& runner, std::vector<Slot> slots);
  // Waits for it and hands its outputs to its jobs (or fails them).
  void finish_batch(EncoderRunner& runner, Started& b);
  void fail_slots(const std::vector<Slot>& slots, const std::string& error);
  // Output buffers reused from forward to forward (warm memory: a fresh 100 MB buffer costs tens of
  // ms of page faults); at most kPooledOutputs are kept, more forwards in flight get fresh ones.
  std::shared_ptr<EncoderOutputsBf16> recycled_outputs();
  static constexpr size_t kPooledOutputs = 4;
  std::vector<std::shared_ptr<EncoderOutputsBf16>> pool_;  // the worker's alone

  const qwen3vl::Model& model_;
  const EngineConfig cfg_;
  const size_t max_queue_;
  const int64_t max_queue_tokens_;
  const int64_t max_batch_tokens_;

  mutable std::mutex mu_;
  std::condition_variable queued_;  // worker: something to do, or stop
  std::condition_variable done_;    // waiters: some job progressed
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false;
  std::thread thread_;

  std::atomic<uint64_t> forwards_{0}, images_{0}, tokens_{0}, forward_us_{0}, failed_forwards_{0}, nonfinite_{0};
};

}  // namespace fovea::server
