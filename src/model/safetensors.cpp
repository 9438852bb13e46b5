// Safetensors checkpoints: memory-mapped reading with every offset validated before any tensor byte
// is touched, sharded checkpoints through model.safetensors.index.json, and an atomic writer.
// Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
// then the data; offsets are relative to the first byte after the header.
#include "fovea/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fovea/bf16.h"
#include "fovea/checked.h"
#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/json.h"

namespace fovea {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Limits (documented in safetensors.h). A real vision checkpoint's header is ~100 KB with ~600
// tensors; an 8B model's whole-LM shard ~50k tensors at most.
constexpr uint64_t kMaxHeader = 100'000'000;  // the safetensors reference rejects larger headers too
constexpr size_t kMaxTensorsPerFile = size_t(1) << 18;
constexpr size_t kMaxRank = 16;
constexpr size_t kMaxIndexBytes = size_t(64) << 20;
constexpr size_t kMaxIndexTensors = size_t(1) << 18;
constexpr size_t kMaxShards = 4096;
constexpr size_t kMaxShardName = 255;  // one path component (NAME_MAX)

JsonLimits header_limits() {
  JsonLimits l;
  l.max_bytes = size_t(kMaxHeader);
  l.max_depth = 4;                                               // {name: {"shape": [..]}} is depth 3
  l.max_object_keys = kMaxTensorsPerFile + 1;                    // the tensors and __metadata__
  l.max_elements = 8 * (kMaxTensorsPerFile + 1) + 4 * kMaxRank;  // entry, dtype, shape, offsets pair
  l.max_string_bytes = size_t(1) << 20;                          // __metadata__ values may hold a small JSON document
  return l;
}

JsonLimits index_limits() {
  JsonLimits l;
  l.max_bytes = kMaxIndexBytes;
  l.max_depth = 8;
  l.max_object_keys = kMaxIndexTensors;
  l.max_elements = kMaxIndexTensors + 4096;  // the weight_map, plus metadata
  l.max_string_bytes = 4096;
  return l;
}

size_t elem_size(DType d) { return dtype_size(d); }

// Exact f16 -> f32: every f16 value (subnormals included) is representable in f32.
float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (man << 13));  // inf, NaN (payload kept)
  if (exp == 0) {                                                        // zero or subnormal: man * 2^-24
    const float v = std::ldexp(float(man), -24);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 127 - 15) << 23) | (man << 13));
}

std::string shape_str(const std::vector<int64_t>& shape) { return json(shape).dump(); }

// Product of the dims (each >= 0), or -1 when it overflows int64 (then no file can hold it anyway).
int64_t numel_or_overflow(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n)) return -1;
  return n;
}

// A JSON integer as int64 (unsigned values above INT64_MAX are reported as not fitting).
bool json_int(const json& j, int64_t& out) {
  if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) return false;
    out = int64_t(u);
    return true;
  }
  if (!j.is_number_integer()) return false;
  out = j.get<int64_t>();
  return true;
}

// Bits per element of every dtype the safetensors format defines (0: not one of them).
int format_dtype_bits(const std::string& s) {
  static const std::map<std::string, int> bits = {
      {"BOOL", 8}, {"U8", 8},   {"I8", 8},    {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"I16", 16},
      {"U16", 16}, {"F16", 16}, {"BF16", 16}, {"I32", 32},    {"U32", 32},    {"F32", 32},    {"F64", 64},
      {"I64", 64}, {"U64", 64}, {"C64", 64},  {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6}};
  const auto it = bits.find(s);
  return it == bits.end() ? 0 : it->second;
}

std::optional<DType> reader_dtype(const std::string& s) {
  if (s == "BF16") return DType::BF16;
  if (s == "F16") return DType::F16;
  if (s == "F32") return DType::F32;
  if (s == "F8_E4M3") return DType::F8_E4M3;
  return std::nullopt;
}

}  // namespace

