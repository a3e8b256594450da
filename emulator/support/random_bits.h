// Unpredictable numbers for what a peer must not guess: key tags, QPN tags,
// initial PSNs: the kernel's random numbers (getrandom).
#pragma once

#include <cstdint>

namespace softverbs {

uint64_t random_u64();

// A number in [low, high], both included.
uint32_t random_between(uint32_t low, uint32_t high);

}  // namespace softverbs
