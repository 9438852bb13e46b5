// fovea/pipeline.h: from inputs (images and video clips) to per-input visual tokens, the one path
// `fovea encode`, `fovea serve`, `check-golden` and the benches share (src/engine/):
//   input_kind / probe_input  what an input is and what it will cost, from its header alone;
//   prepare_inputs            decode + preprocess a list of inputs, errors kept per input;
//   pack_forwards             inputs into forwards of at most N visual tokens;
//   EncoderRunner             the encoder forward the engine configuration selects (CPU or GPU);
//   split_inputs              a forward's outputs cut back into each input's rows;
//   OutputTensors             each input's tensors as `encode -o` writes them and `serve` returns them.
// Images are prepared as raw uint8 patches (normalized by the encoder), clips as fp32 ones (their
// frames differ within a temporal patch, which the raw form cannot hold); EncoderRunner takes any mix.
#pragma once
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "fovea/clock.h"
#include "fovea/engine.h"
#include "fovea/image.h"
#include "fovea/model.h"
#include "fovea/safetensors.h"
#include "fovea/video.h"

namespace fovea {

// ---- inputs ---------------------------------------------------------------------------------------

enum class InputKind { IMAGE, VIDEO };
const char* input_kind_name(InputKind k);  // "image", "video": the prefix of its tensors and its reply type

// The one image-or-clip decision: a clip when its first bytes start like a container fovea reads
// (video::looks_like_video; 512 bytes are enough), whatever its name; an image otherwise.
InputKind input_kind(std::span<const uint8_t> head);
// The same for a file's first bytes (an unreadable file counts as an image: its decode says why).
InputKind file_input_kind(const std::string& path);

// How every input is preprocessed: the model's image and video processors, and what a clip may cost.
struct InputConfig {
  image::PreprocessConfig image;
  video::VideoConfig video;
  video::VideoLimits limits;
};
InputConfig load_input_config(const std::string& model, const image::PreprocessOverrides& image = {},
                              const video::VideoOverrides& video = {});

// What one request (or `fovea encode`) asks of the preprocessing, under vLLM's names: a chat
// request's "mm_processor_kwargs" (transformers' processor options) and "media_io_kwargs" (vLLM's
// media loaders'), as sent: key order kept, since vLLM hashes them in that order (vllm_mm_hash,
// fovea/ec-cache.h). null or {} is the same as absent.
struct MmKwargs {
  nlohmann::ordered_json processor = nlohmann::ordered_json::object();
  nlohmann::ordered_json media_io = nlohmann::ordered_json::object();
  bool empty() const;
};
// The same from JSON text (`fovea encode --mm-processor-kwargs/--media-io-kwargs`); "" is absent.
MmKwargs parse_mm_kwargs(std::string_view processor, std::string_view media_io);

// The preprocessing of a request that sends `k`: `server`'s, with what k sets applied, never past
// the server's own limits (a request lowers a budget, never raises it). mm_processor_kwargs takes,
// as Qwen3-VL's processor does: "max_pixels", "min_pixels" (images), "size": {"longest_edge",
// "shortest_edge"} (images and clips), "fps", "num_frames", "min_frames", "max_frames" (clips), and
// the same scoped in "images_kwargs" (max_pixels, min_pixels, size) or "videos_kwargs" (all of them,
// max_pixels and min_pixels then meaning the clip's budget). A key set to null keeps the server's
// value. media_io_kwargs takes modality keys whose options are empty ({"video": {}}): fovea reads a
// clip once, sampling as the processor does, so vLLM's loader options are not implemented. Anything
// else, a value of the wrong type, out of range, not finite, or past the server's limit throws
// fovea::Error naming the key ("mm_processor_kwargs.videos_kwargs.fps: ...").
InputConfig apply_mm_kwargs(const InputConfig& server, const MmKwargs& k);

// The largest encoded input (image or clip file) the engine reads, and a file read within it.
size_t max_input_bytes(const InputConfig& cfg);
std::vector<uint8_t> read_input(const std::string& path, const InputConfig& cfg);

// Visual tokens (merger output rows) of an input of grid g: t*h*w / merge^2.
int64_t visual_tokens(const qwen3vl::VisionConfig& c, const qwen3vl::GridThw& g);

// A clip's sampling, which an LLM's prompt needs beside its tokens.
struct ClipSampling {
  std::vector<int64_t> frame_indices;
  std::vector<double> timestamps;  // per temporal patch, seconds
  double fps = 0;                  // the clip's frame rate
};

// What an input will be, from its header alone (no pixel decoded): its kind, grid and visual
// tokens, the bytes decoding and preprocessing it hold at their peak, and a clip's sampling.
struct InputPlan {
  InputKind kind = InputKind::IMAGE;
  qwen3vl::GridThw grid{};
  int64_t tokens = 0;
  int64_t peak_bytes = 0;
  // What it holds from its plan until it is queued (a clip's packets, then its patches): preparing a
  // list holds these for every input, and one input's peak beyond them at a time.
  int64_t held_bytes = 0;
  std::optional<ClipSampling> clip;  // set for a clip
};
// What preparing these inputs holds at its peak (prepare_inputs' order: the images decode at once,
// then the clips one after another, every input keeping its held_bytes until it is queued).
int64_t prepare_peak_bytes(const std::vector<InputPlan>& plans);
// Throws fovea::Error naming the input for anything unreadable or over a limit (plan_inputs of one
// input, without hooks).
InputPlan probe_input(std::span<const uint8_t> bytes, const std::string& name, const InputConfig& cfg);

// ---- decode + preprocess --------------------------------------------------------------------------

struct PreparedInput {
  InputKind kind = InputKind::IMAGE;
  image::Patches patches;            // empty when `error` is set
  std::optional<ClipSampling> clip;  // set for a clip
  std::exception_ptr error;          // what reading, decoding or preprocessing threw, as thrown
  double decode_ms = 0, preprocess_ms = 0;
  int64_t frames_decoded = 0;         // clips: frames the decoder produced
  std::string error_message() const;  // error's what(); empty if none
};

// What the caller of prepare_inputs hooks in (serve: its decode-memory budget and deadline).
struct PrepareHooks {
  // Called before a clip's container is opened, with the bytes opening it may hold at most
  // (video::container_cost: the demuxer's index and buffers, the packets kept), and again with 0
  // once it is open (or failed); what it throws is that input's error.
  std::function<void(size_t, int64_t)> opening;
  // Called with each input's plan before a pixel of it is decoded; what it throws is that input's error.
  std::function<void(size_t, const InputPlan&)> planned;
  // Called once every input is planned and before any is decoded, with prepare_peak_bytes of the
  // plans of those not failed; what it throws fails them all.
  std::function<void(int64_t)> all_planned;
  // Called once input i is preprocessed or has failed, whatever happened (exactly once each), with
  // what it became (its patches, or its error).
  std::function<void(size_t, const PreparedInput&)> done;
  // A clip's opening and decoding stop here (its limits' deadline_seconds still applies): one
  // absolute time for the whole clip.
  std::optional<Clock::time_point> deadline;
  // Once an input fails, the inputs not yet decoded are not decoded: they come back with neither
  // patches nor an error of their own (serve: one failure fails the request).
  bool all_or_nothing = false;
};

// Inputs read and planned exactly as prepare_inputs' first step does (in parallel; a clip opened,
// hooks.opening and hooks.planned called as there, the clip closed again), none decoded: what a reply
// needs of an input found in a cache (its grid, a clip's sampling) costs what probing it costs, and
// a caller's budget sees it through the same hooks. Each input's plan, or its error.
struct PlannedInput {
  InputKind kind = InputKind::IMAGE;
  InputPlan plan;
  std::exception_ptr error;
};
std::vector<PlannedInput> plan_inputs(const std::vector<std::string>& names,
                                      const std::function<std::vector<uint8_t>(size_t)>& bytes, const InputConfig& cfg,
                                      const PrepareHooks& hooks);

// The bytes an input's patches hold.
int64_t patch_bytes(const image::Patches& p);

// Inputs 0..n-1, input i named names[i] in messages: bytes(i) gives its encoded bytes (called once,
// on a worker thread; what it throws is that input's error). Every input is read, its kind taken and
// planned from its header first, in parallel (a clip is opened once, video::open_clip, and decoded
// later from what that kept); then the images decode and preprocess in parallel
// (fovea::parallel_for), then the clips one after another (each on the caller's share of the cores,
// ThreadCap). One input's failure never stops the others (unless all_or_nothing).
std::vector<PreparedInput> prepare_inputs(const std::vector<std::string>& names,
                                          const std::function<std::vector<uint8_t>(size_t)>& bytes,
                                          const InputConfig& cfg, const PrepareHooks& hooks = {});
// Inputs already in memory as pixels (synthetic images and frames, golden files' decoded frames).
PreparedInput prepare_image(const image::Rgb8& img, const InputConfig& cfg);
PreparedInput prepare_clip(video::Clip&& clip);
// n synthetic inputs of uniform noise (vLLM's random-mm): height x width images when frames is 1,
// else clips of `frames` frames at `fps` of which only the sampled frames are made (their making is
// the clip's decode time). Prepared as prepare_inputs runs them; seeds seed, seed + 1, ...
std::vector<PreparedInput> prepare_synthetic(size_t n, int height, int width, int64_t frames, double fps, unsigned seed,
                                             const InputConfig& cfg);

// What preparing a list of inputs cost in wall time: the images run in parallel (the slowest one's
// stages), the clips one after another (theirs summed).
struct PrepareTimes {
  double decode_ms = 0, preprocess_ms = 0;
};
PrepareTimes prepare_times(const std::vector<PreparedInput>& inputs);

// ---- packing ---------------------------------------------------------------------------------------

// Forwards of at most max_tokens visual tokens, inputs in order and never split; one larger than the
// limit runs alone. take(t) adds an input of t tokens if it fits (always, into an empty forward).
class ForwardPacker {
 public:
  explicit ForwardPacker(int64_t max_tokens) : max_(max_tokens) {}
  bool take(int64_t tokens);
  int64_t tokens() const { return tokens_; }
  size_t inputs() const { return inputs_; }

