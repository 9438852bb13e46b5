// The batching workers of `fovea serve`, one per encoder replica (see batcher.h).
#include "server/batcher.h"

#include <cstdlib>

#include <fmt/format.h>

#include "fovea/error.h"
#include "fovea/system.h"
#include "fovea/threads.h"
#include "server/http.h"

namespace fovea::server {

Batcher::Batcher(const qwen3vl::Model& model, const EngineConfig& cfg, const std::vector<ReplicaSpec>& replicas,
                 size_t max_queue, int64_t max_queue_tokens, int64_t max_batch_tokens)
    : model_(model),
      cfg_(cfg),
      max_queue_(max_queue),
      max_queue_tokens_(max_queue_tokens),
      max_batch_tokens_(max_batch_tokens) {
  if (replicas.empty()) fail("serve: no encoder replica to start");
  std::string hook;  // FOVEA_TEST_FAIL_REPLICA=NAME:K
  if (const char* h = std::getenv("FOVEA_TEST_FAIL_REPLICA")) hook = h;
  for (const ReplicaSpec& spec : replicas) {
    auto r = std::make_unique<Replica>();
    r->spec = spec;
    if (const std::string prefix = spec.name + ":"; hook.starts_with(prefix))
      r->fail_at = std::atoll(hook.c_str() + prefix.size());
    replicas_.push_back(std::move(r));
  }
  // Every replica starts at once (loading weights onto several GPUs in parallel); the first failure,
  // in replica order, is the error.
  std::vector<std::promise<void>> ready(replicas_.size());
  std::vector<std::future<void>> started;
  for (size_t i = 0; i < replicas_.size(); ++i) {
    started.push_back(ready[i].get_future());
    replicas_[i]->thread = std::thread([this, i, &ready] { worker(*replicas_[i], ready[i]); });
  }
  std::string error;
  for (size_t i = 0; i < started.size(); ++i) {
    try {
      started[i].get();
    } catch (const std::exception& e) {
      if (error.empty()) error = fmt::format("encoder replica {}: {}", replicas_[i]->spec.name, e.what());
    }
  }
  if (!error.empty()) {
    stop();
    fail("{}", error);
  }
}

Batcher::~Batcher() { stop(); }

std::string Batcher::full_for(int64_t tokens, bool counted, int64_t own) const {
  if (stopping_) return "the server is stopping";
  if (replicas_up() == 0) return "no encoder device is up (every replica failed; see the server's log)";
  const size_t requests = queue_.size() + admitted_requests_ - (counted ? 1 : 0);  // others than this one
  if (requests >= max_queue_)
    return fmt::format("the encoder queue is full ({} requests waiting or being decoded, --max-queue)", requests);
  const int64_t others = queued_tokens() + admitted_tokens_ - own;
  if (requests > 0 && others + own + tokens > max_queue_tokens_)
    return fmt::format(
        "the encoder queue holds {} visual tokens (requests waiting or being decoded); this request's {} "
        "would pass --max-queue-tokens {}",
        others, own + tokens, max_queue_tokens_);
  return "";
}

std::string Batcher::late_for(int64_t tokens, bool counted, Clock::time_point deadline) const {
  const size_t others = queue_.size() + admitted_requests_ - (counted ? 1 : 0);
  const size_t up = replicas_up();
  if (others == 0 || seconds_per_token_ <= 0 || up == 0) return "";
  // The tokens ahead and its own at the recent rate, 10% over, plus one forward: the one running
  // now, not counted among the tokens queued (its tokens also finish only with their whole forward).
  const int64_t ahead = queued_tokens() + admitted_tokens_ + tokens;
  const double need_s = 1.1 * double(ahead) * seconds_per_token_ / double(up) + seconds_per_forward_;
  const double left_s = seconds_between(Clock::now(), deadline);
  if (need_s <= left_s) return "";
  return fmt::format(
      "the encoder would need about {:.1f} s for the {} visual tokens queued ahead and this request's, "
      "and its deadline is {:.1f} s away (--request-timeout)",
      need_s, ahead, std::max(0.0, left_s));
}

void Batcher::release(Admission& a) {
  if (!a.counted_) return;
  admitted_tokens_ -= a.tokens_;
  --admitted_requests_;
  a.counted_ = false;
  a.tokens_ = 0;
}

Batcher::Admission::~Admission() {
  std::lock_guard lk(b_.mu_);
  b_.release(*this);
}

bool Batcher::admit(Admission& a, int64_t tokens, std::string& refused, std::optional<Clock::time_point> deadline) {
  std::lock_guard lk(mu_);
  refused = full_for(tokens, a.counted_, a.tokens_);
  if (refused.empty() && deadline) refused = late_for(tokens, a.counted_, *deadline);
  if (!refused.empty()) return false;
  if (!a.counted_) ++admitted_requests_;
  a.counted_ = true;
  a.tokens_ += tokens;
  admitted_tokens_ += tokens;
  return true;
}

std::shared_ptr<Job> Batcher::submit(std::vector<image::Patches> inputs, bool deepstack, std::string& refused,
                                     Admission* admitted) {
  auto job = std::make_shared<Job>();
  job->deepstack = deepstack;
  job->outputs.resize(inputs.size());
  job->inputs = std::move(inputs);
  job->submitted = Clock::now();
  int64_t tokens = 0;
  for (const auto& p : job->inputs) tokens += visual_tokens(model_.config, p.grid);
  {
    std::lock_guard lk(mu_);
    if (admitted && admitted->counted_) {
      release(*admitted);  // its room becomes the job's
      if (stopping_ || replicas_up() == 0) refused = full_for(0, false, 0);
    } else {
      refused = full_for(tokens, false, 0);
    }
    if (!refused.empty()) return nullptr;
    queue_.push_back(job);
  }
  queued_.notify_one();
  return job;
}

Batcher::Wait Batcher::wait(Job& job, Clock::time_point deadline, std::string& error) {
  std::unique_lock lk(mu_);
  const bool finished =
      done_.wait_until(lk, deadline, [&] { return job.done == job.inputs.size() || !job.error.empty(); });
  if (!finished) {
    job.abandoned = true;  // a forward running it finishes; nothing else of it runs
    std::erase_if(queue_, [&](const std::shared_ptr<Job>& j) { return j.get() == &job; });  // frees its queue slot now
    return Wait::TIMED_OUT;
  }
  error = job.error;
  return error.empty() ? Wait::DONE : Wait::FAILED;
}

void Batcher::stop() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  queued_.notify_all();
  for (auto& r : replicas_)
    if (r->thread.joinable()) r->thread.join();
}

