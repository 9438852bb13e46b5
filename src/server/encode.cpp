// POST /v1/encode (see encode.h): parse, find cached items, prepare the others within the decode
// budget, queue them for the batching workers, wait (bounded), write new cache entries, reply.
#include "server/encode.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <map>
#include <functional>
#include <thread>
#include <mutex>
#include <span>

#include <fmt/format.h>

#include "fovea/clock.h"
#include "fovea/error.h"
#include "fovea/json.h"
#include "fovea/safetensors.h"
#include "fovea/sha256.h"
#include "fovea/threads.h"
#include "fovea/base64.h"

namespace fovea::server {

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

http::Response json_response(int status, const json& body) { return {status, "application/json", dump(body), {}}; }

namespace {
const char* error_type(int status) {
  if (status == 503) return "overloaded_error";
  if (status == 504) return "timeout_error";
  if (status >= 500) return "server_error";
  return "invalid_request_error";
}
}  // namespace

http::Response error_response(const ApiError& e) {
  return json_response(e.status,
                       {{"error", {{"message", e.message}, {"type", error_type(e.status)}, {"code", e.code}}}});
}

namespace {

// bf16 rows are sent as the bytes they are in memory (little-endian), or widened to floats.
static_assert(std::endian::native == std::endian::little, "bf16 rows are sent as they lie in memory");

// One item of a reply: its kind and grid, its cache key and whether it was found there, its rows
// (views into the forward's outputs, or into `loaded`: a cached entry read back) and its timings.
struct ReplyItem {
  InputKind kind = InputKind::IMAGE;
  qwen3vl::GridThw grid{};
  std::string key;      // "" without the encoder cache
  bool cached = false;  // found in the cache: not encoded
  Bf16Rows rows;
  EcEntry loaded;
  std::optional<ClipSampling> clip;  // a clip's sampling, for the LLM's prompt
  json timings = json::object(), batch = json::object();
  std::optional<size_t> same_as;  // an earlier item with this key (and so these bytes): answered from its rows
};

// What the handler works through: the parsed request, its items and where its reply goes. Shared
// by the steps of the request (a worker, the fetching thread while URL items are fetched, a worker
// again).
struct Exchange {
  EncodeRequest r;
  InputConfig inputs;  // the server's preprocessing, narrowed by the request's kwargs (apply_mm_kwargs)
  std::vector<ReplyItem> items;
  Clock::time_point deadline, received;
  Clock::time_point mark;    // when the last phase ended (Metrics::add_phase)
  bool embeddings = true;    // the reply carries embeddings
  bool octet = false;        // a safetensors reply
  std::string request_id;    // a chat reply's id
  std::shared_ptr<Job> job;  // holds the forwards' outputs the reply's rows view
  http::Handler::Reply reply;
  std::function<http::Response(const Context&, const Exchange&)> answer;  // the reply once the items are done
  struct Held {  // room the URL items' bytes took in Context::fetch_budget
    ByteBudget* budget = nullptr;
    std::atomic<int64_t> bytes = 0;
    ~Held() {
      if (budget) budget->release(bytes);
    }
  } fetched;
  std::mutex fetch_mu;  // guards the two below and the items' fetched while fetches run
  size_t fetching = 0;  // http(s) fetches not yet back
  std::optional<ApiError> fetch_error;
};
using ExchangePtr = std::shared_ptr<Exchange>;

// The reply to a failed request; a 503 says when to retry.
http::Response failure(const ApiError& e) {
  http::Response res = error_response(e);
  if (e.status == 503) res.headers.push_back({"Retry-After", "1"});
  return res;
}

// Runs one step of the request; what it throws is the request's reply.
void guarded(Exchange& x, const std::function<void()>& step) {
  try {
    step();
  } catch (const ApiError& e) {
    x.reply(failure(e));
  } catch (const std::exception& e) {
    x.reply(failure({500, "internal_error", e.what()}));
  }
}

// file:// items read now, on this worker (a local file, opened non-blocking); the first item of each
// http(s) URL fetched apart (media-url.h), `fetched` called on the fetching thread once all are in.
// A URL given twice is read once: its later items get a copy (copy_repeated_urls), so one request
// never sees two contents under one URL.
void read_remote(Context& c, const ExchangePtr& xp, const std::function<void()>& fetched) {
  Exchange& x = *xp;
  EncodeRequest& r = x.r;
  x.fetched.budget = &c.fetch_budget;
  std::map<std::string_view, size_t> first;  // URL -> the item it is read for
  std::vector<size_t> http;
  for (size_t i = 0; i < r.items.size(); ++i) {
    RequestItem& item = r.items[i];
    if (item.remote_url.empty()) continue;
    if (!c.media) reject(400, "invalid_url", item.name + ": this server reads no URLs");
    if (!first.emplace(item.remote_url, i).second) continue;
    if (MediaSources::is_http(item.remote_url)) {
      http.push_back(i);
      continue;
    }
    int64_t held = 0;
    item.fetched = c.media->read(item.remote_url, item.name, c.fetch_budget, held);
    x.fetched.bytes += held;
  }
  if (http.empty()) return fetched();
  x.fetching = http.size();
  auto failed = std::make_shared<std::atomic<bool>>(false);  // the first failure ends the other fetches
  for (const size_t i : http) {
    const FetchDone done = [xp, i, fetched, failed](Fetched f) {
      Exchange& x = *xp;
      bool last = false;
      {
        std::lock_guard lk(x.fetch_mu);
        if (f.error) failed->store(true);
        if (f.error && !x.fetch_error) x.fetch_error = std::move(f.error);
        x.r.items[i].fetched = std::move(f.bytes);
        x.fetched.bytes += f.held;
        last = --x.fetching == 0;
      }
      if (last) fetched();
    };
    try {
      c.media->fetch(r.items[i].remote_url, r.items[i].name, x.deadline, c.fetch_budget, done, failed);
    } catch (const ApiError& e) {
      done({{}, 0, e});
    }
  }
}

// The later items of a URL given twice get a copy of its bytes, which the budget counts too.
void copy_repeated_urls(Context& c, Exchange& x) {
  EncodeRequest& r = x.r;
  std::map<std::string_view, size_t> first;
  for (size_t i = 0; i < r.items.size(); ++i) {
    RequestItem& item = r.items[i];
    if (item.remote_url.empty()) continue;
    const auto [seen, fresh] = first.emplace(item.remote_url, i);
    if (fresh) continue;
    const std::vector<uint8_t>& bytes = r.items[seen->second].fetched;
    if (!c.fetch_budget.acquire(int64_t(bytes.size()), Clock::now()))
      reject(503, "server_busy",
             fmt::format("{}: no room for a copy of {}'s bytes now (--max-body-bytes-in-flight); retry later",
                         item.name, r.items[seen->second].name));
    x.fetched.bytes += int64_t(bytes.size());
    item.fetched = bytes;
  }
}

// The item's bytes; its base64 text (or what was read from its URL) is freed unless keep (it may be
// decoded again).
std::vector<uint8_t> item_bytes(EncodeRequest& r, size_t i, bool keep = false) {
  RequestItem& item = r.items[i];
  if (!item.remote_url.empty()) return keep ? item.fetched : std::move(item.fetched);
  try {
    std::vector<uint8_t> bytes = base64_decode(item.payload, item.name);
    if (!keep) std::string().swap(item.payload);
    return bytes;
  } catch (const Error& e) {
    throw ApiError{400, "invalid_base64", e.what()};
  }
}

// The request's error for a failed item: what a hook threw as it is; a failure past the deadline (a
// clip's decode stops there) 504; any other 400, naming the item.
[[noreturn]] void reject_item(const Context& c, std::exception_ptr error, InputKind kind, const std::string& name,
                              Clock::time_point deadline) {
  try {
    std::rethrow_exception(error);
  } catch (const ApiError&) {
    throw;
  } catch (const Error& e) {
    if (Clock::now() > deadline)
      reject(504, "timeout",
             fmt::format("{}: not decoded within {} s (--request-timeout)", name, c.opt.request_timeout_s));
    const std::string what = e.what();  // decode errors name the item, preprocess errors do not
    reject(400, invalid_item_code(kind),
           what.find(name) != std::string::npos ? what : fmt::format("{} '{}': {}", input_kind_name(kind), name, what));
  }
}

// What one request holds while its items are prepared: room in the encoder queue (admitted item by
// item from their headers) and decode memory from --max-decode-bytes: while a clip is opened, what
// opening it may cost; then, once every item is planned, what preparing them all holds at its peak,
// in one reservation (a request never waits for memory while it holds some: no two requests can
// each hold part of the budget and wait for the rest). Everything goes back when it is submitted or
// fails.
struct Holds {
  Holds(Context& c, const Exchange& x, const std::vector<size_t>& which)
      : c(c), x(x), which(which), opening(which.size(), 0), admission(c.batcher) {
    for (const size_t i : which) names.push_back(x.r.items[i].name);
  }
  ~Holds() {
    release();
    for (int64_t& b : opening) c.decode_budget.release(std::exchange(b, 0));
  }
  // Waits for `bytes` of the budget until the deadline; `what` names what they are for.
  void acquire(int64_t bytes, InputKind kind, const std::string& what) {
    ByteBudget& budget = c.decode_budget;
    if (bytes > budget.capacity())
      throw ApiError{400, invalid_item_code(kind),
                     fmt::format("{} needs {} bytes to decode, more than the server's {} (--max-decode-bytes)", what,
                                 bytes, budget.capacity())};
    if (!budget.acquire(bytes, x.deadline))
      throw ApiError{
          503, "server_busy",
          fmt::format("{}: no room to decode before the request's deadline (the server's images and clips being "
                      "decoded hold {} of {} bytes, --max-decode-bytes)",
                      what, budget.used(), budget.capacity())};
  }
  void open(size_t j, int64_t bytes) {  // item j's hooks run one after another on one thread
    if (bytes == 0) {
      c.decode_budget.release(std::exchange(opening[j], 0));
      return;
    }
    acquire(bytes, InputKind::VIDEO, fmt::format("video '{}': opening it", names[j]));
    opening[j] = bytes;
  }
  void admit(size_t j, const InputPlan& p) {
    std::string refused;
    if (!c.batcher.admit(admission, p.tokens, refused, x.deadline))
      throw ApiError{503, "queue_full",
                     fmt::format("{} '{}': {}; retry later", input_kind_name(p.kind), names[j], refused)};
  }
  void all(int64_t bytes) {
    const bool one = names.size() == 1;
    acquire(bytes, x.items[which[0]].kind,
            one ? fmt::format("{} '{}'", input_kind_name(x.items[which[0]].kind), names[0])
                : fmt::format("the request's {} inputs", names.size()));
    held = bytes;
  }
  void release() { c.decode_budget.release(std::exchange(held, 0)); }
  Context& c;
  const Exchange& x;
  const std::vector<size_t> which;
  std::vector<std::string> names;
  std::vector<int64_t> opening;  // per clip, while it is opened
  int64_t held = 0;              // the request's, from its plans until it is submitted
  Batcher::Admission admission;
};

// Requests decoding or probing media at once share the cores: while it lives, this thread's
// parallel_for loops and its clips' FFmpeg threads get hardware_threads() / that count.
class DecodeShare {
 public:
  DecodeShare() : cap_(hardware_threads() / std::max(1, ++decoding_)) {}
  ~DecodeShare() { --decoding_; }
  DecodeShare(const DecodeShare&) = delete;
  DecodeShare& operator=(const DecodeShare&) = delete;

