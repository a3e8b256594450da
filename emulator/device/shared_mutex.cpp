#include "device/shared_mutex.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <ctime>

namespace softverbs {

namespace {

// Held this long, a lock's owner is checked on: long enough that a live
// owner's check costs nothing that matters (a copy through the copy agent
// may hold memory_lock for seconds), short enough that a crash costs the
// others one pause.
constexpr long kOwnerCheckNs = 10'000'000;
// Compare-and-swaps tried before sleeping: a holder on another core is
// usually out within a few hundred cycles, and a futex sleep and wake-up
// costs microseconds (more on a virtual machine).
constexpr int kSpins = 64;

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

long futex(std::atomic<uint32_t>* word, int operation, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), operation, value, timeout, nullptr, 0);
}

// A zombie still answers kill(), but will never unlock: dead too.
bool owner_alive(pid_t pid) {
  if (!process_alive(pid)) return false;
  char path[32];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* stat = std::fopen(path, "re");
  if (stat == nullptr) return true;  // no /proc here: kill() is all we know
  char state = 0;
  // "pid (comm) S ...": comm may hold spaces and parentheses; the state
  // follows the last ')'.
  char line[512];
  size_t length = std::fread(line, 1, sizeof line - 1, stat);
  std::fclose(stat);
  line[length] = 0;
  for (size_t i = length; i > 0; --i) {
    if (line[i - 1] == ')') {
      if (i + 1 < length) state = line[i + 1];
      break;
    }
  }
  return state != 'Z' && state != 'X';
}

}  // namespace

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));

void SharedMutex::lock_contended(uint32_t self) {
  for (int spin = 0; spin < kSpins; ++spin) {
    cpu_relax();
    uint32_t seen = word_.load(std::memory_order_relaxed);
    if (seen == 0 && word_.compare_exchange_weak(seen, self, std::memory_order_acquire, std::memory_order_relaxed))
      return;
  }
  for (;;) {
    uint32_t seen = word_.load(std::memory_order_relaxed);
    if (seen == 0) {
      // Taken after others may have gone to sleep: mark them, so that our
      // unlock wakes the next.
      if (word_.compare_exchange_weak(seen, self | kWaiters, std::memory_order_acquire, std::memory_order_relaxed))
        return;
      continue;
    }
    if ((seen & kWaiters) == 0 &&
        !word_.compare_exchange_weak(seen, seen | kWaiters, std::memory_order_relaxed, std::memory_order_relaxed))
      continue;
    const timespec timeout{0, kOwnerCheckNs};
    if (futex(&word_, FUTEX_WAIT, seen | kWaiters, &timeout) == 0 || errno != ETIMEDOUT) continue;
    uint32_t now = word_.load(std::memory_order_relaxed);
    const auto owner = static_cast<pid_t>(now & ~kWaiters);
    if (owner != 0 && owner != static_cast<pid_t>(self) && !owner_alive(owner) &&
        word_.compare_exchange_strong(now, self | kWaiters, std::memory_order_acquire, std::memory_order_relaxed))
      return;  // its owner died holding it
  }
}

void SharedMutex::wake_one() { futex(&word_, FUTEX_WAKE, 1, nullptr); }

size_t ReadMostlyMutex::claim(int32_t pid) {
  for (size_t i = 0; i < kSlots; ++i)
    if (slots_[i].owner_pid.load(std::memory_order_relaxed) == pid) return i;
  // Never claimed first (no /proc to read), then those of exited processes.
  for (bool exited : {false, true}) {
    for (size_t i = 0; i + 1 < kSlots; ++i) {
      int32_t owner = slots_[i].owner_pid.load(std::memory_order_relaxed);
      if (exited ? owner == 0 || owner_alive(owner) : owner != 0) continue;
      // Two processes may both find the slot free: the exchange lets one in.
      // (An owner that died holding the slot's mutex is taken over by the
      // mutex itself.)
      if (slots_[i].owner_pid.compare_exchange_strong(owner, pid)) return i;
    }
  }
  return kSlots - 1;
}

}  // namespace softverbs
