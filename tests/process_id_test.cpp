// The thread facts the UDP engine asks the kernel for: whose thread posted,
// and whether that thread only waits for a CPU. Real threads, pinned to real
// CPUs, read back through /proc.
#include "support/process_id.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

namespace softverbs {
namespace {

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  return cpus;
}

// The state letter /proc gives thread `tid` of this process ('R', 'S', ...).
char thread_state(pid_t tid) {
  std::ifstream stat("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  return close != std::string::npos && close + 2 < text.size() ? text[close + 2] : '?';
}

bool pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return sched_setaffinity(0, sizeof set, &set) == 0;
}

// Each test runs on the first CPU it may use (cpus_[0]) and is put back
// on all of them when it ends.
class ThreadWaits : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(sched_getaffinity(0, sizeof saved_, &saved_), 0);
    cpus_ = allowed_cpus();
    ASSERT_FALSE(cpus_.empty());
    ASSERT_TRUE(pin_to(cpus_[0]));
  }
  void TearDown() override { sched_setaffinity(0, sizeof saved_, &saved_); }

  std::vector<int> cpus_;

 private:
  cpu_set_t saved_{};
};

// A thread pinned to `cpu` that spins until told to stop.
class Spinner {
 public:
  explicit Spinner(int cpu)
      : thread_([this, cpu] {
          pinned_ = pin_to(cpu);
          id_.store(current_thread_id());
          while (!stop_.load()) {
          }
        }) {
    while (id_.load() == 0) sched_yield();  // lets it start where it shares our CPU
  }
  ~Spinner() {
    stop_.store(true);
    thread_.join();
  }
  pid_t id() const { return id_.load(); }
  bool pinned() const { return pinned_; }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<pid_t> id_{0};
  bool pinned_ = false;
  std::thread thread_;
};

TEST(ProcessId, ThreadIdIsTheKernelsOwnInEveryThreadAndAfterFork) {
  const pid_t main_id = current_thread_id();
  EXPECT_EQ(main_id, gettid());
  EXPECT_EQ(current_thread_id(), main_id);  // the cached value
  pid_t other_id = 0, other_kernel_id = 0;
  std::thread([&] {
    other_id = current_thread_id();
    other_kernel_id = gettid();
  }).join();
  EXPECT_EQ(other_id, other_kernel_id);
  EXPECT_NE(other_id, main_id);

  // The forking thread had its id cached: the child's must be its own.
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(current_thread_id() == gettid() && current_pid() == getpid() ? 0 : 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child saw its parent's ids";
}

// The case the UDP engine looks for: its io thread took the core of the
// application's thread, which is ready to run and waits for it.
TEST_F(ThreadWaits, AThreadReadyToRunOnThisCpuWaitsForIt) {
  Spinner spinner(cpus_[0]);
  ASSERT_TRUE(spinner.pinned());
  // While this thread runs on the one CPU they share, the spinner cannot.
  EXPECT_TRUE(thread_waits_for_this_cpu(spinner.id()));
}

TEST_F(ThreadWaits, AThreadRunningOnAnotherCpuDoesNot) {
  if (cpus_.size() < 2) GTEST_SKIP() << "needs two CPUs";
  Spinner spinner(cpus_[1]);
  ASSERT_TRUE(spinner.pinned());
  EXPECT_FALSE(thread_waits_for_this_cpu(spinner.id()));
}

TEST_F(ThreadWaits, ASleepingThreadDoesNot) {
  int wake[2];
  ASSERT_EQ(pipe(wake), 0);
  std::atomic<pid_t> id{0};
  std::thread sleeper([&] {
    pin_to(cpus_[0]);
    id.store(current_thread_id());
    char byte;
    (void)!read(wake[0], &byte, 1);  // sleeps here until written
  });
  while (id.load() == 0) sched_yield();
  // Into its read (on a busy machine that may take a while).
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (thread_state(id.load()) != 'S' && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(thread_state(id.load()), 'S');
  EXPECT_FALSE(thread_waits_for_this_cpu(id.load()));
  ASSERT_EQ(write(wake[1], "x", 1), 1);
  sleeper.join();
  close(wake[0]);
  close(wake[1]);
}

TEST(ThreadWaitsForThisCpu, NoSuchThreadDoesNot) {
  pid_t gone = 0;
  std::thread([&] { gone = current_thread_id(); }).join();
  EXPECT_FALSE(thread_waits_for_this_cpu(gone));
  EXPECT_FALSE(thread_waits_for_this_cpu(0));
  EXPECT_FALSE(thread_waits_for_this_cpu(-1));
}

}  // namespace
}  // namespace softverbs