 private:
  static inline std::atomic<int> decoding_{0};
  ThreadCap cap_;
};

// Decodes and preprocesses the items `which` (fovea::prepare_inputs), admitted to the encoder queue
// and to the decode budget from their headers before a pixel is decoded (Holds). Requests decoding
// at once share the cores (clips' FFmpeg threads and resizes too).
std::vector<PreparedInput> prepare(Context& c, Exchange& x, Holds& holds) {
  const DecodeShare share;
  PrepareHooks hooks;
  hooks.deadline = x.deadline;
  hooks.all_or_nothing = true;
  hooks.opening = [&](size_t j, int64_t bytes) { holds.open(j, bytes); };
  hooks.planned = [&](size_t j, const InputPlan& p) { holds.admit(j, p); };
  hooks.all_planned = [&](int64_t bytes) { holds.all(bytes); };
  std::vector<PreparedInput> out = prepare_inputs(
      holds.names, [&](size_t j) { return item_bytes(x.r, holds.which[j]); }, x.inputs, hooks);
  for (size_t j = 0; j < out.size(); ++j)
    if (out[j].error) reject_item(c, out[j].error, out[j].kind, holds.names[j], x.deadline);
  return out;
}

// Whether items a and b hold the same bytes: the same text, the same URL (read once), or the same
// bytes once decoded.
bool same_bytes(EncodeRequest& r, size_t a, size_t b) {
  const RequestItem &ia = r.items[a], &ib = r.items[b];
  if (ia.remote_url.empty() && ib.remote_url.empty() && ia.payload == ib.payload) return true;
  if (!ia.remote_url.empty() && ia.remote_url == ib.remote_url) return true;
  return item_bytes(r, a, /*keep=*/true) == item_bytes(r, b, /*keep=*/true);
}

// With the encoder cache: each item's key, the identifier vLLM's consumer looks it up by
// (vllm_mm_hash): its uuid (the client's, or the sha256 of its URL string as sent: vLLM's EPD
// proxy's) as it is, or, when the request's kwargs say something for its modality, hashed with them
// and the served model's name. A key names one content in a request: an item whose key an earlier
// item has, with the same bytes, is answered from that item (looked up, encoded and written once);
// other bytes under one key are refused, naming both items.
void assign_keys(const Context& c, Exchange& x) {
  EncodeRequest& r = x.r;
  std::map<std::string, size_t> first;
  for (size_t i = 0; i < x.items.size(); ++i) {
    ReplyItem& it = x.items[i];
    RequestItem& item = r.items[i];
    const std::string url = !item.uuid.empty()         ? ""
                            : !item.remote_url.empty() ? item.remote_url
                                                       : item.url_prefix + item.payload;
    it.key = vllm_mm_hash(c.opt.served_name(), it.kind, item.uuid.empty() ? sha256_hex(url) : item.uuid, r.kwargs);
    const auto [seen, fresh] = first.emplace(it.key, i);
    if (fresh) continue;
    if (!same_bytes(r, seen->second, i))
      reject(400, "invalid_uuid",
             fmt::format("{}: uuid {} is also {}'s, whose bytes differ: a uuid names one content", item.name,
                         quote_for_error(it.key), r.items[seen->second].name));
    it.same_as = seen->second;
    std::string().swap(item.payload);
    std::vector<uint8_t>().swap(item.fetched);
  }
}

// Each item that repeats an earlier one's key answered as that item is (its rows are shared).
void fill_repeats(Exchange& x) {
  for (ReplyItem& it : x.items) {
    if (!it.same_as) continue;
    const ReplyItem& first = x.items[*it.same_as];
    it.kind = first.kind;
    it.grid = first.grid;
    it.cached = first.cached;
    it.rows = first.rows;
    it.clip = first.clip;
    it.timings = first.timings;
    it.batch = first.batch;
  }
}

// With the encoder cache: the first item of each key looked up. A hit's grid (and a clip's sampling)
// comes from its header, probed as a miss is planned (plan_inputs): a clip opened holds decode
// budget meanwhile and probes share the cores with decoding requests. Its rows are read back when the
// reply carries them; a file evicted (or damaged) by another writer since the lookup is encoded again.
void find_cached(Context& c, Exchange& x) {
  EncodeRequest& r = x.r;
  std::vector<size_t> hits;
  for (size_t i = 0; i < x.items.size(); ++i)
    if (!x.items[i].same_as && (x.items[i].cached = c.cache->lookup(x.items[i].key))) hits.push_back(i);
  if (hits.empty()) return;
  const auto t = Clock::now();
  std::vector<PlannedInput> plans;
  {
    Holds holds(c, x, hits);
    const DecodeShare share;
    PrepareHooks hooks;
    hooks.deadline = x.deadline;
    hooks.opening = [&](size_t j, int64_t bytes) { holds.open(j, bytes); };
    plans = plan_inputs(
        holds.names, [&](size_t j) { return item_bytes(r, hits[j], x.embeddings); }, x.inputs, hooks);
  }
  for (size_t j = 0; j < hits.size(); ++j) {
    ReplyItem& it = x.items[hits[j]];
    if (plans[j].error) reject_item(c, plans[j].error, it.kind, r.items[hits[j]].name, x.deadline);
    it.grid = plans[j].plan.grid;
    it.clip = plans[j].plan.clip;
    it.timings = {{"decode", 0.0}, {"preprocess", 0.0}, {"probe", ms_since(t)}, {"queue", 0.0}, {"forward", 0.0}};
    if (!x.embeddings) continue;
    try {
      it.loaded = c.cache->load(it.key, it.grid, c.model.config, r.deepstack);
      it.rows = it.loaded.rows;
      std::string().swap(r.items[hits[j]].payload);
      std::vector<uint8_t>().swap(r.items[hits[j]].fetched);
    } catch (const Error&) {
      ReplyItem again;  // encoded after all
      again.kind = it.kind;
      again.key = std::move(it.key);
      it = std::move(again);
    }
  }
}

// Queues the prepared items (the room admitted for them becomes theirs; their decode bytes go back)
// and waits for their forwards; the job holds their outputs.
std::shared_ptr<Job> run_job(Context& c, const Exchange& x, std::vector<PreparedInput>& prepared, Holds& holds) {
  std::vector<image::Patches> inputs;
  for (PreparedInput& p : prepared) inputs.push_back(std::move(p.patches));
  // The cache holds every deepstack output, so a request that fills it asks for them.
  const bool deepstack = x.r.deepstack || (c.cache && !c.model.config.deepstack.empty());
  std::string refused;
  std::shared_ptr<Job> job = c.batcher.submit(std::move(inputs), deepstack, refused, &holds.admission);
  holds.release();
  if (!job) reject(503, "queue_full", refused + "; retry later");
  std::string error;
  switch (c.batcher.wait(*job, x.deadline, error)) {
    case Batcher::Wait::TIMED_OUT:
      reject(504, "timeout", fmt::format("not encoded within {} s (--request-timeout)", c.opt.request_timeout_s));
    case Batcher::Wait::FAILED:
      if (c.abandoned) reject(503, "shutting_down", error);
      reject(500, "encoder_error", error);
    case Batcher::Wait::DONE: break;
  }
  return job;
}

// The encoded items' rows, sampling and timings on their reply items; new cache entries written.
void collect(Context& c, Exchange& x, const std::vector<size_t>& which, const std::vector<PreparedInput>& prepared,
             const Job& job) {
  for (size_t j = 0; j < which.size(); ++j) {
    ReplyItem& it = x.items[which[j]];
    const InputResult& o = job.outputs[j];
    it.grid = job.inputs[j].grid;
    it.clip = prepared[j].clip;
    it.rows = o.rows;
    it.timings = {{"decode", prepared[j].decode_ms},
                  {"preprocess", prepared[j].preprocess_ms},
                  {"queue", o.queue_ms},
                  {"forward", o.forward_ms}};
    it.batch = {{"images", o.batch_inputs}, {"tokens", o.batch_tokens}};
    if (!c.cache) continue;
    try {
      c.cache->store(it.key, it.rows, it.grid, c.model.config);
    } catch (const EcCacheFull& e) {  // every file it could evict may still be read by vLLM: retry later
      reject(503, "ec_cache_full", fmt::format("{}: {}", x.r.items[which[j]].name, e.what()));
    } catch (const Error& e) {
      reject(500, "ec_cache_write_failed", fmt::format("{}: {}", x.r.items[which[j]].name, e.what()));
    }
  }
}

// The JSON reply, written out member by member: the embeddings (megabytes of base64 per item) are
// appended as they are, never passed through the JSON writer's per-character escaping; everything
// else is dumped by nlohmann. With the encoder cache, embeddings only if asked for.
std::string json_reply(const Context& c, const Exchange& x, double total_ms) {
  const EncodeRequest& r = x.r;
  const auto open_object = [](const json& j) {  // the object's text without its closing brace
    std::string t = dump(j);
    t.pop_back();
    return t;
  };
  const auto append_value = [&](std::string& out, std::span<const uint16_t> v) {
    if (!r.as_base64) {
      out += dump(json(widen_bf16(v)));
      return;
    }
    out += '"';
    base64_append(out, reinterpret_cast<const uint8_t*>(v.data()), v.size() * 2);  // [A-Za-z0-9+/=]: no escaping
    out += '"';
  };
  std::string out;
  if (r.as_base64 && x.embeddings) {  // one allocation: the base64 text plus room for each item's few fields
    size_t bytes = 0;
    for (const ReplyItem& it : x.items)
      bytes += (1 + (r.deepstack ? it.rows.deepstack.size() : 0)) * base64_size(it.rows.merged.size() * 2) + 1024;
    out.reserve(bytes + 1024);
  }
  out += open_object({{"object", "list"},
                      {"model", c.opt.served_name()},
                      {"encoding", r.as_base64 ? "base64" : "float"},
                      {"dtype", r.as_base64 ? "bf16" : "float32"}});
  out += ",\"data\":[";
  for (size_t i = 0; i < x.items.size(); ++i) {
    const ReplyItem& it = x.items[i];
    if (i) out += ',';
    json head = {{"index", i},
                 {"type", input_kind_name(it.kind)},
                 {"grid_thw", it.grid},
                 {"num_tokens", visual_tokens(c.model.config, it.grid)},
                 {"hidden_size", c.model.config.out_hidden}};
    if (it.clip) {
      head["fps"] = it.clip->fps;
      head["frame_indices"] = it.clip->frame_indices;
      head["timestamps"] = it.clip->timestamps;
    }
    if (c.cache) {
      head["uuid"] = it.key;
      head["cached"] = it.cached;
    }
    out += open_object(head);
    if (x.embeddings) {
      out += ",\"embeddings\":";
      append_value(out, it.rows.merged);
      if (r.deepstack) {
        out += ",\"deepstack\":[";
        for (size_t k = 0; k < it.rows.deepstack.size(); ++k) {
          if (k) out += ',';
          append_value(out, it.rows.deepstack[k]);
        }
        out += ']';
      }
    }
    out += ",\"timings_ms\":" + dump(it.timings) + ",\"batch\":" + dump(it.batch) + "}";
  }
  out += "],\"timings_ms\":" + dump(json{{"total", total_ms}}) + "}";
  return out;
}

// The safetensors file `fovea encode -o` writes for these items (OutputTensors): BF16 tensors straight
// from the bf16 rows, or, with "encoding": "float", F32 ones (those values widened, as in the float
// JSON reply; see request.h); deepstack only if asked for; the per-item timings (and cache keys) in
// the metadata.
std::string safetensors_reply(const Context& c, const Exchange& x) {
  OutputTensors out(c.model.config);
  out.meta = {
      {"model", c.opt.served_name()}, {"dtype", dtype_name(c.engine.dtype)}, {"device", device_name(c.engine.device)}};
  for (const ReplyItem& it : x.items) {
    const Bf16Rows rows{it.rows.merged, x.r.deepstack ? it.rows.deepstack : std::vector<std::span<const uint16_t>>{}};
    const std::string p = out.add(it.kind, it.grid, rows, /*widen=*/!x.r.as_base64, it.clip);
    out.meta[p + ".timings_ms"] = dump(it.timings);
    if (c.cache) {
      out.meta[p + ".uuid"] = it.key;
      out.meta[p + ".cached"] = it.cached ? "true" : "false";
    }
  }
  return safetensors_bytes("reply", out.tensors(), out.meta);
}

}  // namespace

namespace {

// The items of x.r encoded (or found in the cache), their rows and timings on x.items, new cache
// entries written, once the URL items are in; then the reply. Adds each phase's time to the metrics
// as it ends (x.mark: when the last one ended).
void encode_items(Context& c, Exchange& x) {
  const auto phase_ended = [&](Phase p) { c.metrics.add_phase(p, seconds_since(std::exchange(x.mark, Clock::now()))); };
  if (x.fetch_error) throw *x.fetch_error;
  copy_repeated_urls(c, x);
  const std::vector<InputKind> kinds = settle_kinds(x.r);
  for (size_t i = 0; i < kinds.size(); ++i) x.items[i].kind = kinds[i];
  if (c.cache) {
    assign_keys(c, x);
    find_cached(c, x);
  }
  std::vector<size_t> misses;  // the items to encode
  for (size_t i = 0; i < x.items.size(); ++i)
    if (!x.items[i].cached && !x.items[i].same_as) misses.push_back(i);
  phase_ended(Phase::PARSE);
  Holds holds(c, x, misses);
  std::vector<PreparedInput> prepared = prepare(c, x, holds);
  phase_ended(Phase::DECODE);
  if (!misses.empty()) {
    x.job = run_job(c, x, prepared, holds);
    collect(c, x, misses, prepared, *x.job);
  }
  fill_repeats(x);
  phase_ended(Phase::ENCODER);
  http::Response res = x.answer(c, x);
  phase_ended(Phase::REPLY);
  x.reply(std::move(res));
}

// The parsed request's items: URL items read (http(s) ones apart from the workers: this worker is
// free meanwhile, and the request comes back to a worker when they are in), then encode_items.
void start_items(Context& c, const ExchangePtr& xp) {
  xp->items.resize(xp->r.items.size());
  read_remote(c, xp, [&c, xp, here = std::this_thread::get_id()] {
    if (std::this_thread::get_id() == here && xp->fetching == 0) return guarded(*xp, [&] { encode_items(c, *xp); });
    c.http->post([&c, xp] { guarded(*xp, [&] { encode_items(c, *xp); }); });
  });
}

// The preprocessing a chat request's kwargs ask for (apply_mm_kwargs), or its 400 naming the key: an
// option fovea does not implement is unsupported_field, a bad value invalid_request.
InputConfig request_inputs(const Context& c, const MmKwargs& k) {
  try {
    return apply_mm_kwargs(c.inputs, k);
  } catch (const Error& e) {
    const std::string what = e.what();
    reject(400, what.find("not implemented") != std::string::npos ? "unsupported_field" : "invalid_request", what);
  }
}

Clock::time_point deadline_of(const Context& c, const http::Request& req) {
  const Clock::time_point deadline = req.received + from_seconds(c.opt.request_timeout_s);
  if (Clock::now() > deadline)
    reject(504, "timeout", fmt::format("not started within {} s (--request-timeout)", c.opt.request_timeout_s));
  return deadline;
}

// What vLLM's Qwen3-VL takes beside an item's embeddings, as the proxy puts it in the rewritten
// image_embeds / video_embeds part: the grid, and for a clip one timestamp (seconds) per temporal
// patch, from which the prompt's "<t seconds>" text before each patch's tokens is written.
json embeds_metadata(const ReplyItem& it) {
  if (it.kind != InputKind::VIDEO) return {{"image_grid_thw", it.grid}};
  return {{"video_grid_thw", it.grid}, {"timestamps", it.clip ? it.clip->timestamps : std::vector<double>{}}};
}

// vLLM's EPD proxy reads ec_transfer_params alone: per cache key, the metadata its embeds reference
// takes and the item's positions in this request (a key repeated lists each). The rest is a minimal
// OpenAI chat.completion: nothing generated, the visual tokens as the prompt's usage.
std::string chat_reply(const Context& c, const Exchange& x, const std::string& request_id) {
  json params = json::object();
  int64_t tokens = 0;
  for (size_t i = 0; i < x.items.size(); ++i) {
    const ReplyItem& it = x.items[i];
    tokens += visual_tokens(c.model.config, it.grid);
    json& entry = params[it.key];
    if (entry.empty()) entry = {{"metadata", embeds_metadata(it)}, {"item_indices", json::array()}};
    entry["item_indices"].push_back(i);
  }
  const json reply = {{"id", "chatcmpl-" + request_id},
                      {"object", "chat.completion"},
                      {"created", std::time(nullptr)},
                      {"model", c.opt.served_name()},
                      {"choices", json::array({{{"index", 0},
                                                {"message", {{"role", "assistant"}, {"content", ""}}},
                                                {"logprobs", nullptr},
                                                {"finish_reason", "stop"}}})},
                      {"usage", {{"prompt_tokens", tokens}, {"completion_tokens", 0}, {"total_tokens", tokens}}},
                      {"ec_transfer_params", std::move(params)}};
  return dump(reply);
}

}  // namespace

void encode(Context& c, http::Request& req, http::Handler::Reply reply) {
  auto xp = std::make_shared<Exchange>();
  xp->reply = std::move(reply);
  xp->mark = Clock::now();
  guarded(*xp, [&] {
    Exchange& x = *xp;
    x.deadline = deadline_of(c, req);
    x.received = req.received;
    x.r = parse_encode_request(req.body, c.opt.max_images_per_request, c.opt.served_name());
    x.inputs = c.inputs;
    std::string().swap(req.body);
    x.octet = req.header("accept").find("application/octet-stream") != std::string_view::npos;
    // Embeddings: always without the cache and in safetensors replies; with the cache, if asked for.
    x.embeddings = x.octet || (c.cache ? x.r.return_embeddings == 1 : x.r.return_embeddings != 0);
    x.answer = [](const Context& c, const Exchange& x) {
      return x.octet ? http::Response{200, "application/octet-stream", safetensors_reply(c, x), {}}
                     : http::Response{200, "application/json", json_reply(c, x, ms_since(x.received)), {}};
    };
    start_items(c, xp);
  });
}

void chat(Context& c, http::Request& req, http::Handler::Reply reply) {
  auto xp = std::make_shared<Exchange>();
  xp->reply = std::move(reply);
  xp->mark = Clock::now();
  guarded(*xp, [&] {
    if (!c.cache)
      reject(400, "invalid_request",
             "POST /v1/chat/completions is the encode instance of vLLM's disaggregated encoder: it writes the encoder "
             "cache, so start fovea serve with --ec-storage-path (POST /v1/encode returns embeddings)");
    Exchange& x = *xp;
    x.deadline = deadline_of(c, req);
    x.received = req.received;
    x.r = parse_chat_request(req.body, c.opt.max_images_per_request, c.opt.served_name());
    x.inputs = request_inputs(c, x.r.kwargs);
    std::string().swap(req.body);
    x.embeddings = false;
    static std::atomic<uint64_t> replies{0};
    x.request_id = std::string(req.header("x-request-id").substr(0, 128));
    if (x.request_id.empty()) x.request_id = fmt::format("{:x}-{}", c.started_unix, replies++);
    x.answer = [](const Context& c, const Exchange& x) {
      return http::Response{200, "application/json", chat_reply(c, x, x.request_id), {}};
    };
    start_items(c, xp);
  });
}

}  // namespace fovea::server
