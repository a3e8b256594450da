// For the _exit() and _Exit() that softverbs' preload libraries interpose:
// each does its own work first (_exit runs no atexit handler) and passes on
// to the next definition, glibc's last. Header only: the tracer links
// nothing of softverbs.
#pragma once

#include <dlfcn.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <thread>

namespace softverbs::leaving {

using ExitFunction = void (*)(int);

// Call from a constructor of the interposing library, before anything can
// fork: dlsym in a child could wait for the loader's lock that another
// thread of the parent held.
inline ExitFunction find_next_exit() { return reinterpret_cast<ExitFunction>(dlsym(RTLD_NEXT, "_exit")); }

[[noreturn]] inline void pass_on(ExitFunction next, int status) {
  if (next != nullptr) next(status);
  for (;;) syscall(SYS_exit_group, status);
}

// `mutex`, locked, unless it stays taken for 20 ms: another thread's hold
// ends within microseconds, one that lasts is this thread's own, interrupted
// by a handler that exits.
template <typename Mutex>
std::unique_lock<Mutex> lock_unless_stuck(Mutex& mutex) {
  std::unique_lock guard(mutex, std::try_to_lock);
  for (int tries = 0; !guard.owns_lock() && tries < 200; ++tries) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    static_cast<void>(guard.try_lock());
  }
  return guard;
}

}  // namespace softverbs::leaving