 private:
  int64_t max_, tokens_ = 0;
  size_t inputs_ = 0;
};
// A list of inputs' tokens cut into forwards: [begin, end) index ranges.
std::vector<std::pair<size_t, size_t>> pack_forwards(std::span<const int64_t> tokens, int64_t max_tokens);

// ---- one varlen batch -------------------------------------------------------------------------------

struct Batch {
  std::vector<float> pixels;            // [patches, patch_dim], the inputs one after another
  std::vector<qwen3vl::GridThw> grids;  // one per input
  // Moves one input's fp32 patches to the end (p.pixels is left empty: no second copy is kept).
  void add(image::Patches&& p);
  int64_t tokens(const qwen3vl::VisionConfig& c) const;  // visual tokens of all inputs
};

// A forward's outputs, fp32: merged [tokens, out_hidden], each deepstack output the same shape.
struct EncoderOutputs {
  std::vector<float> merged;
  std::vector<std::vector<float>> deepstack;  // empty if not asked for
};

// The same as bf16 bits (little-endian uint16): what the GPU computes and what an LLM consumes. The
// GPU path copies them back as they are (no fp32 copy); the CPU forward's fp32 is rounded to nearest.
struct EncoderOutputsBf16 {
  std::vector<uint16_t> merged;
  std::vector<std::vector<uint16_t>> deepstack;
};

// bf16 rows as views (no copy), valid while what they view lives: a whole forward's outputs, or one
// input's rows of them.
struct Bf16Rows {
  std::span<const uint16_t> merged;                  // [tokens, out_hidden]
  std::vector<std::span<const uint16_t>> deepstack;  // each [tokens, out_hidden]
};
Bf16Rows rows_of(const EncoderOutputsBf16& out);

// One input's fp32 rows (the CPU forward's, as computed), owned.
struct F32Rows {
  std::vector<float> merged;
  std::vector<std::vector<float>> deepstack;
};

// Cuts a forward's outputs back into its inputs (grids as in the forward). Throws if the row counts
// do not match the grids. The bf16 cut gives views into `out`; the fp32 one consumes it.
std::vector<Bf16Rows> split_inputs(const Bf16Rows& out, const std::vector<qwen3vl::GridThw>& grids,
                                   const qwen3vl::VisionConfig& c);
std::vector<F32Rows> split_inputs(EncoderOutputs&& out, const std::vector<qwen3vl::GridThw>& grids,
                                  const qwen3vl::VisionConfig& c);

// bf16 bits widened to fp32, exactly, on every core.
std::vector<float> widen_bf16(std::span<const uint16_t> v);

// ---- the encoder forward ----------------------------------------------------------------------------

class EncoderRunner {
 public:
  static constexpr size_t kInFlight = 2;  // batches started and not finished, at most (see start())
  // FP8 engines get the scale book make_scale_book() gives (dynamic, static or calibrating); the
  // runner advances calibration after every finished forward, CPU or GPU.
  EncoderRunner(const qwen3vl::Model& m, const EngineConfig& cfg);
  ~EncoderRunner();
  // GPU: sizes the device buffers for batches of up to `visual_tokens` once, and the pinned staging
  // of the next `batches` of them (their outputs with deepstack if asked for), so later batches of
  // any shape within it allocate nothing (a larger one still runs, growing them). No-op on the CPU.
  void reserve(int64_t visual_tokens, bool with_deepstack = false, int batches = int(kInFlight));