const char* dtype_str(DType d) {
  switch (d) {
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::F32: return "F32";
    case DType::F8_E4M3: return "F8_E4M3";
  }
  return "?";
}

size_t dtype_size(DType d) {
  switch (d) {
    case DType::F32: return 4;
    case DType::BF16:
    case DType::F16: return 2;
    case DType::F8_E4M3: return 1;
  }
  return 4;
}

int64_t TensorInfo::numel() const { return checked_numel(shape, "tensor size"); }

std::vector<float> TensorInfo::to_float() const {
  if (dtype == DType::F8_E4M3)
    fail("tensor '{}' in '{}' is F8_E4M3: its values need its scale (weight_scale_inv or weight_scale)",
         escape_for_error(name, 200), file);
  const size_t n = size_t(numel());
  FOVEA_CHECK(n * elem_size(dtype) == bytes, "tensor '", name, "' in '", file, "': ", bytes,
              " bytes do not match its shape");
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {  // memcpy: the data need not be aligned inside the file
    if (dtype == DType::F32) {
      memcpy(&out[i], data + 4 * i, 4);
    } else {
      uint16_t h;
      memcpy(&h, data + 2 * i, 2);
      out[i] = dtype == DType::BF16 ? bf16_to_float(h) : f16_to_float(h);
    }
  }
  return out;
}

