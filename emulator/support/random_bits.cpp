#include "support/random_bits.h"

#include <sys/random.h>

#include <cerrno>
#include <mutex>
#include <random>

#include "support/process_id.h"

namespace softverbs {

uint64_t random_u64() {
  // The kernel's numbers, fetched a batch at a time. Process-wide rather
  // than per thread: the provider is dlopen'ed and its thread-local storage
  // must stay small. A forked child fetches its own batch.
  static std::mutex mutex;
  static uint64_t batch[32];
  static size_t left = 0;
  static pid_t fetched_by = 0;
  std::lock_guard guard(mutex);
  if (left == 0 || fetched_by != current_pid()) {
    ssize_t got;
    do got = getrandom(batch, sizeof batch, 0);
    while (got < 0 && errno == EINTR);
    if (got != static_cast<ssize_t>(sizeof batch)) {
      std::random_device device;
      for (uint64_t& value : batch) value = uint64_t{device()} << 32 | device();
    }
    left = std::size(batch);
    fetched_by = current_pid();
  }
  return batch[--left];
}

uint32_t random_between(uint32_t low, uint32_t high) {
  return low + static_cast<uint32_t>(random_u64() % (uint64_t{high} - low + 1));
}

}  // namespace softverbs
