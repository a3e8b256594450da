#include "process_id.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>

namespace softverbs {

namespace {

std::atomic<pid_t> cached{0};

void forget_after_fork() { cached.store(0, std::memory_order_relaxed); }

}  // namespace

pid_t current_pid() {
  pid_t pid = cached.load(std::memory_order_relaxed);
  if (pid != 0) return pid;
  static const bool registered = [] { return pthread_atfork(nullptr, nullptr, forget_after_fork) == 0; }();
  (void)registered;
  pid = getpid();
  cached.store(pid, std::memory_order_relaxed);
  return pid;
}

}  // namespace softverbs
