#include "wire/crc32_fold.h"

#include <isa-l/crc.h>

#include <cstring>
#include <span>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace softverbs::wire {

#if defined(__x86_64__)

namespace {

// Folding: the CRC of A followed by B, where A is 16 bytes and B at least
// 16, is the CRC of B with A * x^(8 |B|) mod P added into its first 16
// bytes. For a 16-byte lane whose halves are H (first 8 bytes) and L, that
// is H * x^(8d + 32) + L * x^(8d - 32) mod P, where d is how far ahead the
// lane it folds into lies; each product is a 64 x 33-bit carry-less
// multiplication whose result fits the lane. The constants are x^n mod P,
// bit-reflected as the data is, and shifted left by one because the
// product of two reflected operands comes out one bit short.
constexpr uint64_t kPolynomial = 0x104c11db7;

// A polynomial of degree 32 at most, bit-reflected over 33 bits. For one
// of degree below 32 that is its 32-bit reflection shifted left by one.
constexpr uint64_t reflect33(uint64_t value) {
  uint64_t reflected = 0;
  for (unsigned bit = 0; bit < 33; ++bit)
    if (value & (uint64_t{1} << bit)) reflected |= uint64_t{1} << (32 - bit);
  return reflected;
}

constexpr uint64_t reflected_power(unsigned n) {
  uint64_t remainder = 1;
  for (unsigned i = 0; i < n; ++i) {
    remainder <<= 1;
    if (remainder & (uint64_t{1} << 32)) remainder ^= kPolynomial;
  }
  return reflect33(remainder);
}

// The two constants for a fold `bytes` ahead, as the two halves of a lane.
struct FoldConstants {
  uint64_t first_half;   // times the lane's first 8 bytes
  uint64_t second_half;  // times its last 8
};
constexpr FoldConstants fold_by(unsigned bytes) {
  return {reflected_power(8 * bytes + 32), reflected_power(8 * bytes - 32)};
}
// Known values from the literature (Intel's "Fast CRC Computation Using
// PCLMULQDQ", fold by 16 and by 64 bytes) check the derivation.
static_assert(fold_by(16).first_half == 0x1751997d0 && fold_by(16).second_half == 0x0ccaa009e);
static_assert(fold_by(64).first_half == 0x154442bd4 && fold_by(64).second_half == 0x1c6e41596);

// The quotient x^64 / P and P itself, 33 bits each, bit-reflected: the
// two multipliers of the Barrett reduction that ends a fold (the values
// in Intel's paper above check them).
constexpr uint64_t quotient_of_x64() {
  unsigned __int128 remainder = static_cast<unsigned __int128>(1) << 64;
  uint64_t quotient = 0;
  for (int bit = 64; bit >= 32; --bit) {
    if ((remainder >> bit) & 1) {
      remainder ^= static_cast<unsigned __int128>(kPolynomial) << (bit - 32);
      quotient |= uint64_t{1} << (bit - 32);
    }
  }
  return quotient;
}
constexpr uint64_t kBarrettQuotient = reflect33(quotient_of_x64());
constexpr uint64_t kBarrettPolynomial = reflect33(kPolynomial);
static_assert(kBarrettQuotient == 0x1f7011641 && kBarrettPolynomial == 0x1db710641);

constexpr size_t kVector = 32;
constexpr size_t kVectors = 4;
constexpr size_t kRound = kVector * kVectors;
static_assert(kRound == kFoldMinimum);

[[gnu::target("avx2,pclmul,vpclmulqdq")]] inline __m256i constants(FoldConstants c) {
  return _mm256_set_epi64x(static_cast<long long>(c.second_half), static_cast<long long>(c.first_half),
                           static_cast<long long>(c.second_half), static_cast<long long>(c.first_half));
}

// Both lanes of `lanes` folded `constants`' distance ahead, added to `ahead`.
[[gnu::target("avx2,pclmul,vpclmulqdq")]] inline __m256i fold(__m256i lanes, __m256i constants, __m256i ahead) {
  const __m256i first = _mm256_clmulepi64_epi128(lanes, constants, 0x00);
  const __m256i second = _mm256_clmulepi64_epi128(lanes, constants, 0x11);
  return _mm256_xor_si256(_mm256_xor_si256(first, second), ahead);
}

// The CRC register (starting from zero) of the 32 bytes that `lanes` holds,
// without a table: its first lane folded into its second, those 16 bytes
// folded to 8 (the first 8 times x^64 mod P, 96 bits, then the top 32 of
// those times x^32 mod P), and the Barrett reduction of the last 8 to 4.
// The tables' eight lookups a step missed the cache on a sender, whose
// copies push them out: four steps here cost a third as much as the fold
// of the 4 KiB before them.
[[gnu::target("avx2,pclmul,vpclmulqdq")]] inline uint32_t reduce(__m256i lanes) {
  const FoldConstants by_lane = fold_by(16);
  const __m128i lane_constants =
      _mm_set_epi64x(static_cast<long long>(by_lane.second_half), static_cast<long long>(by_lane.first_half));
  const __m128i first = _mm256_castsi256_si128(lanes);
  __m128i x = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(first, lane_constants, 0x00),
                                          _mm_clmulepi64_si128(first, lane_constants, 0x11)),
                            _mm256_extracti128_si256(lanes, 1));
  const __m128i low32 = _mm_set_epi32(0, 0, 0, -1);
  x = _mm_xor_si128(_mm_clmulepi64_si128(x, lane_constants, 0x10), _mm_srli_si128(x, 8));
  const __m128i by_8 = _mm_set_epi64x(0, static_cast<long long>(reflected_power(64)));
  x = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x, low32), by_8, 0x00), _mm_srli_si128(x, 4));
  const __m128i barrett =
      _mm_set_epi64x(static_cast<long long>(kBarrettQuotient), static_cast<long long>(kBarrettPolynomial));
  __m128i estimate = _mm_clmulepi64_si128(_mm_and_si128(x, low32), barrett, 0x10);
  estimate = _mm_clmulepi64_si128(_mm_and_si128(estimate, low32), barrett, 0x00);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(x, estimate), 1));
}

