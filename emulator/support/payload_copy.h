// Copying a payload into an application's memory without the slow path of
// the CPU's string copy. glibc's memcpy copies 2 KiB and more with
// `rep movsb`; on AMD Zen 3 (and, by AMD's own notes, other cores with
// FSRM) that instruction runs 16-25x slower when the destination lies 1 to
// 31 bytes after the source modulo 4 KiB: a 4 KiB payload takes 1.4 us
// instead of 55 ns, 64 KiB 22 us instead of 1.4 (bench/wire_bench,
// PayloadCopy against Memcpy). Where a packet's payload sits in a receive
// buffer and where the application wants it is up to the application's
// buffer layout, so every receive path that copies into registered memory
// goes through copy_payload, which takes a vector loop for such a pair.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace softverbs {

namespace detail {
// Shorter copies are made by glibc's vector loops, which do not slow down.
inline constexpr size_t kStringCopyFrom = 2048;
// The distances (destination minus source, modulo 4 KiB) that slow the
// string copy down, with a margin: 1 to 31 measured.
inline constexpr uintptr_t kAliasingDistance = 64;
// The best of the two loops below for this CPU.
void copy_by_vectors(uint8_t* to, const uint8_t* from, size_t length);
#if defined(__x86_64__)
// Vector loops for `length` >= 64 (AVX2 only where the CPU has it).
void copy_avx2(uint8_t* to, const uint8_t* from, size_t length);
void copy_sse2(uint8_t* to, const uint8_t* from, size_t length);
#endif
}  // namespace detail

// Whether a string copy from `from` to `to` would run into 4 KiB aliasing.
inline bool copy_aliases(const void* to, const void* from) {
  const uintptr_t distance = (reinterpret_cast<uintptr_t>(to) - reinterpret_cast<uintptr_t>(from)) & 4095;
  return distance != 0 && distance < detail::kAliasingDistance;
}

// memcpy for ranges that do not overlap, at full speed for every layout.
inline void copy_payload(void* to, const void* from, size_t length) {
#if defined(__x86_64__)
  if (length >= detail::kStringCopyFrom && copy_aliases(to, from)) {
    detail::copy_by_vectors(static_cast<uint8_t*>(to), static_cast<const uint8_t*>(from), length);
    return;
  }
#endif
  std::memcpy(to, from, length);
}

// memmove that takes copy_payload's path where the ranges do not overlap.
inline void move_payload(void* to, const void* from, size_t length) {
  const auto t = reinterpret_cast<uintptr_t>(to), f = reinterpret_cast<uintptr_t>(from);
  if (t + length <= f || f + length <= t)
    copy_payload(to, from, length);
  else
    std::memmove(to, from, length);
}

}  // namespace softverbs
