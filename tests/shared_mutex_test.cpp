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

// Runs `body` in a forked child, which then exits 0; returns the child's pid.
template <typename Body>
pid_t run_in_child(Body body) {
  pid_t child = fork();
  if (child == 0) {
    body();
    _exit(0);
  }
  return child;
}

void expect_clean_exit(pid_t child) {
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

// A child that takes the lock and exits without giving it back.
pid_t child_that_dies_holding(SharedMutex& mutex) {
  return run_in_child([&] { mutex.lock(); });
}

// Takes the lock that `dead` left held, then checks that it works as before.
void expect_taken_over(SharedMutex& mutex, pid_t dead) {
  EXPECT_EQ(mutex.owner(), dead);
  mutex.lock();
  EXPECT_EQ(mutex.owner(), getpid());
  mutex.unlock();
  mutex.lock();
  mutex.unlock();
  EXPECT_EQ(mutex.owner(), 0);
}

TEST(SharedMutex, KeepsProcessesOutOfEachOthersCriticalSections) {
  Watchdog watchdog(60);
  SharedPage page;
  constexpr int kProcesses = 4;
  constexpr int kRounds = 20000;
  pid_t children[kProcesses];
  for (pid_t& child : children) {
    child = run_in_child([&] {
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
    });
    ASSERT_GT(child, 0);
  }
  for (pid_t child : children) expect_clean_exit(child);
  EXPECT_EQ(page->overlaps, 0u);
  EXPECT_EQ(page->counter, uint64_t{kProcesses} * kRounds);
  EXPECT_EQ(page->mutex.owner(), 0);
}

TEST(SharedMutex, AWaiterSleepsUntilTheLiveHolderUnlocks) {
  Watchdog watchdog(30);
  SharedPage page;
  pid_t child = run_in_child([&] {
    page->mutex.lock();
    page->stage.store(1, std::memory_order_release);
    // Held across many of the waiter's owner checks: a live owner keeps it.
    usleep(200 * 1000);
    page->stage.store(2, std::memory_order_release);
    page->mutex.unlock();
  });
  ASSERT_GT(child, 0);
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
  expect_clean_exit(child);
}

TEST(SharedMutex, ALockWhoseOwnerDiedIsTakenOver) {
  Watchdog watchdog(30);
  SharedPage page;
  pid_t child = child_that_dies_holding(page->mutex);
  ASSERT_GT(child, 0);
  expect_clean_exit(child);
  expect_taken_over(page->mutex, child);
}

TEST(SharedMutex, AnOwnerThatIsAZombieCountsAsDead) {
  Watchdog watchdog(30);
  SharedPage page;
  pid_t child = child_that_dies_holding(page->mutex);
  ASSERT_GT(child, 0);
  // Exited but not reaped: kill(pid, 0) still succeeds for it.
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT), 0);
  ASSERT_EQ(kill(child, 0), 0);
  expect_taken_over(page->mutex, child);
  expect_clean_exit(child);
}

TEST(SharedMutex, WaitersThatSleptAreAllWokenInTurn) {
  Watchdog watchdog(30);
  SharedPage page;
  page->mutex.lock();
  constexpr int kWaiters = 3;
  pid_t children[kWaiters];
  for (pid_t& child : children) {
    child = run_in_child([&] {
      SharedLock lock(page->mutex);
      ++page->counter;
    });
    ASSERT_GT(child, 0);
  }
  usleep(100 * 1000);  // all three past their spins, asleep on the futex
  EXPECT_EQ(page->counter, 0u);
  page->mutex.unlock();
  for (pid_t child : children) expect_clean_exit(child);
  EXPECT_EQ(page->counter, uint64_t{kWaiters});
  EXPECT_EQ(page->mutex.owner(), 0);
}

}  // namespace
}  // namespace softverbs
