// The batching workers of `fovea serve`: a bounded queue of requests and one worker thread per
// encoder replica (one per GPU of --devices, or --workers on the CPU). Each worker owns its replica's
// encoder (fovea/pipeline.h's EncoderRunner: created on that thread, on its device, used by it alone)
// and packs the inputs (images and clips) of queued requests, first come first served, into one
// varlen forward of at most max_batch_tokens visual tokens (fovea::ForwardPacker); the first idle
// worker takes the next batch. An input is never split; one larger than the limit runs alone. A
// request's inputs may spread over several forwards and replicas. Each worker is a two-deep pipeline
// (EncoderRunner::start / finish): it starts forward n+1 (packing its pixels into pinned memory, enqueueing it behind
// forward n) before it waits for forward n and hands out its outputs, so its GPU runs back to back. A forward that
// throws fails the requests in it and takes its replica out of rotation (a forward of preprocessed patches fails only
// when the device does: a CUDA error); the other replicas keep serving. With none left, queued and new requests fail at
// once.
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

#include "fovea/clock.h"
#include "fovea/engine.h"
#include "fovea/image.h"
#include "fovea/model.h"
#include "fovea/pipeline.h"

namespace fovea::server {

// One input's outputs: its rows of the forward it was in. The forward's bf16 outputs are shared by
// the inputs in it (no copy per input); deepstack is there if any job in that forward asked for it.
struct InputResult {
  std::shared_ptr<const EncoderOutputsBf16> forward;  // kept alive while `rows` are read
  Bf16Rows rows;                                      // this input's rows in it (split_inputs)
  double queue_ms = 0;                                // submit -> start of its forward
  double forward_ms = 0;                              // the GPU time of the forward it was part of
  int batch_inputs = 0;                               // inputs in that forward
  int64_t batch_tokens = 0;                           // visual tokens in that forward
};

// One request in the queue. The worker writes outputs; the waiting thread reads them once done.
struct Job {
  std::vector<image::Patches> inputs;  // as prepare_inputs gives them; emptied into the forward
  std::vector<InputResult> outputs;
  Clock::time_point submitted;
  bool deepstack = false;  // the client asked for the deepstack features
  // Guarded by the Batcher's mutex:
  size_t next = 0;         // first input not yet taken into a forward
  size_t done = 0;         // inputs finished
  std::string error;       // set if a forward it was in failed: its other inputs are dropped
  bool abandoned = false;  // its client gave up (timeout): inputs not yet run are dropped
};

// Where an encoder replica runs: a CUDA device (its index) or the CPU (gpu < 0); `name` labels its
// metrics and log lines ("cuda:0", "cpu:1").
struct ReplicaSpec {
  std::string name;
  int gpu = -1;
};

// A replica's state, for /metrics and /health.
struct ReplicaState {
  std::string name;
  bool up = false;
  std::string down_reason;  // why it was taken out of rotation
  uint64_t forwards = 0, inputs = 0, tokens = 0, failed_forwards = 0;
  double forward_seconds = 0;
};

class Batcher {
 public:
  // Starts one worker per replica (each creates its encoder on its device, all at once); throws,
  // naming the replica, if any cannot start. The environment variable FOVEA_TEST_FAIL_REPLICA=NAME:K
  // (a test hook) makes replica NAME fail its K-th forward as a device failing would.
  Batcher(const qwen3vl::Model& model, const EngineConfig& cfg, const std::vector<ReplicaSpec>& replicas,
          size_t max_queue, int64_t max_queue_tokens, int64_t max_batch_tokens);
  ~Batcher();  // stop()

  // Room in the queue held for a request whose inputs are still being decoded: admitted from their
  // headers, its tokens count against max_queue_tokens (and it against max_queue) from then on, so
  // a request the queue cannot take is refused before its decoding, not after. Released when it is
  // submitted or when the Admission goes.
  class Admission {
   public:
    explicit Admission(Batcher& b) : b_(b) {}
    ~Admission();
    Admission(const Admission&) = delete;
    Admission& operator=(const Admission&) = delete;

   private:
    friend class Batcher;
    Batcher& b_;
    bool counted_ = false;  // guarded by the Batcher's mutex
    int64_t tokens_ = 0;
  };
  // Adds `tokens` to the request's admission; false, with the reason in `refused`, if the queue
  // cannot take them (the rules of submit, counting the queue's jobs and every admission held).
  // With a deadline: also refused when the work ahead of it (the visual tokens queued and admitted,
  // this request's included, 10% over, and one forward for the one running) would take the replicas
  // up past it, at the seconds per token and per forward the recent forwards took (exponential
  // averages; no estimate before the first forward, and a request alone is always taken): a 503
  // now rather than a 504 at its deadline.
  bool admit(Admission& a, int64_t tokens, std::string& refused,
             std::optional<Clock::time_point> deadline = std::nullopt);

  // Queues a request; nullptr, with the reason in `refused`, if max_queue requests are already
  // waiting, if its visual tokens would take the queue past max_queue_tokens (an empty queue takes
  // any request), or if the worker stopped. A request admitted (`admitted`) was checked then: only a
  // stop refuses it now. The deepstack features are copied back from the device only for forwards
  // with a job that asked for them (each is as large as the visual tokens).
  std::shared_ptr<Job> submit(std::vector<image::Patches> inputs, bool deepstack, std::string& refused,
                              Admission* admitted = nullptr);

