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

#include <nlohmann/json.hpp>

#include "fovea/bf16.h"
#include "fovea/error.h"
#include "fovea/io.h"

namespace fovea {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr uint64_t kMaxHeader = 100'000'000;  // the safetensors reference rejects larger headers too

size_t elem_size(DType d) { return d == DType::F32 ? 4 : 2; }

// Exact f16 -> f32: every f16 value (subnormals included) is representable in f32.
float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (man << 13));  // inf, NaN (payload kept)
  if (exp == 0) {                                                       // zero or subnormal: man * 2^-24
    const float v = std::ldexp(float(man), -24);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 127 - 15) << 23) | (man << 13));
}

std::string shape_str(const std::vector<int64_t>& shape) { return json(shape).dump(); }

// Product of the dims, or -1 when it overflows int64 (then no file can hold it anyway).
int64_t checked_numel(const std::vector<int64_t>& shape) {
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

DType parse_dtype(const std::string& s, const std::string& file, const std::string& name) {
  if (s == "BF16") return DType::BF16;
  if (s == "F16") return DType::F16;
  if (s == "F32") return DType::F32;
  fail("safetensors file '{}': tensor '{}': dtype {} is not supported: vision checkpoints hold BF16, F16 or F32",
       file, name, s);
}

}  // namespace

