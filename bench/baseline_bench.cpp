// Baselines for softverbs' data-path figures: what this machine can do
// without any emulation. Later benchmarks report ratios against these.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <cstring>
#include <memory>

namespace {

struct FreeDeleter {
  void operator()(char* bytes) const { std::free(bytes); }
};

// Page-aligned, as perftest allocates its buffers: where the source and the
// destination lie relative to each other modulo 4 KiB moves memcpy by up
// to 25x on some CPUs (a destination a few bytes past the source: 4 KiB
// aliasing, see docs/udp-transport.md). Two std::vectors of 64 KiB lay 16
// bytes apart so on the Zen 3 VM, and memcpy measured 2 GB/s there
// against 40 for page-aligned buffers.
std::unique_ptr<char, FreeDeleter> page_aligned(size_t size) {
  const size_t rounded = (size + 4095) / 4096 * 4096;
  return std::unique_ptr<char, FreeDeleter>(static_cast<char*>(std::aligned_alloc(4096, rounded)));
}

void MemcpyBandwidth(benchmark::State& state) {
  const size_t size = static_cast<size_t>(state.range(0));
  auto source = page_aligned(size), destination = page_aligned(size);
  if (!source || !destination) {
    state.SkipWithError("out of memory");
    return;
  }
  std::memset(source.get(), 'x', size);
  std::memset(destination.get(), 0, size);
  for (auto _ : state) {
    std::memcpy(destination.get(), source.get(), size);
    benchmark::DoNotOptimize(destination.get());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(size));
}
BENCHMARK(MemcpyBandwidth)->RangeMultiplier(2)->Range(2, 1 << 20);

}  // namespace