namespace {

// One validated header entry: its dtype (as the format spells it), shape and [begin, end) in the data.
struct Entry {
  std::string dtype;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;
};

std::vector<int64_t> entry_shape(const json& e, const std::string& path, const std::string& shown) {
  auto bad = [&](const char* what) { fail("safetensors file '{}': tensor '{}': {}", path, shown, what); };
  if (!e["shape"].is_array()) bad("shape is not an array of integers");
  if (e["shape"].size() > kMaxRank)
    fail("safetensors file '{}': tensor '{}': shape has {} dimensions, more than the limit of {}", path, shown,
         e["shape"].size(), kMaxRank);
  std::vector<int64_t> shape;
  for (const json& d : e["shape"]) {
    int64_t v = 0;
    if (!json_int(d, v)) bad("shape is not an array of integers");
    if (v < 0)
      fail("safetensors file '{}': tensor '{}': negative dimension in shape {}", path, shown, e["shape"].dump());
    shape.push_back(v);
  }
  return shape;
}

// Validates one entry; `kept` says whether its dtype must be one fovea reads (DType) or only one the
// format defines. `header_end` is 8 + the header length, for messages.
Entry parse_entry(const std::string& shown, const json& e, const std::string& path, uint64_t data_size,
                  uint64_t header_end, bool kept) {
  auto bad = [&](const char* what) { fail("safetensors file '{}': tensor '{}': {}", path, shown, what); };
  if (!e.is_object()) bad("entry is not a JSON object");
  if (!e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
    bad("entry lacks one of dtype, shape, data_offsets");
  if (!e["dtype"].is_string()) bad("dtype is not a string");
  Entry out;
  out.dtype = escape_for_error(e["dtype"].get<std::string>(), 32);
  const int bits = format_dtype_bits(out.dtype);
  if (kept ? !reader_dtype(out.dtype) : bits == 0)
    fail(
        "safetensors file '{}': tensor '{}': dtype {} is not supported: vision checkpoints hold BF16, F16, F32 or "
        "F8_E4M3 (with its scale)",
        path, shown, out.dtype);
  out.shape = entry_shape(e, path, shown);
  const json& off = e["data_offsets"];
  int64_t& begin = out.begin;
  int64_t& end = out.end;
  if (!off.is_array() || off.size() != 2 || !json_int(off[0], begin) || !json_int(off[1], end) || begin < 0)
    bad("data_offsets is not [begin, end] of two non-negative integers");
  if (end < begin)
    fail("safetensors file '{}': tensor '{}': data_offsets [{}, {}] end before begin", path, shown, begin, end);
  const int64_t numel = numel_or_overflow(out.shape);
  // Bytes = numel x bits / 8, whole bytes only (the packed 4- and 6-bit dtypes), without overflow.
  const bool too_big = numel < 0 || numel > std::numeric_limits<int64_t>::max() / bits;
  const bool whole = !too_big && (numel * bits) % 8 == 0;
  if (too_big || !whole || end - begin != numel * bits / 8)
    fail("safetensors file '{}': tensor '{}': data_offsets [{}, {}] span {} bytes, but shape {} of {} needs {}", path,
         shown, begin, end, end - begin, shape_str(out.shape), out.dtype,
         too_big ? std::string("more than 2^63")
         : whole ? std::to_string(numel * bits / 8)
                 : std::string("part of a byte"));
  if (uint64_t(end) > data_size)
    fail("safetensors file '{}': truncated: tensor '{}' needs bytes up to {}, the file has {}", path, shown,
         header_end + uint64_t(end), header_end + data_size);
  return out;
}

}  // namespace

std::vector<TensorInfo> parse_safetensors(const uint8_t* bytes, size_t size, const std::string& path,
                                          const TensorFilter& keep, std::vector<std::string>* skipped) {
  if (size < 8)
    fail("safetensors file '{}': only {} bytes, shorter than the 8-byte header length: not a safetensors file", path,
         size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];  // little-endian regardless of host
  if (n > kMaxHeader)
    fail("safetensors file '{}': header length {} is absurd (over {} bytes): corrupt or not a safetensors file", path,
         n, kMaxHeader);
  if (8 + n > size)
    fail("safetensors file '{}': truncated: the header needs bytes up to {}, the file has {}", path, 8 + n, size);
  const std::string_view text(reinterpret_cast<const char*>(bytes + 8), size_t(n));
  const json header = parse_json_bounded(text, header_limits(), fmt::format("safetensors file '{}': header", path));
  if (!header.is_object()) fail("safetensors file '{}': header is not a JSON object", path);

  const uint8_t* data = bytes + 8 + n;
  const uint64_t data_size = size - 8 - n;
  std::vector<TensorInfo> tensors;
  struct Span {
    uint64_t begin, end;
    std::string_view name;  // a key of `header`
  };
  std::vector<Span> spans;
  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") {  // optional string -> string map; fovea does not use it
      if (!e.is_object()) fail("safetensors file '{}': __metadata__ is not a JSON object", path);
      continue;
    }
    const bool kept = !keep || keep(name);
    Entry en = parse_entry(escape_for_error(name, 200), e, path, data_size, 8 + n, kept);
    spans.push_back({uint64_t(en.begin), uint64_t(en.end), name});
    if (!kept) {
      if (skipped) skipped->push_back(name);
      continue;
    }
    tensors.push_back(TensorInfo{name, *reader_dtype(en.dtype), std::move(en.shape), data + en.begin,
                                 size_t(en.end - en.begin), path});
  }
  // No two tensors share a byte: sorted by begin, each non-empty span starts at or after the end of
  // every span before it (an aliasing header would let writes through one tensor change another,
  // and is what a crafted file uses to pass a size check with less data).
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  const Span* last = nullptr;  // the non-empty span reaching furthest so far
  for (const Span& sp : spans) {
    if (sp.begin == sp.end) continue;
    if (last && sp.begin < last->end)
      fail("safetensors file '{}': tensors '{}' [{}, {}] and '{}' [{}, {}] overlap in the data", path,
           escape_for_error(std::string(last->name), 200), last->begin, last->end,
           escape_for_error(std::string(sp.name), 200), sp.begin, sp.end);
    if (!last || sp.end > last->end) last = &sp;
  }
  return tensors;
}

// One read-only mapping of a safetensors file, with its validated tensor table.
class SafetensorsFile {
 public:
  std::string path;
  std::vector<TensorInfo> tensors;
  std::vector<std::string> skipped;  // the names `keep` turned away