  // Pipelined use (serve, encode): start() packs the inputs' pixels straight into pinned memory
  // (raw uint8 patches as they are, normalized on the GPU; fp32 ones rounded to bf16; in a batch
  // that mixes them the raw ones are normalized on the host, bit for bit as the GPU would) and
  // enqueues the plan, upload, forward and the outputs' copy back, without waiting for the GPU;
  // finish() waits for the oldest started batch and gives its outputs. Up to kInFlight batches may
  // be started and not finished, so the host prepares batch n+1 (and unpacks n-1) while the GPU runs
  // batch n. On the CPU, start() runs the whole forward.
  void start(const std::vector<const image::Patches*>& inputs, bool with_deepstack);
  void start(const Batch& batch, bool with_deepstack);
  void finish(EncoderOutputsBf16& out);  // throws if nothing is in flight
  // finish() without the copy: views of the outputs where they landed (the GPU's pinned staging; on
  // the CPU, the runner's own rounded copy), valid until the next start().
  Bf16Rows finish_views();
  size_t in_flight() const;

  // start() + finish(). with_deepstack = false leaves `deepstack` empty (on the GPU they are then
  // not copied back). run() gives fp32: the GPU's bf16 widened, the CPU's fp32 as computed.
  EncoderOutputs run(const Batch& batch, bool with_deepstack = true);
  EncoderOutputs run(const std::vector<const image::Patches*>& inputs, bool with_deepstack = true);
  EncoderOutputsBf16 run_bf16(const Batch& batch, bool with_deepstack = true);
  // The same into `out`, whose vectors are reused where large enough (warm memory, no page faults).
  void run_bf16(const Batch& batch, bool with_deepstack, EncoderOutputsBf16& out);
  // From now on, each CPU forward keeps every intermediate (ForwardResult::intermediates) and, when
  // it finishes, moves them into `*into` (`fovea encode --dump-dir`); nullptr stops. CPU engines only.
  void keep_intermediates(std::map<std::string, std::vector<float>>* into);
  ScaleBook* book() { return book_ ? &*book_ : nullptr; }  // null for BF16