const char* dtype_str(DType d) {
  switch (d) {
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::F32: return "F32";
  }
  return "?";
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<float> TensorInfo::to_float() const {
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

// One read-only mapping of a safetensors file, with its validated tensor table.
class SafetensorsFile {
 public:
  std::string path;
  std::vector<TensorInfo> tensors;

  explicit SafetensorsFile(const std::string& p) : path(p) {
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("safetensors file '{}': cannot open: {}", p, std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      fail("safetensors file '{}': not a regular file", p);
    }
    size_ = size_t(st.st_size);
    if (size_ < 8) {  // mmap of an empty file fails, and there is no header length to read anyway
      ::close(fd);
      fail("safetensors file '{}': only {} bytes, shorter than the 8-byte header length: not a safetensors file",
           p, size_);
    }
    void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);  // the mapping keeps the file alive
    if (m == MAP_FAILED) fail("safetensors file '{}': cannot map {} bytes: {}", p, size_, std::strerror(err));
    base_ = static_cast<const uint8_t*>(m);
    try {
      parse();
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

  void parse() {
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | base_[i];  // little-endian regardless of host
    if (n > kMaxHeader)
      fail("safetensors file '{}': header length {} is absurd (over {} bytes): corrupt or not a safetensors file",
           path, n, kMaxHeader);
    if (8 + n > size_)
      fail("safetensors file '{}': truncated: the header needs bytes up to {}, the file has {}", path, 8 + n, size_);
    const char* text = reinterpret_cast<const char*>(base_ + 8);
    json header;
    try {
      header = json::parse(text, text + n);
    } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e999
      fail("safetensors file '{}': header is not valid JSON: {}", path, e.what());
    }
    if (!header.is_object()) fail("safetensors file '{}': header is not a JSON object", path);

    const uint8_t* data = base_ + 8 + n;
    const uint64_t data_size = size_ - 8 - n;
    for (const auto& [name, e] : header.items()) {
      if (name == "__metadata__") {  // optional string -> string map; fovea does not use it
        if (!e.is_object()) fail("safetensors file '{}': __metadata__ is not a JSON object", path);
        continue;
      }
      auto bad = [&](const char* what) { fail("safetensors file '{}': tensor '{}': {}", path, name, what); };
      if (!e.is_object()) bad("entry is not a JSON object");
      if (!e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
        bad("entry lacks one of dtype, shape, data_offsets");
      if (!e["dtype"].is_string()) bad("dtype is not a string");
      const DType dtype = parse_dtype(e["dtype"].get<std::string>(), path, name);

      if (!e["shape"].is_array()) bad("shape is not an array of integers");
      std::vector<int64_t> shape;
      for (const json& d : e["shape"]) {
        int64_t v = 0;
        if (!json_int(d, v)) bad("shape is not an array of integers");
        if (v < 0) fail("safetensors file '{}': tensor '{}': negative dimension in shape {}", path, name, e["shape"].dump());
        shape.push_back(v);
      }

      const json& off = e["data_offsets"];
      int64_t begin = 0, end = 0;
      if (!off.is_array() || off.size() != 2 || !json_int(off[0], begin) || !json_int(off[1], end) || begin < 0)
        bad("data_offsets is not [begin, end] of two non-negative integers");
      if (end < begin)
        fail("safetensors file '{}': tensor '{}': data_offsets [{}, {}] end before begin", path, name, begin, end);
      const int64_t numel = checked_numel(shape);
      const int64_t elsz = int64_t(elem_size(dtype));
      if (numel < 0 || numel > std::numeric_limits<int64_t>::max() / elsz || end - begin != numel * elsz)
        fail("safetensors file '{}': tensor '{}': data_offsets [{}, {}] span {} bytes, but shape {} of {} needs {}",
             path, name, begin, end, end - begin, shape_str(shape), dtype_str(dtype),
             numel < 0 ? std::string("more than 2^63") : std::to_string(numel * elsz));
      if (uint64_t(end) > data_size)
        fail("safetensors file '{}': truncated: tensor '{}' needs bytes up to {}, the file has {}", path, name,
             8 + n + uint64_t(end), size_);
      tensors.push_back(TensorInfo{name, dtype, std::move(shape), data + begin, size_t(end - begin), path});
    }
  }
};

Checkpoint::~Checkpoint() = default;
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;

const TensorInfo* Checkpoint::find(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

Checkpoint Checkpoint::open(const std::string& path) {
  Checkpoint ck;
  auto load = [&](const std::string& file) {
    ck.files_.push_back(std::make_unique<SafetensorsFile>(file));
    for (TensorInfo& t : ck.files_.back()->tensors) {
      const auto [it, fresh] = ck.tensors_.emplace(t.name, t);
      if (!fresh) fail("checkpoint '{}': tensor '{}' is in both '{}' and '{}'", path, t.name, it->second.file, file);
    }
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
  json j;
  try {
    j = json::parse(read_file(ip, "checkpoint index"));
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e999
    fail("checkpoint index '{}': not valid JSON: {}", ip, e.what());
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object() || j["weight_map"].empty())
    fail("checkpoint index '{}': no \"weight_map\" object of tensor name -> shard file", ip);
  const json& wm = j["weight_map"];
  std::map<std::string, std::string> shard_path;  // shard name -> its path, each loaded once
  for (const auto& [name, shard] : wm.items()) {
    if (!shard.is_string()) fail("checkpoint index '{}': weight_map['{}'] is not a file name", ip, name);
    const std::string s = shard.get<std::string>();
    if (shard_path.count(s)) continue;
    const fs::path p = index.parent_path() / s;
    if (!fs::exists(p, ec))
      fail("checkpoint index '{}': shard '{}' (holding tensor '{}') is missing: {} does not exist", ip, s, name,
           p.string());
    shard_path[s] = p.string();
    load(p.string());
  }
  for (const auto& [name, shard] : wm.items()) {
    const std::string& want = shard_path.at(shard.get<std::string>());
    const TensorInfo* t = ck.find(name);
    if (!t || t->file != want)
      fail("checkpoint index '{}': tensor '{}' is listed in shard '{}' but absent from it", ip, name,
           shard.get<std::string>());
  }
  return ck;
}

std::string safetensors_bytes(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();  // keeps the given tensor order
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || header.contains(t.name))
      fail("safetensors file '{}': tensor name '{}' is empty, reserved or repeated", path, t.name);
    const int64_t numel = checked_numel(t.shape);
    if (std::any_of(t.shape.begin(), t.shape.end(), [](int64_t d) { return d < 0; }) || numel < 0 ||
        numel > std::numeric_limits<int64_t>::max() / 4)
      fail("safetensors file '{}': tensor '{}': invalid shape {}", path, t.name, shape_str(t.shape));
    const size_t want = size_t(numel) * elem_size(t.dtype);
    if (t.bytes.size() != want)
      fail("safetensors file '{}': tensor '{}' has {} bytes, but shape {} of {} needs {}", path, t.name,
           t.bytes.size(), shape_str(t.shape), dtype_str(t.dtype), want);
    header[t.name] = {{"dtype", dtype_str(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + want}}};
    offset += want;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // spaces are JSON whitespace; data starts 8-aligned
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((uint64_t(text.size()) >> (8 * i)) & 0xFF);
  out.reserve(8 + text.size() + offset);
  out += text;
  for (const TensorToWrite& t : tensors) out.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  return out;
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  write_file_atomic(path, safetensors_bytes(path, tensors, metadata), "safetensors file");
}

}  // namespace fovea