void Batcher::abort(const std::string& why) {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
    for (const auto& job : queue_)
      if (job->error.empty()) job->error = why;
    queue_.clear();
  }
  queued_.notify_all();
  done_.notify_all();
}

size_t Batcher::queue_depth() const {
  std::lock_guard lk(mu_);
  return queue_.size();
}

uint64_t Batcher::forwards() const {
  return total([](const Replica& r) { return r.forwards.load(); });
}
uint64_t Batcher::inputs_encoded() const {
  return total([](const Replica& r) { return r.inputs.load(); });
}
uint64_t Batcher::tokens_encoded() const {
  return total([](const Replica& r) { return r.tokens.load(); });
}
double Batcher::forward_seconds() const {
  return double(total([](const Replica& r) { return r.forward_us.load(); })) / 1e6;
}
uint64_t Batcher::failed_forwards() const {
  return total([](const Replica& r) { return r.failed_forwards.load(); });
}
uint64_t Batcher::nonfinite_amax() const {
  return total([](const Replica& r) { return r.nonfinite.load(); });
}
GuardCounts Batcher::static_guarded() const {
  return {total([](const Replica& r) { return r.guarded[0].load(); }),
          total([](const Replica& r) { return r.guarded[1].load(); }),
          total([](const Replica& r) { return r.guarded[2].load(); })};
}
uint64_t Batcher::graph_replays() const {
  return total([](const Replica& r) { return r.graph_replays.load(); });
}
uint64_t Batcher::graph_eager() const {
  return total([](const Replica& r) { return r.graph_eager.load(); });
}
size_t Batcher::replicas_up() const {
  return total([](const Replica& r) { return size_t(r.up.load()); });
}

std::vector<ReplicaState> Batcher::replicas() const {
  std::vector<ReplicaState> out;
  std::lock_guard lk(mu_);
  for (const auto& r : replicas_)
    out.push_back({r->spec.name, r->up.load(), r->down_reason, r->forwards.load(), r->inputs.load(), r->tokens.load(),
                   r->failed_forwards.load(), double(r->forward_us.load()) / 1e6});
  return out;
}

