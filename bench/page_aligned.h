// Page-aligned buffers for the benchmarks, as perftest allocates its own:
// where a source and a destination lie relative to each other modulo 4 KiB
// moves memcpy by up to 25x on some CPUs (a destination a few bytes past the
// source: 4 KiB aliasing, see docs/udp-transport.md). Two std::vectors of
// 64 KiB lay 16 bytes apart so on the Zen 3 VM, and memcpy measured 2 GB/s
// there against 40 for page-aligned buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace softverbs::bench {

struct FreeDeleter {
  void operator()(uint8_t* bytes) const { std::free(bytes); }
};
using PageAligned = std::unique_ptr<uint8_t[], FreeDeleter>;

// `size` bytes (rounded up to whole pages) set to `fill`; null when memory
// runs out.
inline PageAligned page_aligned(size_t size, uint8_t fill = 0) {
  const size_t rounded = (size + 4095) / 4096 * 4096;
  PageAligned bytes(static_cast<uint8_t*>(std::aligned_alloc(4096, rounded)));
  if (bytes) std::memset(bytes.get(), fill, rounded);
  return bytes;
}

}  // namespace softverbs::bench
