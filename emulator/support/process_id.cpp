#include "support/process_id.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace softverbs {

namespace {

std::atomic<pid_t> cached{0};
thread_local pid_t cached_thread_id = 0;

// Runs in the child's only thread, the one that forked.
void forget_after_fork() {
  cached.store(0, std::memory_order_relaxed);
  cached_thread_id = 0;
}

// Has forget_after_fork run in every child forked from now on.
void forget_ids_in_children() {
  static const bool registered = [] { return pthread_atfork(nullptr, nullptr, forget_after_fork) == 0; }();
  (void)registered;
}

}  // namespace

pid_t current_pid() {
  pid_t pid = cached.load(std::memory_order_relaxed);
  if (pid != 0) return pid;
  forget_ids_in_children();
  pid = getpid();
  cached.store(pid, std::memory_order_relaxed);
  return pid;
}

pid_t current_thread_id() {
  if (cached_thread_id != 0) return cached_thread_id;
  forget_ids_in_children();
  cached_thread_id = gettid();
  return cached_thread_id;
}

bool thread_waits_for_this_cpu(pid_t tid) {
  if (tid <= 0) return false;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/self/task/%d/stat", static_cast<int>(tid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char text[1024];
  const ssize_t length = ::read(fd, text, sizeof text - 1);
  ::close(fd);
  if (length <= 0) return false;
  text[length] = '\0';
  // "tid (comm) state ppid ..." where comm may hold spaces and parentheses:
  // the fields are counted from the last ')'. Field 3 is the state ('R':
  // running or ready to run), field 39 the CPU it last ran on, which for a
  // ready task is the CPU whose queue it waits in.
  const char* field = std::strrchr(text, ')');  // the end of field 2
  if (field == nullptr) return false;
  char state = '\0';
  for (int number = 3; number <= 39; ++number) {  // on to the start of field `number`
    field = std::strchr(field, ' ');
    if (field == nullptr) return false;
    ++field;
    if (number == 3) state = *field;
  }
  const int cpu = std::atoi(field);
  return state == 'R' && cpu == sched_getcpu();
}

bool process_alive(pid_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

}  // namespace softverbs
