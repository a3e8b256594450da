// The lock that the shared-memory structures of a device use, between real
// processes: exclusion, sleeping waiters, and owners that die holding it.
#include "shared_mutex.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <new>

namespace softverbs {
namespace {

struct SharedState {
  SharedMutex mutex;
  uint64_t counter = 0;  // updated without atomics: only the lock keeps it right
  uint32_t inside = 0;
  uint32_t overlaps = 0;
  std::atomic<uint32_t> stage{0};
};

// Zeroed memory that a fork() shares, as a device memory file is shared.
class SharedPage {
 public:
  SharedPage() {
    void* memory = mmap(nullptr, sizeof(SharedState), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) throw std::bad_alloc();
    state_ = new (memory) SharedState;
    state_->mutex.initialize();
  }
  ~SharedPage() { munmap(state_, sizeof(SharedState)); }
  SharedPage(const SharedPage&) = delete;
  SharedPage& operator=(const SharedPage&) = delete;
  SharedState& operator*() const { return *state_; }
  SharedState* operator->() const { return state_; }

 private:
  SharedState* state_ = nullptr;
};

// A test whose lock() never returns fails (SIGALRM ends it) instead of
// hanging the suite.
class Watchdog {
 public:
  explicit Watchdog(unsigned seconds) { alarm(seconds); }
  ~Watchdog() { alarm(0); }
};

void wait_for_stage(const SharedState& state, uint32_t stage) {
  while (state.stage.load(std::memory_order_acquire) < stage) usleep(100);
}

TEST(SharedMutex, KeepsProcessesOutOfEachOthersCriticalSections) {
  Watchdog watchdog(60);
  SharedPage page;
  constexpr int kProcesses = 4;
  constexpr int kRounds = 20000;
  pid_t children[kProcesses];
  for (pid_t& child : children) {
    child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      for (int i = 0; i < kRounds; ++i) {
        SharedLock lock(page->mutex);
        volatile uint32_t& inside = page->inside;
        if (inside != 0) ++page->overlaps;
        inside = 1;
        volatile uint64_t& counter = page->counter;
        counter = counter + 1;
        if (i % 64 == 0) sched_yield();  // let another process find it held
        inside = 0;
      }
      _exit(0);
    }
  }
  for (pid_t child : children) {
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  EXPECT_EQ(page->overlaps, 0u);
  EXPECT_EQ(page->counter, uint64_t{kProcesses} * kRounds);
  EXPECT_EQ(page->mutex.owner(), 0);
}

TEST(SharedMutex, AWaiterSleepsUntilTheLiveHolderUnlocks) {
  Watchdog watchdog(30);
  SharedPage page;
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    page->mutex.lock();
    page->stage.store(1, std::memory_order_release);
    // Held across many of the waiter's owner checks: a live owner keeps it.
    usleep(200 * 1000);
    page->stage.store(2, std::memory_order_release);
    page->mutex.unlock();
    _exit(0);
  }
  wait_for_stage(*page, 1);
  EXPECT_EQ(page->mutex.owner(), child);
  auto start = std::chrono::steady_clock::now();
  page->mutex.lock();
  auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(page->stage.load(), 2u) << "taken before the holder let go";
  EXPECT_GE(waited, std::chrono::milliseconds(100));
  EXPECT_EQ(page->mutex.owner(), getpid());
  page->mutex.unlock();
  EXPECT_EQ(page->mutex.owner(), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
}

TEST(SharedMutex, ALockWhoseOwnerDiedIsTakenOver) {
  Watchdog watchdog(30);
  SharedPage page;
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    page->mutex.lock();
    _exit(0);  // never unlocks
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_EQ(page->mutex.owner(), child);
  page->mutex.lock();
  EXPECT_EQ(page->mutex.owner(), getpid());
  page->mutex.unlock();
  // And it works as before afterwards.
  page->mutex.lock();
  page->mutex.unlock();
  EXPECT_EQ(page->mutex.owner(), 0);
}

TEST(SharedMutex, AnOwnerThatIsAZombieCountsAsDead) {
  Watchdog watchdog(30);
  SharedPage page;
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    page->mutex.lock();
    _exit(0);
  }
  // Exited but not reaped: kill(pid, 0) still succeeds for it.
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT), 0);
  ASSERT_EQ(kill(child, 0), 0);
  EXPECT_EQ(page->mutex.owner(), child);
  page->mutex.lock();
  EXPECT_EQ(page->mutex.owner(), getpid());
  page->mutex.unlock();
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
}

TEST(SharedMutex, WaitersThatSleptAreAllWokenInTurn) {
  Watchdog watchdog(30);
  SharedPage page;
  page->mutex.lock();
  constexpr int kWaiters = 3;
  pid_t children[kWaiters];
  for (pid_t& child : children) {
    child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      page->mutex.lock();
      ++page->counter;
      page->mutex.unlock();
      _exit(0);
    }
  }
  usleep(100 * 1000);  // all three past their spins, asleep on the futex
  EXPECT_EQ(page->counter, 0u);
  page->mutex.unlock();
  for (pid_t child : children) {
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  EXPECT_EQ(page->counter, uint64_t{kWaiters});
  EXPECT_EQ(page->mutex.owner(), 0);
}

}  // namespace
}  // namespace softverbs