  SafetensorsFile(const std::string& p, const TensorFilter& keep) : path(p) {
    // Regular files only, opened without blocking (a FIFO named as a shard fails here at once).
    struct stat st {};
    Fd fd = open_regular_file(p, "safetensors file", &st);
    size_ = size_t(st.st_size);
    if (size_ < 8) {  // mmap of an empty file fails, and there is no header length to read anyway
      fail("safetensors file '{}': only {} bytes, shorter than the 8-byte header length: not a safetensors file", p,
           size_);
    }
    void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    const int err = errno;
    fd = Fd();  // the mapping keeps the file alive
    if (m == MAP_FAILED) fail("safetensors file '{}': cannot map {} bytes: {}", p, size_, std::strerror(err));
    base_ = static_cast<const uint8_t*>(m);
    try {
      tensors = parse_safetensors(base_, size_, path, keep, &skipped);
    } catch (...) {
      ::munmap(const_cast<uint8_t*>(base_), size_);
      throw;
    }
  }
  ~SafetensorsFile() { ::munmap(const_cast<uint8_t*>(base_), size_); }
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

 private:
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
};

Checkpoint::~Checkpoint() = default;
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;

const TensorInfo* Checkpoint::find(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

Checkpoint Checkpoint::open(const std::string& path, const TensorFilter& keep) {
  Checkpoint ck;
  auto load = [&](const std::string& file) {
    ck.files_.push_back(std::make_unique<SafetensorsFile>(file, keep));
    auto twice = [&](const std::string& name, const std::string& first) {
      fail("checkpoint '{}': tensor '{}' is in both '{}' and '{}'", path, escape_for_error(name, 200), first, file);
    };
    for (TensorInfo& t : ck.files_.back()->tensors) {
      const auto [it, fresh] = ck.tensors_.emplace(t.name, t);
      if (!fresh) twice(t.name, it->second.file);
    }
    for (std::string& name : ck.files_.back()->skipped) {
      const auto [it, fresh] = ck.skipped_.emplace(std::move(name), file);
      if (!fresh) twice(it->first, it->second);
    }
    ck.files_.back()->skipped.clear();
  };

  std::error_code ec;
  if (!fs::exists(path, ec)) fail("checkpoint '{}': does not exist", path);
  fs::path index;
  if (fs::is_directory(path, ec)) {
    index = fs::path(path) / "model.safetensors.index.json";
    if (!fs::exists(index, ec)) {  // no index: every *.safetensors in the folder, in name order
      std::vector<std::string> files;
      for (const auto& e : fs::directory_iterator(path, ec))
        if (e.path().extension() == ".safetensors" && e.is_regular_file(ec)) files.push_back(e.path().string());
      if (ec) fail("checkpoint '{}': cannot list the folder: {}", path, ec.message());
      if (files.empty()) fail("checkpoint '{}': no *.safetensors in {}", path, path);
      std::sort(files.begin(), files.end());
      for (const auto& f : files) load(f);
      return ck;
    }
  } else if (fs::path(path).extension() == ".json") {
    index = path;
  } else {
    load(path);
    return ck;
  }

  // Sharded: the index maps tensor names to shard files beside it.
  const std::string ip = index.string();
  const std::map<std::string, std::string> wm =
      parse_checkpoint_index(read_file(ip, "checkpoint index", kMaxIndexBytes), ip);
  std::map<std::string, std::string> shard_path;  // shard name -> its path, each loaded once
  for (const auto& [name, s] : wm) {
    if (shard_path.count(s)) continue;
    const fs::path p = index.parent_path() / s;
    if (!fs::exists(p, ec))
      fail("checkpoint index '{}': shard '{}' (holding tensor '{}') is missing: {} does not exist", ip, s,
           escape_for_error(name, 200), p.string());
    shard_path[s] = p.string();
    load(p.string());
  }
  for (const auto& [name, s] : wm) {
    const std::string& want = shard_path.at(s);
    const TensorInfo* t = ck.find(name);
    const auto sk = ck.skipped_.find(name);
    const std::string* in = t ? &t->file : sk != ck.skipped_.end() ? &sk->second : nullptr;
    if (!in || *in != want)
      fail("checkpoint index '{}': tensor '{}' is listed in shard '{}' but absent from it", ip,
           escape_for_error(name, 200), s);
  }
  return ck;
}

std::map<std::string, std::string> parse_checkpoint_index(std::string_view text, const std::string& ip) {
  const json j = parse_json_bounded(text, index_limits(), fmt::format("checkpoint index '{}'", ip));
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object() || j["weight_map"].empty())
    fail("checkpoint index '{}': no \"weight_map\" object of tensor name -> shard file", ip);
  std::map<std::string, std::string> out;
  std::set<std::string> shards;
  for (const auto& [name, shard] : j["weight_map"].items()) {
    const std::string shown = escape_for_error(name, 200);
    if (!shard.is_string()) fail("checkpoint index '{}': weight_map['{}'] is not a file name", ip, shown);
    const std::string& s = shard.get_ref<const std::string&>();
    // A shard is a file beside the index: one plain path component, so an index cannot point at
    // /dev/zero, ../../secret or a folder.
    if (s.empty() || s == "." || s == ".." || s.size() > kMaxShardName || s.find('/') != std::string::npos ||
        s.find('\0') != std::string::npos)
      fail(
          "checkpoint index '{}': weight_map['{}'] = {} is not a file name beside the index (one path component, "
          "at most {} bytes)",
          ip, shown, quote_for_error(s), kMaxShardName);
    if (shards.insert(s).second && shards.size() > kMaxShards)
      fail("checkpoint index '{}': more than {} shard files (the limit)", ip, kMaxShards);
    out.emplace(name, s);
  }
  return out;
}

