// CRC-32 as the ICRC needs it (reflected, polynomial 0xEDB88320): ISA-L's,
// and where they are faster, slicing-by-8 tables for short spans and
// crc32_fold for long ones (which can also copy what it reads).
#pragma once

#include <cstdint>
#include <span>

namespace softverbs::wire {

// CRC-32 register update, no pre- or post-inversion: crc32(0xffffffff,
// data) is the inverse of the usual CRC-32.
uint32_t crc32(uint32_t crc, std::span<const uint8_t> bytes);
// The same, and copies `from` to `to` (which must not overlap it): in one
// pass over the bytes where the CPU allows (crc32_fold.h).
uint32_t crc32_copy(uint32_t crc, uint8_t* to, std::span<const uint8_t> from);

// Eight bytes, given as two little-endian words, in one table step: the
// ICRC's masked start of a BTH without a copy or a call into ISA-L.
uint32_t crc32_step8(uint32_t crc, uint32_t low, uint32_t high);

}  // namespace softverbs::wire
