// CRC-32 by carry-less multiplication on 256-bit vectors (VPCLMULQDQ with
// AVX2): the payload CRC of every RoCEv2 packet. ISA-L folds 512-bit vectors
// where the CPU has AVX-512, but on CPUs with VPCLMULQDQ and no AVX-512
// (AMD Zen 3, Intel's hybrid client cores) it folds 128-bit ones: 12 GB/s
// on the Zen 3 VM against 20 for this (bench/wire_bench, Crc32/65536). The
// fold can also copy the bytes it reads, so that a sender checksums and
// copies a payload in one pass over it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace softverbs::wire {

// The fewest bytes crc32_fold takes: one round of its four vectors.
inline constexpr size_t kFoldMinimum = 128;

// Whether this CPU can run crc32_fold.
bool crc32_fold_available();

// Goes on with the CRC-32 register `crc` (reflected, no inversions; as
// crc32() in icrc.h) over `length` >= kFoldMinimum bytes at `data`, and
// copies them to `copy_to` as well unless it is null (the two ranges must
// not overlap). Only where crc32_fold_available().
uint32_t crc32_fold(uint32_t crc, const uint8_t* data, size_t length, uint8_t* copy_to);

}  // namespace softverbs::wire
