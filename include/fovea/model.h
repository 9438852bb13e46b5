// fovea/model.h: the Qwen3-VL / Qwen3.5 vision encoder: configuration, weights (from a Hugging Face
// checkpoint or a built-in synthetic model), and the fp32 CPU reference forward that is the oracle
// for the GPU forward. Facts: docs/encoder.md (sections named below).
#pragma once
#include <array>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fovea/attention.h"
#include "fovea/attention-ref.h"
#include "fovea/fp8-plan.h"
#include "fovea/scales.h"

namespace fovea {
struct JsonLimits;  // fovea/json.h
struct TensorInfo;  // fovea/safetensors.h
}  // namespace fovea

namespace fovea::qwen3vl {

// Supported ranges of the vision config, checked at load (validate()) so a hostile or corrupt
// config.json is refused with the field, the value and the range before anything is allocated.
// The largest released Qwen3-VL encoder has depth 27, hidden 1152, intermediate 4304, 16 heads.
constexpr int kMaxDepth = 256;            // depth: 1..256 blocks
constexpr int kMaxHidden = 65536;         // hidden_size: 1..65536, divisible by num_heads
constexpr int kMaxHeads = 1024;           // num_heads: 1..1024
constexpr int kMaxHeadDim = 512;          // head_dim = hidden / heads: a multiple of 4, <= 512
constexpr int kMaxIntermediate = 262144;  // intermediate_size: 1..262144
constexpr int kMaxInChannels = 4;         // in_channels: 1..4 (images are RGB: 3)
constexpr int kMaxPatch = 64;             // patch_size: 1..64
constexpr int kMaxTemporalPatch = 4;      // temporal_patch_size: 1..4
constexpr int kMaxMerge = 8;              // spatial_merge_size: 1..8 (the forward supports 2)
constexpr int kMaxOutHidden = 65536;      // out_hidden_size: 1..65536
constexpr int kMaxPosEmbeddings = 65536;  // num_position_embeddings: 1..65536, a perfect square
                                          // deepstack_visual_indexes: increasing, within 0..depth-1

struct VisionConfig {
  std::string name;  // where it came from: a folder or "synthetic:<preset>"
  int depth = 27, hidden = 1152, intermediate = 4304, heads = 16;
  int in_channels = 3, patch = 16, temporal_patch = 2, merge = 2;
  int out_hidden = 3584, num_pos_embeddings = 2304;
  std::vector<int> deepstack;  // block indices tapped by the deepstack mergers; empty for Qwen3.5
  std::string hidden_act = "gelu_pytorch_tanh";

