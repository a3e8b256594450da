// The message patterns of the two-process UDP tests (udp_peer_*_test.cpp,
// one executable).
#pragma once

#include <cstddef>
#include <cstdint>

namespace softverbs::test {

// The pattern of message `sequence`: every 8-byte word differs, and the
// first word names the message.
inline void fill(uint8_t* at, size_t bytes, uint64_t sequence) {
  auto* words = reinterpret_cast<uint64_t*>(at);
  words[0] = sequence;
  for (size_t i = 1; i < bytes / 8; ++i) words[i] = (sequence << 32) ^ (i * 0x9e3779b97f4a7c15ull);
}
inline bool matches(const uint8_t* at, size_t bytes, uint64_t sequence) {
  const auto* words = reinterpret_cast<const uint64_t*>(at);
  if (words[0] != sequence) return false;
  for (size_t i = 1; i < bytes / 8; ++i)
    if (words[i] != ((sequence << 32) ^ (i * 0x9e3779b97f4a7c15ull))) return false;
  return true;
}

}  // namespace softverbs::test
