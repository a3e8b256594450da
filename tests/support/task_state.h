// Whether a thread or process sleeps in a futex wait, as /proc shows it: how
// a test waits for "it is blocked now" instead of sleeping and hoping.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <fstream>
#include <string>

namespace softverbs::test {

// True while task `tid` (a thread id, or a process's pid for its main
// thread) is in futex(2); syscall 202 on x86-64. Waiting on a mutex or a
// condition variable (std:: or pthread, in one process or across) is this.
inline bool sleeps_in_futex(pid_t tid) {
  std::ifstream syscall("/proc/" + std::to_string(tid) + "/syscall");
  std::string number;
  return syscall >> number && number == "202";
}

// Polls until `tid` sleeps in a futex wait or `done()` holds (it finished
// instead), for up to 10 s; whether it sleeps.
template <typename Done>
bool wait_until_sleeping_in_futex(pid_t tid, Done done) {
  for (int i = 0; i < 10000; ++i) {
    if (sleeps_in_futex(tid)) return true;
    if (done()) return false;
    usleep(1000);
  }
  return false;
}

}  // namespace softverbs::test