  int head_dim() const { return hidden / heads; }
  int patch_dim() const { return in_channels * temporal_patch * patch * patch; }  // 1536
  int merged_dim() const { return hidden * merge * merge; }                       // 4D
  int pos_side() const;                                                           // 48
  void validate() const;  // throws fovea::Error naming the field
};

// `vision_config` of a config.json (a full Qwen3-VL / Qwen3.5 config, or the vision config alone).
// The text is parsed with config_json_limits() (1 MiB, depth 16, 2^16 values, 4096 keys per object,
// strings of 64 KiB); `where` names the file in messages.
VisionConfig parse_config(std::string_view json_text, const std::string& where);
// The limits config.json and preprocessor_config.json are parsed with (fovea/json.h).
JsonLimits config_json_limits();
// Built-in presets: "synthetic:tiny", "synthetic:qwen3-vl-2b", "synthetic:qwen3-vl-8b", and
// "synthetic:qwen3-vl-8b-2blocks" / "-2b-2blocks" (cut to two blocks, both deepstack taps). Each also
// with kOutliersSuffix ("synthetic:qwen3-vl-8b-outliers"): the same weights with outlier channels as
// trained ViTs carry them in every block's qkv (add_outlier_channels, docs/fp8.md §Outlier channels).
constexpr const char* kOutliersSuffix = "-outliers";
std::optional<VisionConfig> synthetic_config(const std::string& spec);
std::vector<std::string> synthetic_names();
bool synthetic_outliers(const std::string& spec);

// `quantization_config` of a config.json (FP8 releases; docs/encoder.md §FP8 releases). fovea reads
// two layouts: transformers' / Qwen's "fp8" (fmt e4m3, `<module>.weight_scale_inv` per block of
// weight_block_size, [128, 128] by default; null: one scale per tensor) and llm-compressor's
// "compressed-tensors" (format float-quantized, 8-bit float weights, `<module>.weight_scale` per
// channel [out, 1], per tensor [1] or per block of block_structure). Anything else (another
// quant_method, fmt, format, strategy, bit width, asymmetric weights, a block size that is not two
// positive integers up to kMaxQuantBlock) is a fovea::Error naming the field.
constexpr int64_t kMaxQuantBlock = 65536;
struct QuantConfig {
  std::string where;                       // "<config.json>: quantization_config", for messages
  std::string method;                      // "" (none), "fp8" or "compressed-tensors"
  std::string scale_suffix;                // the scale of `<module>.weight`: "weight_scale_inv" or "weight_scale"
  std::array<int64_t, 2> block{};          // [rows, cols] one scale covers; 0: the whole dimension
  std::string activation_scheme;           // "dynamic" or "static": read, not used (fovea runs bf16 activations)
  std::vector<std::string> not_converted;  // modules_to_not_convert / ignore, as written
  std::string scheme() const;              // "blocks of [128, 128]", "one per output channel", "one per tensor"
};
QuantConfig parse_quantization_config(std::string_view config_json_text, const std::string& where);
// Whether `module` is listed in not_converted: an entry equal to it, a parent of it ("model.visual")
// or its tail ("lm_head"). Regular expressions ("re:..." or entries with *, [, (, ...) are not
// interpreted: they match nothing here.
bool listed_not_converted(const QuantConfig& q, const std::string& module);
// The shape `scale` must have for an FP8 weight of [out, in] under q.
std::vector<int64_t> expected_scale_shape(const QuantConfig& q, int64_t out, int64_t in);
// An FP8 linear weight as a release stores it: E4M3 codes [out, in] and fp32 scales, one per block
// of [rows, cols] (0: the whole dimension), row-major over the block grid [ceil(out / rows),
// ceil(in / cols)]. load_model keeps it beside the dequantized values for the blocks' linears, so
// --fp8-linears runs it as stored (docs/fp8.md §FP8 linears); save_model writes it back.
struct Fp8Weight {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::array<int64_t, 2> block{};
  int64_t out = 0, in = 0;
  float scale_at(int64_t row, int64_t col) const;
  // Dequantized as transformers and compressed-tensors do: each value bf16(float(e4m3) * scale), the
  // product in fp32, then rounded to nearest even; element (i, j) takes the scale of block
  // (i / rows, j / cols), partial blocks at the edges included. fp32 holding those bf16 values.
  std::vector<float> dequantized() const;
};
// An F8_E4M3 linear weight [out, in] and its scale (F32 or BF16; finite, positive, of
// expected_scale_shape) read and checked: no NaN code, every value dequantizing to a finite bf16.
// Errors name the tensor and the field.
Fp8Weight read_fp8_weight(const TensorInfo& weight, const TensorInfo& scale, const QuantConfig& q);
// `w` [out, in] quantized with one amax / 448 scale per block (a release's own recipe; edge blocks
// partial, an all-zero block's scale 1): block {128, 128} is transformers' "fp8", {1, 0} one scale
// per output channel (llm-compressor's FP8_DYNAMIC), {0, 0} one per tensor.
Fp8Weight quantize_fp8_weight(const std::vector<float>& w, int64_t out, int64_t in, std::array<int64_t, 2> block);

// Every tensor the encoder needs, relative to the vision prefix, with its shape (docs/encoder.md §Checkpoints).
std::vector<std::pair<std::string, std::vector<int64_t>>> expected_tensors(const VisionConfig& c);

// fp32 weights for the CPU forward (PyTorch layouts: Linear [out, in]).
struct Linear {
  std::vector<float> w, b;
  int out = 0, in = 0;
  std::optional<Fp8Weight> fp8;  // the blocks' linears of an FP8 release: w as stored (w holds its values)
};
struct Norm {
  std::vector<float> w, b;
};
struct Block {
  Norm norm1, norm2;
  Linear qkv, proj, fc1, fc2;
};
struct Merger {
  Norm norm;
  Linear fc1, fc2;
};
// A block's four linears with their checkpoint names under the vision prefix ("blocks.3.attn.qkv").
std::array<std::pair<std::string, Linear*>, 4> block_linears(Block& b, size_t index);
std::array<std::pair<std::string, const Linear*>, 4> block_linears(const Block& b, size_t index);
struct Weights {
  Linear patch_embed;      // [D, 1536]
  std::vector<float> pos;  // [num_pos_embeddings, D]
  std::vector<Block> blocks;
  Merger merger;
  std::vector<Merger> deepstack;
};

struct Model {
  VisionConfig config;
  Weights weights;
};

// MODEL is a checkpoint folder (config.json + safetensors, sharded or not; keys under
// "model.visual." or "visual.") or a synthetic preset. Errors name the problem: missing tensors
// (listed), shape mismatches (expected vs found), truncated or corrupt files; unexpected tensors
// under the vision prefix are a warning. Tensors outside the vision tower (an FP8 release's language
// model) are skipped by name, their headers validated; FP8 vision weights are dequantized to bf16
// values (Fp8Weight::dequantized), and every quantization error names the tensor and the field.
Model load_model(const std::string& spec);

// Writes a model as a Hugging Face-style checkpoint folder that load_model() (and transformers'
// Qwen3VLVisionModel, through safetensors) reads back: config.json with the vision_config and
// model.safetensors with bf16 tensors under "model.visual.". The folder must exist; both files are
// written atomically.
// Linears stored in FP8 (Linear::fp8) are written as stored, with the quantization_config of their
// layout: blocks as transformers' "fp8" (`weight_scale_inv`, F32), per channel or per tensor as
// llm-compressor's "compressed-tensors" (`weight_scale`, F32); the mergers listed as not converted.
void save_model(const Model& m, const std::string& folder);
// Stores every block's four linears in FP8 as a release does (quantize_fp8_weight with `block`; their
// values become the dequantized ones, what transformers computes from such a file).
void quantize_block_linears(Model& m, std::array<int64_t, 2> block);

using GridThw = std::array<int, 3>;  // (t, h, w) in 16-px patch units, h and w even

struct ForwardOptions {
  cpu::RefMode attention = cpu::RefMode::EXACT;  // EXACT (fp64), BF16 or FP8 emulation
  ScaleBook* scales = nullptr;                   // FP8: one layer per block; dynamic, static or calibrating
                                                 // (the caller calls after_forward(): EncoderRunner does)
  bool keep_intermediates = false;
  int threads = 0;
  // The blocks' qkv, proj, fc1 and fc2 in FP8 (docs/fp8.md §FP8 linears): the emulation of what the
  // GPU encoder runs with EncoderOptions::fp8_linears.
  bool fp8_linears = false;
  // FP8: what each layer quantizes with (fovea/fp8-plan.h; the book's mode and layers must match it);
  // null: every layer per tensor, as the book's mode says.
  const Fp8Plan* fp8_plan = nullptr;
};

// x [rows, in] @ W^T + b as the FP8 linears compute it (docs/fp8.md §FP8 linears): each row of x and
// each output channel of W (rounded to bf16 first, the model's dtype) quantized to E4M3 with its
// own amax / 448 scale, the exact products summed in fp32, then both scales and the bias applied.
// A weight stored in FP8 (l.fp8) is used as stored, never re-quantized: one scale per channel or per
// tensor as the per-channel form; in blocks of [128, 128] each block's partial sum (exact products in
// fp32) scaled by its weight scale times the row's, as cuBLASLt's block-scaled product on sm_90 does.
// Other block sizes are a fovea::Error naming the linear (fp8_linear_form).
std::vector<float> linear_fp8(const Linear& l, const std::vector<float>& x, int64_t rows, int threads = 0);
// How the FP8 linears run l: its weight re-quantized per channel (no stored FP8), stored per channel
// (or per tensor, broadcast), or stored in blocks of [128, 128]. `name` is for the error.
enum class Fp8LinearForm { REQUANTIZED, STORED_CHANNELS, STORED_BLOCKS };
Fp8LinearForm fp8_linear_form(const Linear& l, const std::string& name);
// fp8_linear_form of every block's linears: the error names the first the FP8 linears cannot run.
void check_fp8_linears(const Weights& w);
// W's FP8 per-channel form as the GPU holds it: E4M3 codes [out, in] and the per-channel scales
// [out]: quantized from w (REQUANTIZED) or the stored codes and scales (STORED_CHANNELS).
void quantize_weight_rows(const Linear& l, std::vector<uint8_t>& codes, std::vector<float>& scales, int threads = 0);

struct ForwardResult {
  std::vector<float> merged;                  // [N/4, out_hidden]
  std::vector<std::vector<float>> deepstack;  // each [N/4, out_hidden]
  // With keep_intermediates, named as transformers' modules whose outputs they are: "patch_embed"
  // [N, D] (before the position embedding), "embed" (after it), for each block l "blocks.<l>.attn"
  // and "blocks.<l>.mlp" (each before its residual add) and "blocks.<l>" (its output), "merger" and
  // "deepstack_merger_list.<k>" [N/4, out_hidden]; and the input, "pixel_values" [N, patch_dim].
  std::map<std::string, std::vector<float>> intermediates;
};

// The fp32 CPU reference forward (docs/encoder.md §CPU forward). pixels: [N, 1536] in merge-window order
// (docs/encoder.md §Merge-window order).
ForwardResult forward_cpu(const Model& m, const std::vector<float>& pixels, const std::vector<GridThw>& grids,
                          const ForwardOptions& opt = {});

// How far encoder outputs [rows, width] are from a reference: relative L2 over everything and the
// mean over rows of the per-token cosine similarity. A non-finite value makes both NaN.
struct EmbeddingError {
  double rel_l2 = 0, mean_cosine = 0;
};
EmbeddingError embedding_error(const std::vector<float>& out, const std::vector<float>& ref, int width);

// ---- grid tables (src/model/qwen3vl/grid.cpp), shared by both forwards ----
// The packed batch a set of grids makes: N patches, one attention segment of h*w per frame. Throws,
// naming `what`, unless every grid has t >= 1 and even h, w >= 2, or if a product overflows.
struct GridShape {
  int64_t patches = 0;
  std::vector<int> seqlens;
};
GridShape check_grids(const std::vector<GridThw>& grids, const std::string& what);
// Per-token (row, col) patch positions in merge-window order, repeated per frame, and the vision
// RoPE tables [N, hd/2] built from them (fp32, as transformers computes them; docs/encoder.md, RoPE).
std::vector<std::array<int, 2>> patch_positions(const std::vector<GridThw>& grids);
// The learned position table resampled bilinearly to each grid, merge-window order, repeated per
// frame: [N, hidden] (docs/encoder.md §Position embedding).
std::vector<float> position_embedding(const VisionConfig& c, const std::vector<float>& table,
                                      const std::vector<GridThw>& grids);
// cos / sin of position p times each of the hd/4 RoPE frequencies, [positions][hd/4]: every value
// vision_rope_tables writes is one of these (the GPU encoder gathers from them).
void rope_frequency_table(int positions, int head_dim, std::vector<float>& cos, std::vector<float>& sin);
void vision_rope_tables(const std::vector<GridThw>& grids, int head_dim, std::vector<float>& cos,
                        std::vector<float>& sin);

}  // namespace fovea::qwen3vl
