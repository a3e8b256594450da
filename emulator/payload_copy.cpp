#include "payload_copy.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace softverbs::detail {

#if defined(__x86_64__)

// Both loops store whole aligned vectors (the first and last vector of the
// range are stored unaligned, over the edges of the aligned ones): a store
// that splits cache lines costs more than the loads that feed it.
[[gnu::target("avx2")]] void copy_avx2(uint8_t* to, const uint8_t* from, size_t length) {
  constexpr size_t kVector = 32;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from)));
  size_t at = kVector - (reinterpret_cast<uintptr_t>(to) & (kVector - 1));
  for (; at + 4 * kVector <= length; at += 4 * kVector) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + at));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + at + kVector));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + at + 2 * kVector));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + at + 3 * kVector));
    _mm256_store_si256(reinterpret_cast<__m256i*>(to + at), a);
    _mm256_store_si256(reinterpret_cast<__m256i*>(to + at + kVector), b);
    _mm256_store_si256(reinterpret_cast<__m256i*>(to + at + 2 * kVector), c);
    _mm256_store_si256(reinterpret_cast<__m256i*>(to + at + 3 * kVector), d);
  }
  for (; at + kVector <= length; at += kVector)
    _mm256_store_si256(reinterpret_cast<__m256i*>(to + at),
                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + at)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + length - kVector),
                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + length - kVector)));
}

void copy_sse2(uint8_t* to, const uint8_t* from, size_t length) {
  constexpr size_t kVector = 16;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(to), _mm_loadu_si128(reinterpret_cast<const __m128i*>(from)));
  size_t at = kVector - (reinterpret_cast<uintptr_t>(to) & (kVector - 1));
  for (; at + 4 * kVector <= length; at += 4 * kVector) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + at));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + at + kVector));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + at + 2 * kVector));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + at + 3 * kVector));
    _mm_store_si128(reinterpret_cast<__m128i*>(to + at), a);
    _mm_store_si128(reinterpret_cast<__m128i*>(to + at + kVector), b);
    _mm_store_si128(reinterpret_cast<__m128i*>(to + at + 2 * kVector), c);
    _mm_store_si128(reinterpret_cast<__m128i*>(to + at + 3 * kVector), d);
  }
  for (; at + kVector <= length; at += kVector)
    _mm_store_si128(reinterpret_cast<__m128i*>(to + at), _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + at)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(to + length - kVector),
                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + length - kVector)));
}

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
