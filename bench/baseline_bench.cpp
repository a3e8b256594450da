// Baselines for softverbs' data-path figures: what this machine can do
// without any emulation. Later benchmarks report ratios against these.
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

namespace {

void MemcpyBandwidth(benchmark::State& state) {
  const size_t size = static_cast<size_t>(state.range(0));
  std::vector<char> source(size, 'x'), destination(size);
  for (auto _ : state) {
    std::memcpy(destination.data(), source.data(), size);
    benchmark::DoNotOptimize(destination.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(size));
}
BENCHMARK(MemcpyBandwidth)->RangeMultiplier(2)->Range(2, 1 << 20);

}  // namespace
