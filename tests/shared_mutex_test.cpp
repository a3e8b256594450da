// The locks that the shared-memory structures of a device use, between real
// processes: exclusion, sleeping waiters, and owners that die holding them;
// and the read-mostly lock of the MR table, whose readers in different
// processes do not exclude each other.
#include "device/shared_mutex.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <new>
#include <vector>

#include "task_state.h"

namespace softverbs {
namespace {

struct SharedState {
  SharedMutex mutex;
  uint64_t counter = 0;  // updated without atomics: only the lock keeps it right
  uint32_t inside = 0;
  uint32_t overlaps = 0;
  std::atomic<uint32_t> stage{0};
};

// Zeroed memory that a fork() shares, as a device memory file is shared,
// holding a `State` whose `mutex` is initialized.
template <typename State>
class SharedPage {
 public:
  SharedPage() {
    void* memory = mmap(nullptr, sizeof(State), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) throw std::bad_alloc();
    state_ = new (memory) State;
    state_->mutex.initialize();
  }
  ~SharedPage() { munmap(state_, sizeof(State)); }
  SharedPage(const SharedPage&) = delete;
  SharedPage& operator=(const SharedPage&) = delete;
  State& operator*() const { return *state_; }
  State* operator->() const { return state_; }

 private:
  State* state_ = nullptr;
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
  SharedPage<SharedState> page;
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
  SharedPage<SharedState> page;
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
  SharedPage<SharedState> page;
  pid_t child = child_that_dies_holding(page->mutex);
  ASSERT_GT(child, 0);
  expect_clean_exit(child);
  expect_taken_over(page->mutex, child);
}

TEST(SharedMutex, AnOwnerThatIsAZombieCountsAsDead) {
  Watchdog watchdog(30);
  SharedPage<SharedState> page;
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
  SharedPage<SharedState> page;
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
  for (pid_t child : children)
    ASSERT_TRUE(test::wait_until_sleeping_in_futex(child, [] { return false; })) << "past its spin, asleep";
  EXPECT_EQ(page->counter, 0u);
  page->mutex.unlock();
  for (pid_t child : children) expect_clean_exit(child);
  EXPECT_EQ(page->counter, uint64_t{kWaiters});
  EXPECT_EQ(page->mutex.owner(), 0);
}

// ---- ReadMostlyMutex --------------------------------------------------------

struct SharedReadMostly {
  ReadMostlyMutex mutex;
  std::atomic<uint32_t> readers_inside{0};
  std::atomic<uint32_t> most_inside{0};
  std::atomic<uint32_t> readers_done{0};
  std::atomic<uint32_t> entered{0};
};

using SharedReadMostlyPage = SharedPage<SharedReadMostly>;

TEST(ReadMostlyMutex, ReadersOfTwoProcessesHoldItTogetherAndAWriterWaitsForBoth) {
  Watchdog watchdog(30);
  SharedReadMostlyPage page;
  pid_t children[2];
  for (pid_t& child : children) {
    child = run_in_child([&] {
      SharedLock lock(page->mutex.reader(page->mutex.claim(getpid())));
      const uint32_t inside = page->readers_inside.fetch_add(1) + 1;
      uint32_t most = page->most_inside.load();
      while (inside > most && !page->most_inside.compare_exchange_weak(most, inside)) {
      }
      // Both inside before either leaves (or the watchdog ends the test),
      // and the writer (the test's main thread) asleep waiting for them.
      while (page->most_inside.load() < 2) usleep(100);
      test::wait_until_sleeping_in_futex(getppid(), [] { return false; });
      page->readers_inside.fetch_sub(1);
      page->readers_done.fetch_add(1);
    });
    ASSERT_GT(child, 0);
  }
  while (page->most_inside.load() < 2) usleep(100);
  {
    ExclusiveLock lock(page->mutex);
    EXPECT_EQ(page->readers_done.load(), 2u) << "the writer got in while readers held their slots";
    EXPECT_EQ(page->readers_inside.load(), 0u);
  }
  for (pid_t child : children) expect_clean_exit(child);
}

TEST(ReadMostlyMutex, AWriterKeepsEveryReaderOut) {
  Watchdog watchdog(30);
  SharedReadMostlyPage page;
  page->mutex.lock();
  pid_t child = run_in_child([&] {
    SharedLock lock(page->mutex.reader(page->mutex.claim(getpid())));
    page->entered.fetch_add(1);
  });
  ASSERT_GT(child, 0);
  EXPECT_TRUE(test::wait_until_sleeping_in_futex(child, [&] { return page->entered.load() != 0; }))
      << "the reader waits for the writer";
  EXPECT_EQ(page->entered.load(), 0u) << "a reader got in while the writer held the lock";
  page->mutex.unlock();
  expect_clean_exit(child);
  EXPECT_EQ(page->entered.load(), 1u);
}

TEST(ReadMostlyMutex, AReaderThatDiedHoldingItsSlotIsTakenOverByAWriter) {
  Watchdog watchdog(30);
  SharedReadMostlyPage page;
  pid_t child = run_in_child([&] { page->mutex.reader(page->mutex.claim(getpid())).lock(); });
  ASSERT_GT(child, 0);
  expect_clean_exit(child);
  page->mutex.lock();
  page->mutex.unlock();
  // And its slot goes to the next process that asks.
  SharedLock lock(page->mutex.reader(page->mutex.claim(getpid())));
}

TEST(ReadMostlyMutex, EachProcessClaimsItsOwnSlotAndExitedOwnersSlotsAreReused) {
  SharedReadMostlyPage page;
  const size_t mine = page->mutex.claim(getpid());
  EXPECT_EQ(page->mutex.claim(getpid()), mine);
  pid_t child = run_in_child([] {});
  ASSERT_GT(child, 0);
  expect_clean_exit(child);  // reaped: its pid names no process now
  const size_t exited = page->mutex.claim(child);
  EXPECT_NE(exited, mine);
  // Every other slot but the last taken by that same exited process's pid
  // cannot be told apart, so fill them with the pids of more exited children.
  std::vector<pid_t> gone;
  for (size_t i = 0; i + 3 < ReadMostlyMutex::kSlots; ++i) {
    pid_t next = run_in_child([] {});
    ASSERT_GT(next, 0);
    expect_clean_exit(next);
    gone.push_back(next);
    const size_t slot = page->mutex.claim(next);
    EXPECT_NE(slot, mine);
    EXPECT_NE(slot, ReadMostlyMutex::kSlots - 1) << "the shared last slot given while others were free";
  }
  // All but the last are taken now; a new process gets one whose owner exited.
  pid_t fresh = run_in_child([] { pause(); });
  ASSERT_GT(fresh, 0);
  const size_t reused = page->mutex.claim(fresh);
  EXPECT_NE(reused, mine);
  EXPECT_NE(reused, ReadMostlyMutex::kSlots - 1);
  kill(fresh, SIGKILL);
  waitpid(fresh, nullptr, 0);
  EXPECT_EQ(page->mutex.claim(getpid()), mine);
}

}  // namespace
}  // namespace softverbs