  enum class Wait { DONE, FAILED, TIMED_OUT };
  // Blocks until the job is done, failed (`error` says why), or the deadline passed (the job is
  // then abandoned: its inputs not yet started are dropped).
  Wait wait(Job& job, Clock::time_point deadline, std::string& error);

  // Finishes every queued request, then joins the worker. Idempotent.
  void stop();
  // Shutdown's grace ran out: every request waiting or queued fails now with `why` (its wait()
  // returns FAILED), nothing more is admitted, and forwards not yet started do not start.
  void abort(const std::string& why);

  // For /metrics and /health: totals over the replicas, and each one's.
  size_t queue_depth() const;  // requests waiting, partly started ones included
  uint64_t forwards() const;
  uint64_t inputs_encoded() const;  // images and clips
  uint64_t tokens_encoded() const;
  double forward_seconds() const;  // GPU time of the forwards (upload to copy back)
  uint64_t failed_forwards() const;
  uint64_t nonfinite_amax() const;
  GuardCounts static_guarded() const;  // all replicas (EncoderRunner::static_guarded)
  // Encoder CUDA graphs: forwards replayed through a budget's graph, and run eagerly beside them.
  uint64_t graph_replays() const;
  uint64_t graph_eager() const;
  std::vector<ReplicaState> replicas() const;
  size_t replicas_up() const;

 private:
  struct Slot {  // one input of one job in the forward being assembled
    std::shared_ptr<Job> job;
    size_t index;
  };
  struct Replica {
    ReplicaSpec spec;
    std::thread thread;
    std::atomic<bool> up{false};
    std::string down_reason;  // guarded by mu_
    int64_t fail_at = 0;      // the test hook's K (0: never)
    std::atomic<uint64_t> forwards{0}, inputs{0}, tokens{0}, forward_us{0}, failed_forwards{0}, nonfinite{0};
    std::atomic<uint64_t> graph_replays{0}, graph_eager{0};
    std::atomic<uint64_t> guarded[3] = {0, 0, 0};  // the static guard's q, k, v
    // Output buffers reused from forward to forward (warm memory: a fresh 100 MB buffer costs tens of
    // ms of page faults); at most kPooledOutputs are kept, more forwards in flight get fresh ones.
    std::vector<std::shared_ptr<EncoderOutputsBf16>> pool;  // its worker's alone
  };
  void worker(Replica& r, std::promise<void>& ready);
  std::vector<Slot> take_batch();  // with mu_ held
  // With mu_ held: why the queue cannot take a request of `tokens` more (or "" if it can); `own`
  // is what the request holds already (an admission), not counted against itself.
  std::string full_for(int64_t tokens, bool counted, int64_t own) const;
  // Why a request of `tokens` more would miss its deadline behind the work ahead ("" if it would not);
  // with mu_ held.
  std::string late_for(int64_t tokens, bool counted, Clock::time_point deadline) const;
  void release(Admission& a);     // with mu_ held
  int64_t queued_tokens() const;  // with mu_ held: visual tokens of the inputs not yet taken
  struct Started {                // a forward in flight
    std::vector<Slot> slots;
    std::vector<qwen3vl::GridThw> grids;
    bool deepstack = false;
    Clock::time_point start;
  };
  // Starts the forward of `slots` (their pixels are freed once packed); nullopt if that threw: the
  // slots' jobs failed and the replica is down.
  std::optional<Started> start_batch(Replica& r, EncoderRunner& runner, std::vector<Slot> slots);
  // Waits for it and hands its outputs to its jobs (or fails them and takes the replica down).
  void finish_batch(Replica& r, EncoderRunner& runner, Started& b);
  void fail_slots(Replica& r, const std::vector<Slot>& slots, const std::string& error);
  // Takes r out of rotation (once), with a log line; the last one down fails everything queued.
  void take_down(Replica& r, const std::string& why);
  std::shared_ptr<EncoderOutputsBf16> recycled_outputs(Replica& r);
  static constexpr size_t kPooledOutputs = 4;
  template <class F>
  auto total(F of) const {  // the sum of of(replica) over the replicas
    decltype(of(*replicas_.front())) sum{};
    for (const auto& r : replicas_) sum += of(*r);
    return sum;
  }

  const qwen3vl::Model& model_;
  const EngineConfig cfg_;
  const size_t max_queue_;
  const int64_t max_queue_tokens_;
  const int64_t max_batch_tokens_;

  mutable std::mutex mu_;
  std::condition_variable queued_;  // workers: something to do, or stop
  std::condition_variable done_;    // waiters: some job progressed
  std::deque<std::shared_ptr<Job>> queue_;
  int64_t admitted_tokens_ = 0;  // held by admissions not yet submitted
  size_t admitted_requests_ = 0;
  bool stopping_ = false;
  double seconds_per_token_ = 0;  // exponential averages over forwards (0: none yet); for admit's estimate
  double seconds_per_forward_ = 0;
  std::vector<std::unique_ptr<Replica>> replicas_;
};

}  // namespace fovea::server
