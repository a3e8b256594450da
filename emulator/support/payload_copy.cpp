#include "support/payload_copy.h"

#include <cstring>

namespace softverbs::detail {

#if defined(__x86_64__)

namespace {

// One loop for both vector widths: instantiated inside a function compiled
// for the width's instruction set, so that its vectors become that set's
// registers. It stores whole aligned vectors (the first and last vector of
// the range are stored unaligned, over the edges of the aligned ones): a
// store that splits cache lines costs more than the loads that feed it.
template <size_t kVector>
[[gnu::always_inline]] inline void copy_aligned_stores(uint8_t* to, const uint8_t* from, size_t length) {
  typedef uint8_t Vector __attribute__((vector_size(kVector)));
  // Vectors in memcpy and assignments only: a function that takes or
  // returns one would be compiled apart, for the default instruction set.
  Vector first, last, a, b, c, d;
  std::memcpy(&first, from, kVector);
  std::memcpy(&last, from + length - kVector, kVector);
  std::memcpy(to, &first, kVector);
  size_t at = kVector - (reinterpret_cast<uintptr_t>(to) & (kVector - 1));
  for (; at + 4 * kVector <= length; at += 4 * kVector) {
    std::memcpy(&a, from + at, kVector);
    std::memcpy(&b, from + at + kVector, kVector);
    std::memcpy(&c, from + at + 2 * kVector, kVector);
    std::memcpy(&d, from + at + 3 * kVector, kVector);
    Vector* out = reinterpret_cast<Vector*>(to + at);
    out[0] = a;
    out[1] = b;
    out[2] = c;
    out[3] = d;
  }
  for (; at + kVector <= length; at += kVector) {
    std::memcpy(&a, from + at, kVector);
    *reinterpret_cast<Vector*>(to + at) = a;
  }
  std::memcpy(to + length - kVector, &last, kVector);
}

}  // namespace

[[gnu::target("avx2")]] void copy_avx2(uint8_t* to, const uint8_t* from, size_t length) {
  copy_aligned_stores<32>(to, from, length);
}

void copy_sse2(uint8_t* to, const uint8_t* from, size_t length) { copy_aligned_stores<16>(to, from, length); }

void copy_by_vectors(uint8_t* to, const uint8_t* from, size_t length) {
  // Both need a vector's worth at each end; copy_payload sends 2 KiB and up.
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (length < 64) {
    std::memcpy(to, from, length);
  } else if (avx2) {
    copy_avx2(to, from, length);
  } else {
    copy_sse2(to, from, length);
  }
}

#else

void copy_by_vectors(uint8_t* to, const uint8_t* from, size_t length) { std::memcpy(to, from, length); }

#endif

}  // namespace softverbs::detail
