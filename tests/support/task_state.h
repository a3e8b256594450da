// Which system call a thread or process sleeps in, as /proc shows it: how
// a test waits for "it is blocked now" instead of sleeping and hoping.
#pragma once

#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <fstream>
#include <string>

namespace softverbs::test {

// True while task `tid` (a thread id, or a process's pid for its main
// thread) is in system call `number` (SYS_futex, SYS_recvmsg, ...).
inline bool sleeps_in(pid_t tid, long number) {
  std::ifstream syscall("/proc/" + std::to_string(tid) + "/syscall");
  std::string first;  // the call's number, or "running"
  return syscall >> first && first == std::to_string(number);
}

// True while `tid` is in futex(2): waiting on a mutex or a condition
// variable (std:: or pthread, in one process or across) is this.
inline bool sleeps_in_futex(pid_t tid) { return sleeps_in(tid, SYS_futex); }

// Polls until `tid` sleeps in system call `number` or `done()` holds (it
// finished instead), for up to 10 s; whether it sleeps.
template <typename Done>
bool wait_until_sleeping_in(pid_t tid, long number, Done done) {
  for (int i = 0; i < 10000; ++i) {
    if (sleeps_in(tid, number)) return true;
    if (done()) return false;
    usleep(1000);
  }
  return false;
}

template <typename Done>
bool wait_until_sleeping_in_futex(pid_t tid, Done done) {
  return wait_until_sleeping_in(tid, SYS_futex, done);
}

}  // namespace softverbs::test
