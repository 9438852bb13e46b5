// Base64 (RFC 4648, standard alphabet): `fovea serve`'s images arrive as base64 or data URLs and its
// bf16 embeddings leave as base64; vLLM's key of a data-URL item hashes one (data_url_key).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fovea {

// Inputs of at least `parallel_from` bytes are encoded on all cores (fovea::parallel_ranges), to
// the same text; tests lower it to compare the two paths.
constexpr size_t kBase64ParallelBytes = size_t(1) << 20;
std::string base64_encode(const uint8_t* data, size_t n, size_t parallel_from = kBase64ParallelBytes);
// The same text appended to `out` in place (a reply is built in one buffer, not copied into it).
void base64_append(std::string& out, const uint8_t* data, size_t n, size_t parallel_from = kBase64ParallelBytes);
constexpr size_t base64_size(size_t n) { return (n + 2) / 3 * 4; }

// Strict decoding: the standard alphabet, '=' padding optional, ASCII whitespace (line breaks of
// wrapped base64) skipped. Throws fovea::Error naming `what`, the offending character and its offset.
std::vector<uint8_t> base64_decode(std::string_view text, const std::string& what);

}  // namespace fovea
