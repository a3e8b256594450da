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

// 64 KiB copies, each from the next of `blocks` sources into the next of as
// many destinations: the working set of ib_write_bw -s 65536 -q `blocks`,
// whose QPs each write a buffer of their own into one of their own.
void MemcpyAcrossBlocks(benchmark::State& state) {
  constexpr size_t kBlock = 65536;
  const size_t blocks = static_cast<size_t>(state.range(0));
  auto source = page_aligned(kBlock * blocks, 'x'), destination = page_aligned(kBlock * blocks);
  if (!source || !destination) {
    state.SkipWithError("out of memory");
    return;
  }
  size_t next = 0;
  for (auto _ : state) {
    std::memcpy(destination.get() + next * kBlock, source.get() + next * kBlock, kBlock);
    benchmark::DoNotOptimize(destination.get());
    benchmark::ClobberMemory();
    next = next + 1 == blocks ? 0 : next + 1;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(kBlock));
}
BENCHMARK(MemcpyAcrossBlocks)->Arg(1)->Arg(4)->Arg(16)->Arg(64);

}  // namespace
