// A mutex that lives in memory shared between processes and survives the
// death of the process holding it.
//
// Not a robust pthread mutex: every post and poll of the shared-memory
// transport takes three to eight of these, and glibc's robust, process-shared
// lock and unlock (its robust-list bookkeeping, about 190 instructions a
// pair) were about a third of a 2-byte ib_write_lat iteration's instructions. This
// one is a futex word holding the owner's process id: one compare-and-swap
// to take, one exchange to give back. A waiter sleeps on the futex and, every
// 10 ms it waits (kOwnerCheckNs), asks whether the owner still lives; a dead (or
// zombie) owner's lock is taken over, as EOWNERDEAD allowed before. What the
// locks protect (queues and tables whose updates end in single stores)
// stays usable after such a death. The owner is a process, not a thread: a
// thread that exits holding a lock leaves it held while its process lives,
// which no caller does (every lock is scoped to one call).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>

#include "support/process_id.h"

namespace softverbs {

class SharedMutex {
 public:
  // Call once, on zeroed shared memory, before any process uses it.
  void initialize() { word_.store(0, std::memory_order_relaxed); }

  void lock() {
    const uint32_t self = static_cast<uint32_t>(current_pid());
    uint32_t expected = 0;
    if (word_.compare_exchange_strong(expected, self, std::memory_order_acquire, std::memory_order_relaxed)) [[likely]]
      return;
    lock_contended(self);
  }

  void unlock() {
    if (word_.exchange(0, std::memory_order_release) & kWaiters) [[unlikely]]
      wake_one();
  }

  // The process holding the lock, or 0 (for tests and diagnostics).
  pid_t owner() const { return static_cast<pid_t>(word_.load(std::memory_order_relaxed) & ~kWaiters); }

 private:
  static constexpr uint32_t kWaiters = 1u << 31;  // pids stay below 2^22

  void lock_contended(uint32_t self);
  void wake_one();

  std::atomic<uint32_t> word_;  // owner pid | kWaiters; 0 when free
};

static_assert(std::atomic<uint32_t>::is_always_lock_free, "the futex word must be a plain 32-bit word");

class SharedLock {
 public:
  explicit SharedLock(SharedMutex& mutex) : mutex_(mutex) { mutex_.lock(); }
  ~SharedLock() { mutex_.unlock(); }
  SharedLock(const SharedLock&) = delete;
  SharedLock& operator=(const SharedLock&) = delete;

 private:
  SharedMutex& mutex_;
};

// A lock that every data copy takes and only a change of what it guards
// (an MR registered or gone, a multicast group joined or left) takes alone:
// the device's memory_lock. A reader takes only the mutex of its process's
// slot, a cache line that stays in its own core's cache; a writer takes
// every slot's, in order. With one mutex for the whole device, each
// shared-memory WRITE moved that mutex's line from the core of the peer's
// last WRITE to its own: in ib_write_lat, the hottest line of the loop.
// Processes past kSlots share the last slot (correct, only slower), and a
// reader that dies holding its slot is taken over as any SharedMutex is.
class ReadMostlyMutex {
 public:
  static constexpr size_t kSlots = 64;

  // Call once, on zeroed shared memory, before any process uses it.
  void initialize() {
    for (Slot& slot : slots_) {
      slot.mutex.initialize();
      slot.owner_pid.store(0, std::memory_order_relaxed);
    }
  }

  // The slot of process `pid`: its own, else one never claimed or one whose
  // owner has exited, else the last.
  size_t claim(int32_t pid);

  // What a reader in `slot` takes (and holds with a SharedLock).
  SharedMutex& reader(size_t slot) { return slots_[slot].mutex; }
  // A writer's: every slot.
  void lock() {
    for (Slot& slot : slots_) slot.mutex.lock();
  }
  void unlock() {
    for (size_t i = kSlots; i > 0; --i) slots_[i - 1].mutex.unlock();
  }

 private:
  struct alignas(64) Slot {
    SharedMutex mutex;
    std::atomic<int32_t> owner_pid;
  };
  Slot slots_[kSlots];
};

// Holds a ReadMostlyMutex alone (a writer).
using ExclusiveLock = std::lock_guard<ReadMostlyMutex>;

}  // namespace softverbs
