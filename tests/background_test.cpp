// The background runtime: timers fire on its thread while the caller waits,
// and a forked child gets a runtime of its own.
#include "support/background.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <future>
#include <thread>

namespace softverbs {
namespace {

using namespace std::chrono_literals;

// Fires a timer on the runtime; true if its handler ran, on another thread.
bool timer_fires_on_the_runtime() {
  boost::asio::steady_timer timer(background::io_context(), 5ms);
  std::promise<std::thread::id> fired;
  timer.async_wait([&](const boost::system::error_code& error) {
    if (!error) fired.set_value(std::this_thread::get_id());
  });
  std::future<std::thread::id> ran_on = fired.get_future();
  if (ran_on.wait_for(10s) != std::future_status::ready) return false;
  return ran_on.get() != std::this_thread::get_id();
}

TEST(Background, ATimerFiresWhileTheCallerWaits) { EXPECT_TRUE(timer_fires_on_the_runtime()); }

TEST(Background, TheSameIoContextServesEveryCaller) { EXPECT_EQ(&background::io_context(), &background::io_context()); }

TEST(Background, AForkedChildRunsARuntimeOfItsOwn) {
#if defined(__SANITIZE_ADDRESS__)
  // GCC 12's ASan allocator takes no lock around fork(): the child's new
  // runtime thread can wait forever on an allocator lock that the parent's
  // runtime thread held at that moment (seen: a futex in
  // SizeClassAllocator64::GetFromAllocator). The release build runs it.
  GTEST_SKIP() << "fork() with threads is not safe under this ASan";
#endif
  boost::asio::io_context& parents = background::io_context();
  const uint64_t parent_generation = background::generation();
  // A timer pending in the parent at fork() belongs to the parent.
  boost::asio::steady_timer pending(parents, 200ms);
  pending.async_wait([](const boost::system::error_code&) {});
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    bool fresh = background::generation() != parent_generation && &background::io_context() != &parents;
    bool fires = timer_fires_on_the_runtime();
    _exit(fresh && fires ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(background::generation(), parent_generation);
  EXPECT_TRUE(timer_fires_on_the_runtime());  // the parent's runtime goes on
  pending.cancel();
}

}  // namespace
}  // namespace softverbs
