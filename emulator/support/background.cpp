#include "support/background.h"

#include <pthread.h>
#include <sys/prctl.h>

#include <boost/asio/executor_work_guard.hpp>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "support/signals.h"

namespace softverbs::background {

namespace {

using WorkGuard = boost::asio::executor_work_guard<boost::asio::io_context::executor_type>;

struct Runtime {
  std::mutex mutex;
  boost::asio::io_context* io = nullptr;  // never destroyed: see abandon()
  WorkGuard* keep_running = nullptr;
  bool thread_started = false;
  uint64_t generation = 0;
  std::vector<void*> abandoned;  // reachable, so that leak checkers see no leak
};

// Never destroyed: the detached thread runs until the process ends.
Runtime& runtime() {
  static Runtime* instance = new Runtime;  // NOLINT: intentionally leaked singleton
  return *instance;
}

void run(boost::asio::io_context* io) {
  block_signals_on_this_thread();
  prctl(PR_SET_NAME, "softverbs-bg");
  io->run();
}

void before_fork() { runtime().mutex.lock(); }
void in_parent_after_fork() { runtime().mutex.unlock(); }
void in_child_after_fork() {
  Runtime& r = runtime();
  // The lock is this thread's (before_fork took it); a fresh one is simpler
  // than reasoning about an inherited owner.
  new (&r.mutex) std::mutex;
  if (r.io != nullptr) {
    r.abandoned.push_back(r.io);
    r.abandoned.push_back(r.keep_running);
  }
  r.io = nullptr;
  r.keep_running = nullptr;
  r.thread_started = false;
  ++r.generation;
}

}  // namespace

boost::asio::io_context& io_context() {
  Runtime& r = runtime();
  static const bool fork_handled = [] {
    return pthread_atfork(before_fork, in_parent_after_fork, in_child_after_fork) == 0;
  }();
  (void)fork_handled;
  std::lock_guard guard(r.mutex);
  if (r.io == nullptr) {
    r.io = new boost::asio::io_context(1);  // NOLINT: lives for the process (or is abandoned in a child)
    r.keep_running = new WorkGuard(boost::asio::make_work_guard(*r.io));  // NOLINT: as the io_context
  }
  if (!r.thread_started) {
    r.thread_started = true;
    std::thread(run, r.io).detach();
  }
  return *r.io;
}

uint64_t generation() {
  Runtime& r = runtime();
  std::lock_guard guard(r.mutex);
  return r.generation;
}

void abandon_raw(void* object) {
  if (object == nullptr) return;
  Runtime& r = runtime();
  std::lock_guard guard(r.mutex);
  r.abandoned.push_back(object);
}

}  // namespace softverbs::background