  // Where the last finished batch spent its time, ms: `plan` (host: the batch shape), `upload`
  // (host: pixels packed into pinned bf16; plus the GPU's copy), `forward` (GPU), `download` (the
  // GPU's copy back; plus host: unpacking into the output vectors), and `gpu`, the GPU's time from
  // the upload's start to the copy back's end (what "GPU busy" sums). On the CPU all of it is
  // `forward` and `gpu`.
  struct Timings {
    double plan = 0, upload = 0, forward = 0, download = 0, gpu = 0;
  };
  const Timings& last_timings() const { return timings_; }
  // Non-finite amax values the scale book has ignored so far, all layers, as of the last finished
  // batch (0 for BF16 and static scales). No synchronization: the rings come back with the outputs.
  uint64_t nonfinite_amax() const;
  // Static FP8 scales: how many times the guard switched a layer's Q, K or V to the batch's own scale
  // (the inputs passed the file's range; docs/fp8.md §Static guard), all layers, as of the last
  // finished batch (zero otherwise).
  GuardCounts static_guarded() const;
  // FP8: what each layer's attention quantizes with (empty for BF16).
  const Fp8Plan& fp8_plan() const { return plan_; }
  // Encoder CUDA graphs (EngineConfig::graphs, captured when the runner is built): all zero without.
  qwen3vl::GraphCounts graph_counts() const;

