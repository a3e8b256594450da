#include "wire/crc32.h"

#include <isa-l/crc.h>

#include <array>
#include <bit>
#include <cstring>

#include "wire/crc32_fold.h"

namespace softverbs::wire {

namespace {

// Slicing-by-8 tables: eight bytes per step, for the short spans (headers,
// small packets) where a call into a library costs more than the work.
constexpr std::array<std::array<uint32_t, 256>, 8> make_tables() {
  std::array<std::array<uint32_t, 256>, 8> tables{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
    tables[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (size_t t = 1; t < 8; ++t) tables[t][i] = (tables[t - 1][i] >> 8) ^ tables[0][tables[t - 1][i] & 0xff];
  return tables;
}

constexpr auto kTables = make_tables();
constexpr size_t kLibraryFrom = 64;  // ISA-L wins above this

uint32_t crc32_sliced(uint32_t crc, const uint8_t* data, size_t length) {
  while (length >= 8) {
    uint32_t low, high;
    std::memcpy(&low, data, 4);  // little-endian hosts (x86, arm64 Linux)
    std::memcpy(&high, data + 4, 4);
    crc = crc32_step8(crc, low, high);
    data += 8;
    length -= 8;
  }
  if (length >= 4) {
    // Transport headers and payloads are whole words: most tails are one.
    uint32_t word;
    std::memcpy(&word, data, 4);
    word ^= crc;
    crc = kTables[3][word & 0xff] ^ kTables[2][(word >> 8) & 0xff] ^ kTables[1][(word >> 16) & 0xff] ^
          kTables[0][word >> 24];
    data += 4;
    length -= 4;
  }
  while (length-- > 0) crc = kTables[0][(crc ^ *data++) & 0xff] ^ (crc >> 8);
  return crc;
}

static_assert(std::endian::native == std::endian::little, "crc32_sliced reads words little-endian");

// crc32_fold wins over ISA-L's 128-bit folding from its smallest input up
// (it reduces its last vector with carry-less multiplications, not tables);
// where the CPU has AVX-512, ISA-L folds 512-bit vectors, twice as wide.
bool use_fold() {
  static const bool use =
      crc32_fold_available() && !(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl"));
  return use;
}

}  // namespace

uint32_t crc32_step8(uint32_t crc, uint32_t low, uint32_t high) {
  low ^= crc;
  return kTables[7][low & 0xff] ^ kTables[6][(low >> 8) & 0xff] ^ kTables[5][(low >> 16) & 0xff] ^
         kTables[4][low >> 24] ^ kTables[3][high & 0xff] ^ kTables[2][(high >> 8) & 0xff] ^
         kTables[1][(high >> 16) & 0xff] ^ kTables[0][high >> 24];
}

uint32_t crc32(uint32_t crc, std::span<const uint8_t> bytes) {
  if (bytes.size() >= kFoldMinimum && use_fold()) return crc32_fold(crc, bytes.data(), bytes.size(), nullptr);
  // Short spans (headers, small packets) cost less than a call into ISA-L.
  if (bytes.size() < kLibraryFrom) return crc32_sliced(crc, bytes.data(), bytes.size());
  // ISA-L inverts before and after (gzip's convention): undone both ways to
  // continue a raw register.
  return ~crc32_gzip_refl(~crc, bytes.data(), bytes.size());
}

uint32_t crc32_copy(uint32_t crc, uint8_t* to, std::span<const uint8_t> from) {
  if (from.size() >= kFoldMinimum && use_fold()) return crc32_fold(crc, from.data(), from.size(), to);
  std::memcpy(to, from.data(), from.size());
  return crc32(crc, from);
}

}  // namespace softverbs::wire
