// fovea/blake3.h: BLAKE3 (the BLAKE3 specification, 2020: hash mode, any output length), for the
// encoder-cache identifiers vLLM derives with it (fovea/ec-cache.h, vllm_mm_hash).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fovea {

// Incremental hashing: update() any number of times, then hex() or output() (which leave the state
// as it was: more input may follow).
class Blake3 {
 public:
  Blake3();
  void update(std::span<const uint8_t> data);
  void update(std::string_view text) { update({reinterpret_cast<const uint8_t*>(text.data()), text.size()}); }
  // `length` bytes of extended output (the default digest is its first 32).
  std::vector<uint8_t> output(size_t length = 32) const;
  std::string hex(size_t length = 32) const;  // lowercase

 private:
  using Words = std::array<uint32_t, 8>;
  void absorb_block(const uint8_t* block, uint32_t flags);  // a full block into the current chunk
  void push_chunk(const Words& cv);                         // a finished chunk's chaining value
  std::array<uint8_t, 64> block_{};  // the current chunk's pending bytes (never empty once full: kept for the end)
  size_t block_len_ = 0;
  size_t blocks_done_ = 0;    // blocks of the current chunk compressed
  uint64_t chunks_ = 0;       // chunks finished
  Words cv_{};                // the current chunk's chaining value
  std::vector<Words> stack_;  // subtree chaining values waiting for their sibling
};

std::string blake3_hex(std::span<const uint8_t> data);
std::string blake3_hex(std::string_view text);

}  // namespace fovea