// The 32 bytes at `offset`, stored at the same offset of `copy_to` as well
// when kCopy.
template <bool kCopy>
[[gnu::target("avx2,pclmul,vpclmulqdq")]] inline __m256i read(const uint8_t* data, uint8_t* copy_to, size_t offset) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + offset));
  if constexpr (kCopy) _mm256_storeu_si256(reinterpret_cast<__m256i*>(copy_to + offset), bytes);
  return bytes;
}

// Two loops, one that copies and one that does not, so that neither tests
// for the copy in its body.
template <bool kCopy>
[[gnu::target("avx2,pclmul,vpclmulqdq")]] uint32_t fold_all(uint32_t crc, const uint8_t* data, size_t length,
                                                            uint8_t* copy_to) {
  // The register joins the first four bytes; from there on the CRC of
  // what the vectors hold, followed by the bytes not yet read, is the
  // CRC of everything (with a register of zero).
  __m256i v0 =
      _mm256_xor_si256(read<kCopy>(data, copy_to, 0), _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, static_cast<int>(crc)));
  __m256i v1 = read<kCopy>(data, copy_to, 32);
  __m256i v2 = read<kCopy>(data, copy_to, 64);
  __m256i v3 = read<kCopy>(data, copy_to, 96);
  size_t at = kRound;
  const __m256i by_round = constants(fold_by(kRound));
  for (; at + kRound <= length; at += kRound) {
    v0 = fold(v0, by_round, read<kCopy>(data, copy_to, at));
    v1 = fold(v1, by_round, read<kCopy>(data, copy_to, at + 32));
    v2 = fold(v2, by_round, read<kCopy>(data, copy_to, at + 64));
    v3 = fold(v3, by_round, read<kCopy>(data, copy_to, at + 96));
  }
  const __m256i by_vector = constants(fold_by(kVector));
  v1 = fold(v0, by_vector, v1);
  v2 = fold(v1, by_vector, v2);
  v3 = fold(v2, by_vector, v3);
  for (; at + kVector <= length; at += kVector) v3 = fold(v3, by_vector, read<kCopy>(data, copy_to, at));
  crc = reduce(v3);
  if (at < length) {
    if constexpr (kCopy) std::memcpy(copy_to + at, data + at, length - at);
    crc = ~crc32_gzip_refl(~crc, data + at, length - at);  // the tail, by ISA-L
  }
  return crc;
}

}  // namespace

bool crc32_fold_available() {
  static const bool available = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq");
  return available;
}

uint32_t crc32_fold(uint32_t crc, const uint8_t* data, size_t length, uint8_t* copy_to) {
  return copy_to != nullptr ? fold_all<true>(crc, data, length, copy_to) : fold_all<false>(crc, data, length, nullptr);
}

#else

bool crc32_fold_available() { return false; }

uint32_t crc32_fold(uint32_t crc, const uint8_t* data, size_t length, uint8_t* copy_to) {
  if (copy_to != nullptr) std::memcpy(copy_to, data, length);
  return ~crc32_gzip_refl(~crc, data, length);
}

#endif

}  // namespace softverbs::wire