namespace {

// The file's head (8 bytes of header length, the JSON header, spaces up to an 8-byte boundary) for
// tensors laid out in order; `data_bytes` gets the bytes their data takes after it. With check_data,
// each tensor's data must be the size its shape and dtype say.
std::string header_of(const std::string& path, const std::vector<TensorToWrite>& tensors,
                      const std::map<std::string, std::string>& metadata, bool check_data, size_t* data_bytes) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();  // keeps the given tensor order
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || header.contains(t.name))
      fail("safetensors file '{}': tensor name '{}' is empty, reserved or repeated", path, t.name);
    const int64_t numel = numel_or_overflow(t.shape);
    if (std::any_of(t.shape.begin(), t.shape.end(), [](int64_t d) { return d < 0; }) || numel < 0 ||
        numel > std::numeric_limits<int64_t>::max() / 4)
      fail("safetensors file '{}': tensor '{}': invalid shape {}", path, t.name, shape_str(t.shape));
    const size_t want = size_t(numel) * elem_size(t.dtype);
    if (check_data && t.data().size() != want)
      fail("safetensors file '{}': tensor '{}' has {} bytes, but shape {} of {} needs {}", path, t.name,
           t.data().size(), shape_str(t.shape), dtype_str(t.dtype), want);
    header[t.name] = {{"dtype", dtype_str(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + want}}};
    offset += want;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // spaces are JSON whitespace; data starts 8-aligned
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((uint64_t(text.size()) >> (8 * i)) & 0xFF);
  out += text;
  *data_bytes = offset;
  return out;
}

}  // namespace

std::string safetensors_header(const std::string& name, const std::vector<TensorToWrite>& tensors,
                               const std::map<std::string, std::string>& metadata, size_t* data_bytes) {
  return header_of(name, tensors, metadata, false, data_bytes);
}

std::string safetensors_bytes(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  size_t data = 0;
  std::string out = header_of(path, tensors, metadata, true, &data);
  out.reserve(out.size() + data);
  for (const TensorToWrite& t : tensors) out.append(reinterpret_cast<const char*>(t.data().data()), t.data().size());
  return out;
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  write_file_atomic(path, safetensors_bytes(path, tensors, metadata), "safetensors file");
}

}  // namespace fovea
