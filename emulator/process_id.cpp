#include "process_id.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>

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

bool process_alive(pid_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

}  // namespace softverbs