int64_t Batcher::queued_tokens() const {
  int64_t tokens = 0;
  for (const auto& job : queue_)
    if (!job->abandoned && job->error.empty())
      for (size_t i = job->next; i < job->inputs.size(); ++i)
        tokens += visual_tokens(model_.config, job->inputs[i].grid);
  return tokens;
}

std::vector<Batcher::Slot> Batcher::take_batch() {
  std::vector<Slot> batch;
  ForwardPacker forward(max_batch_tokens_);
  while (!queue_.empty()) {
    const std::shared_ptr<Job>& job = queue_.front();
    if (job->abandoned || !job->error.empty() || job->next == job->inputs.size()) {
      queue_.pop_front();
      continue;
    }
    if (!forward.take(visual_tokens(model_.config, job->inputs[job->next].grid))) break;
    batch.push_back({job, job->next++});
    if (job->next == job->inputs.size()) queue_.pop_front();
  }
  return batch;
}

void Batcher::worker(Replica& r, std::promise<void>& ready) {
  name_this_thread(("fovea-" + r.spec.name).c_str());
  lower_this_thread_priority(http::kBulkNice);
  std::optional<EncoderRunner> runner;
  try {
    if (r.spec.gpu >= 0) use_gpu(r.spec.gpu);  // this thread's CUDA calls go to its GPU
    runner.emplace(model_, cfg_);
    runner->reserve(max_batch_tokens_);  // a forward of any shape within the limit allocates nothing
    if (const qwen3vl::GraphCounts g = runner->graph_counts(); g.captured > 0) {
      fmt::print(
          stderr,
          "fovea serve: {}: {} encoder CUDA graphs captured ({} merged tokens, up to {} segments) in {:.0f} ms\n",
          r.spec.name, g.captured, fmt::join(cfg_.graphs.tokens, "/"), cfg_.graphs.max_items, g.capture_ms);
      std::fflush(stderr);
    }
  } catch (...) {
    ready.set_exception(std::current_exception());
    return;
  }
  r.up = true;
  ready.set_value();
  std::optional<Started> running;  // the forward on the device now
  for (;;) {
    std::vector<Slot> next;
    {
      std::unique_lock lk(mu_);
      // With a forward running, take what is queued without waiting: it is started behind it.
      if (!running) queued_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
      next = take_batch();
      if (next.empty() && !running && stopping_) return;  // stopping and everything queued is done
    }
    // On a GPU the next forward is queued behind the running one before that one is handed out; on
    // the CPU starting a forward runs all of it, so the one before is handed out first (else its
    // replies would wait for the next forward).
    if (running && r.spec.gpu < 0) {
      finish_batch(r, *runner, *running);
      running.reset();
      if (!r.up) return fail_slots(r, next, "the encoder device was taken out of rotation");
    }
    std::optional<Started> started;
    if (!next.empty()) started = start_batch(r, *runner, std::move(next));
    if (running) finish_batch(r, *runner, *running);
    running = std::move(started);
    if (!r.up) {  // out of rotation: what it still holds fails, the others serve the queue
      if (running) fail_slots(r, running->slots, "the encoder device was taken out of rotation");
      return;
    }
  }
}

void Batcher::take_down(Replica& r, const std::string& why) {
  {
    std::lock_guard lk(mu_);
    if (!r.up) return;
    r.up = false;
    r.down_reason = why;
    if (replicas_up() == 0) {  // nobody left to run what is queued: it fails now, not at its deadline
      for (const auto& job : queue_)
        if (job->error.empty()) job->error = "no encoder device is up: " + why;
      queue_.clear();
    }
  }
  fmt::print(stderr, "fovea serve: encoder replica {} taken out of rotation ({} of {} still up): {}\n", r.spec.name,
             replicas_up(), replicas_.size(), why);
  std::fflush(stderr);
  done_.notify_all();
  queued_.notify_all();
}

std::shared_ptr<EncoderOutputsBf16> Batcher::recycled_outputs(Replica& r) {
  // A buffer whose inputs have all been replied to is held by the pool alone (the count cannot rise
  // meanwhile: only this thread hands buffers out).
  for (const auto& o : r.pool)
    if (o.use_count() == 1) return o;
  auto fresh = std::make_shared<EncoderOutputsBf16>();
  if (r.pool.size() < kPooledOutputs) r.pool.push_back(fresh);
  return fresh;
}