 private:
  struct Gpu;
  struct Flight;
  void start_cpu(const Batch& batch, bool with_deepstack);
  void capture_graphs();  // GPU with EngineConfig::graphs: once, at reserve() or the first start()
  bool graphs_captured_ = false;
  void calibrate();  // after every finished forward: a calibrating scale book writes its file after the 16th
  // Pops the oldest batch, waits for it, times it and advances calibration: `cpu` takes the CPU
  // forward's result (and whether deepstack was asked for), `gpu` collects the GPU download's ticket.
  void finish_oldest(const std::function<void(qwen3vl::ForwardResult&, bool)>& cpu,
                     const std::function<void(int64_t)>& gpu);
  // pack(dst) writes the batch's pixels into dst: raw uint8 samples, or bf16.
  void start_gpu(const std::vector<qwen3vl::GridThw>& grids, bool with_deepstack, bool raw,
                 const std::function<void(void*)>& pack, const image::Patches::Normalization* norm);
  const qwen3vl::Model& model_;
  EngineConfig cfg_;
  std::optional<ScaleBook> book_;
  Fp8Plan plan_;  // FP8: what each layer quantizes with
  std::unique_ptr<Gpu> gpu_;
  std::deque<std::unique_ptr<Flight>> flights_;
  EncoderOutputsBf16 cpu_views_;                                        // what finish_views() points into on the CPU
  std::map<std::string, std::vector<float>>* intermediates_ = nullptr;  // keep_intermediates()
  Timings timings_;
};

// ---- outputs ----------------------------------------------------------------------------------------

// The tensors of `encode -o` and of serve's safetensors replies, input by input: "<kind>.<j>.embeddings"
// [tokens, out_hidden], "<kind>.<j>.deepstack.<k>", "<kind>.<j>.grid_thw" [3] (F32), and for a clip
// "<kind>.<j>.timestamps" (F32) with its fps and frame indices in the metadata; j counts the inputs
// of each kind in order. bf16 rows are written as views (they must outlive the write) or widened to
// F32 (kept here); fp32 rows are moved in.
class OutputTensors {
 public:
  explicit OutputTensors(const qwen3vl::VisionConfig& c) : c_(c) {}
  // Adds one input's tensors; returns its prefix ("image.0", "video.1") for the caller's metadata.
  std::string add(InputKind kind, const qwen3vl::GridThw& g, const Bf16Rows& rows, bool widen = false,
                  const std::optional<ClipSampling>& clip = {});
  std::string add(InputKind kind, const qwen3vl::GridThw& g, F32Rows&& rows,
                  const std::optional<ClipSampling>& clip = {});
  const std::vector<TensorToWrite>& tensors() const { return tensors_; }
  size_t bytes() const;                     // of the tensors' data
  std::map<std::string, std::string> meta;  // the file's metadata (clip extras are added here)

 private:
  std::string prefix(InputKind kind, const std::optional<ClipSampling>& clip);  // "<kind>.<j>", clip metadata added
  void add_grid_and_times(const std::string& p, const qwen3vl::GridThw& g, const std::optional<ClipSampling>& clip);
  const qwen3vl::VisionConfig& c_;
  std::vector<TensorToWrite> tensors_;
  size_t count_[2] = {0, 0};              // inputs added, by kind
  std::deque<std::vector<float>> owned_;  // widened rows and timestamps, alive until the write
};

}  // namespace fovea
