// Baseline: one-way latency of a cache-line ping-pong between two processes
// through shared memory, both busy-polling. The floor for any shared-memory
// RDMA latency on this machine.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 200000;
  void* shared = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) return 1;
  auto* ping = new (shared) std::atomic<int>(0);
  auto* pong = new (static_cast<char*>(shared) + 128) std::atomic<int>(0);  // another cache line
  pid_t child = fork();
  if (child == 0) {
    for (int i = 1; i <= iterations; ++i) {
      while (ping->load(std::memory_order_acquire) != i) {
      }
      pong->store(i, std::memory_order_release);
    }
    _exit(0);
  }
  std::vector<double> samples;
  samples.reserve(iterations);
  for (int i = 1; i <= iterations; ++i) {
    auto start = std::chrono::steady_clock::now();
    ping->store(i, std::memory_order_release);
    while (pong->load(std::memory_order_acquire) != i) {
    }
    samples.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / 2);
  }
  waitpid(child, nullptr, 0);
  std::sort(samples.begin(), samples.end());
  std::printf("shm_pingpong_one_way_us median=%.3f p99=%.3f\n", samples[samples.size() / 2],
              samples[samples.size() * 99 / 100]);
  return 0;
}