void Batcher::fail_slots(Replica& r, const std::vector<Slot>& slots, const std::string& error) {
  r.failed_forwards += 1;
  {
    std::lock_guard lk(mu_);
    for (const Slot& s : slots)
      if (s.job->error.empty()) s.job->error = fmt::format("encoder forward failed on {}: {}", r.spec.name, error);
  }
  done_.notify_all();
}

std::optional<Batcher::Started> Batcher::start_batch(Replica& r, EncoderRunner& runner, std::vector<Slot> slots) {
  // The worker alone reads inputs and writes outputs of the slots it took; waiters read outputs
  // only after seeing `done` reach the input count under the mutex.
  Started b;
  b.start = Clock::now();
  std::vector<const image::Patches*> inputs;
  for (const Slot& s : slots) {
    const image::Patches& p = s.job->inputs[s.index];
    inputs.push_back(&p);
    b.grids.push_back(p.grid);
    b.deepstack = b.deepstack || s.job->deepstack;
  }
  std::string error;
  try {
    if (r.fail_at > 0 && int64_t(r.forwards + r.failed_forwards) + 1 >= r.fail_at)
      fail("FOVEA_TEST_FAIL_REPLICA: replica {} fails its forward {} (test hook)", r.spec.name, r.fail_at);
    runner.start(inputs, b.deepstack);
  } catch (const std::exception& e) {
    error = e.what();
  } catch (...) {
    error = "unknown exception in the encoder forward";
  }
  if (!error.empty()) {
    take_down(r, error);  // first: a client answered 500 must find the replica down when it asks again
    fail_slots(r, slots, error);
    return std::nullopt;
  }
  for (const Slot& s : slots) {  // packed: the request keeps no copy
    std::vector<float>().swap(s.job->inputs[s.index].pixels);
    std::vector<uint8_t>().swap(s.job->inputs[s.index].raw);
  }
  b.slots = std::move(slots);
  return b;
}

void Batcher::finish_batch(Replica& r, EncoderRunner& runner, Started& b) {
  int64_t batch_tokens = 0;
  for (const auto& g : b.grids) batch_tokens += visual_tokens(model_.config, g);
  std::string error;
  std::shared_ptr<EncoderOutputsBf16> out;
  std::vector<Bf16Rows> rows;
  try {
    out = recycled_outputs(r);
    runner.finish(*out);
    rows = split_inputs(rows_of(*out), b.grids, model_.config);  // throws unless the rows match the grids
    r.nonfinite = runner.nonfinite_amax();
    const GuardCounts guarded = runner.static_guarded();
    r.guarded[0] = guarded.q, r.guarded[1] = guarded.k, r.guarded[2] = guarded.v;
    const qwen3vl::GraphCounts g = runner.graph_counts();
    r.graph_replays = uint64_t(g.replays), r.graph_eager = uint64_t(g.eager);
  } catch (const std::exception& e) {
    error = e.what();
  } catch (...) {
    error = "unknown exception in the encoder forward";
  }
  if (!error.empty()) {
    take_down(r, error);  // first, as in start_batch
    return fail_slots(r, b.slots, error);
  }
  const double forward_ms = runner.last_timings().gpu;
  for (size_t i = 0; i < b.slots.size(); ++i) {
    InputResult& o = b.slots[i].job->outputs[b.slots[i].index];
    o.forward = out;
    o.rows = std::move(rows[i]);
    o.queue_ms = ms_between(b.slots[i].job->submitted, b.start);
    o.forward_ms = forward_ms;
    o.batch_inputs = int(b.slots.size());
    o.batch_tokens = batch_tokens;
  }
  r.forwards += 1;
  r.inputs += b.slots.size();
  r.tokens += uint64_t(batch_tokens);
  r.forward_us += uint64_t(forward_ms * 1000);
  {
    std::lock_guard lk(mu_);
    if (batch_tokens > 0) {
      const double sample = forward_ms / 1000 / double(batch_tokens);
      seconds_per_token_ = seconds_per_token_ > 0 ? 0.8 * seconds_per_token_ + 0.2 * sample : sample;
      seconds_per_forward_ =
          seconds_per_forward_ > 0 ? 0.8 * seconds_per_forward_ + 0.2 * forward_ms / 1000 : forward_ms / 1000;
    }
    for (const Slot& s : b.slots) s.job->done += 1;
  }
  done_.notify_all();
}

}  // namespace fovea::server
