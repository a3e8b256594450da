// Baselines for softverbs' data-path figures: what this machine can do
// without any emulation. Later benchmarks report ratios against these.
#include <benchmark/benchmark.h>

#include <cstring>

#include "page_aligned.h"

namespace {

using softverbs::bench::page_aligned;

void MemcpyBandwidth(benchmark::State& state) {
  const size_t size = static_cast<size_t>(state.range(0));
  auto source = page_aligned(size, 'x'), destination = page_aligned(size);
  if (!source || !destination) {
    state.SkipWithError("out of memory");
    return;
  }
  for (auto _ : state) {
    std::memcpy(destination.get(), source.get(), size);
    benchmark::DoNotOptimize(destination.get());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(size));
}
BENCHMARK(MemcpyBandwidth)->RangeMultiplier(2)->Range(2, 1 << 20);

}  // namespace
