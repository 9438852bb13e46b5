// BLAKE3 as its specification defines it: 1024-byte chunks of 64-byte blocks, each block compressed
// (7 rounds of the G function over 16 words, the message words permuted between rounds) into the
// chunk's chaining value; chunks' chaining values merged pairwise into a binary tree (a parent node
// compresses its two children's values); the root's compression, with the ROOT flag, gives the
// output, 64 bytes per output block counter. Written from the specification's text.
#include "fovea/blake3.h"

#include <algorithm>
#include <cstring>

namespace fovea {

namespace {

constexpr uint32_t kIv[8] = {0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A,
                             0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19};
constexpr int kPermutation[16] = {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8};
constexpr uint32_t kChunkStart = 1, kChunkEnd = 2, kParent = 4, kRoot = 8;
constexpr size_t kBlock = 64, kChunk = 1024;

constexpr uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void g(uint32_t* v, int a, int b, int c, int d, uint32_t x, uint32_t y) {
  v[a] = v[a] + v[b] + x;
  v[d] = rotr(v[d] ^ v[a], 16);
  v[c] = v[c] + v[d];
  v[b] = rotr(v[b] ^ v[c], 12);
  v[a] = v[a] + v[b] + y;
  v[d] = rotr(v[d] ^ v[a], 8);
  v[c] = v[c] + v[d];
  v[b] = rotr(v[b] ^ v[c], 7);
}

// The compression function: the 16-word state after 7 rounds, its halves xored (the first 8 words
// are the new chaining value; all 16, each half also xored with the input value, an output block).
std::array<uint32_t, 16> compress(const uint32_t cv[8], const uint8_t block[kBlock], uint64_t counter, uint32_t len,
                                  uint32_t flags) {
  uint32_t m[16];
  for (int i = 0; i < 16; ++i)
    m[i] = uint32_t(block[4 * i]) | uint32_t(block[4 * i + 1]) << 8 | uint32_t(block[4 * i + 2]) << 16 |
           uint32_t(block[4 * i + 3]) << 24;
  uint32_t v[16] = {cv[0],
                    cv[1],
                    cv[2],
                    cv[3],
                    cv[4],
                    cv[5],
                    cv[6],
                    cv[7],
                    kIv[0],
                    kIv[1],
                    kIv[2],
                    kIv[3],
                    uint32_t(counter),
                    uint32_t(counter >> 32),
                    len,
                    flags};
  for (int round = 0; round < 7; ++round) {
    g(v, 0, 4, 8, 12, m[0], m[1]);
    g(v, 1, 5, 9, 13, m[2], m[3]);
    g(v, 2, 6, 10, 14, m[4], m[5]);
    g(v, 3, 7, 11, 15, m[6], m[7]);
    g(v, 0, 5, 10, 15, m[8], m[9]);
    g(v, 1, 6, 11, 12, m[10], m[11]);
    g(v, 2, 7, 8, 13, m[12], m[13]);
    g(v, 3, 4, 9, 14, m[14], m[15]);
    uint32_t p[16];
    for (int i = 0; i < 16; ++i) p[i] = m[kPermutation[i]];
    std::memcpy(m, p, sizeof m);
  }
  std::array<uint32_t, 16> out;
  for (int i = 0; i < 8; ++i) {
    out[i] = v[i] ^ v[i + 8];
    out[i + 8] = v[i + 8] ^ cv[i];
  }
  return out;
}

// What the last compression (the root's, or a node's before it is merged) takes: its inputs, kept
// so that output() can run it with ROOT and any output block counter.
struct Node {
  uint32_t cv[8];
  uint8_t block[kBlock];
  uint64_t counter;
  uint32_t len, flags;
  std::array<uint32_t, 8> chaining() const {
    const auto o = compress(cv, block, counter, len, flags);
    std::array<uint32_t, 8> r;
    std::copy(o.begin(), o.begin() + 8, r.begin());
    return r;
  }
};

Node parent_node(const std::array<uint32_t, 8>& left, const std::array<uint32_t, 8>& right) {
  Node n{};
  std::copy(kIv, kIv + 8, n.cv);
  for (int i = 0; i < 8; ++i)
    for (int b = 0; b < 4; ++b) {
      n.block[4 * i + b] = uint8_t(left[i] >> (8 * b));
      n.block[32 + 4 * i + b] = uint8_t(right[i] >> (8 * b));
    }
  n.counter = 0;
  n.len = kBlock;
  n.flags = kParent;
  return n;
}

}  // namespace

Blake3::Blake3() { std::copy(kIv, kIv + 8, cv_.begin()); }

void Blake3::absorb_block(const uint8_t* block, uint32_t flags) {
  const auto o = compress(cv_.data(), block, chunks_, kBlock, flags);
  std::copy(o.begin(), o.begin() + 8, cv_.begin());
  ++blocks_done_;
}

void Blake3::push_chunk(const Words& cv) {
  // The chunk count after this one says how many merges it completes: one per trailing zero bit.
  Words merged = cv;
  uint64_t total = chunks_ + 1;
  while ((total & 1) == 0) {
    merged = parent_node(stack_.back(), merged).chaining();
    stack_.pop_back();
    total >>= 1;
  }
  stack_.push_back(merged);
}

void Blake3::update(std::span<const uint8_t> data) {
  size_t i = 0;
  while (i < data.size()) {
    if (block_len_ == kBlock) {                   // a full block is compressed only once more input follows it
      if (blocks_done_ + 1 == kChunk / kBlock) {  // the chunk's last block: the chunk ends
        const auto o = compress(cv_.data(), block_.data(), chunks_, kBlock, kChunkEnd);
        Words cv;
        std::copy(o.begin(), o.begin() + 8, cv.begin());
        push_chunk(cv);
        ++chunks_;
        std::copy(kIv, kIv + 8, cv_.begin());
        blocks_done_ = 0;
      } else {
        absorb_block(block_.data(), blocks_done_ == 0 ? kChunkStart : 0);
      }
      block_len_ = 0;
    }
    const size_t take = std::min(kBlock - block_len_, data.size() - i);
    std::memcpy(block_.data() + block_len_, data.data() + i, take);
    block_len_ += take;
    i += take;
  }
}

std::vector<uint8_t> Blake3::output(size_t length) const {
  // The current chunk's last block, then the stack merged from the right: the last node is the root.
  Node node{};
  std::copy(cv_.begin(), cv_.end(), node.cv);
  std::memcpy(node.block, block_.data(), block_len_);
  node.counter = chunks_;
  node.len = uint32_t(block_len_);
  node.flags = kChunkEnd | (blocks_done_ == 0 ? kChunkStart : 0);
  for (size_t k = stack_.size(); k-- > 0;) node = parent_node(stack_[k], node.chaining());
  std::vector<uint8_t> out(length);
  for (uint64_t block = 0; block * kBlock < length; ++block) {
    const auto o = compress(node.cv, node.block, block, node.len, node.flags | kRoot);
    for (size_t w = 0; w < 16; ++w)
      for (size_t b = 0; b < 4; ++b) {
        const size_t at = block * kBlock + 4 * w + b;
        if (at < length) out[at] = uint8_t(o[w] >> (8 * b));
      }
  }
  return out;
}

std::string Blake3::hex(size_t length) const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  for (const uint8_t b : output(length)) {
    s += kDigits[b >> 4];
    s += kDigits[b & 15];
  }
  return s;
}

std::string blake3_hex(std::span<const uint8_t> data) {
  Blake3 h;
  h.update(data);
  return h.hex();
}

std::string blake3_hex(std::string_view text) {
  Blake3 h;
  h.update(text);
  return h.hex();
}

}  // namespace fovea
