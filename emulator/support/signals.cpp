#include "support/signals.h"

#include <pthread.h>
#include <signal.h>

namespace softverbs {

void block_signals_on_this_thread() {
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
}

bool interrupted_reads_restart() {
  for (int signal = 1; signal < NSIG; ++signal) {
    // Faults arrive on the thread that caused them, never in a wait.
    if (signal == SIGSEGV || signal == SIGBUS || signal == SIGILL || signal == SIGFPE || signal == SIGTRAP ||
        signal == SIGSYS)
      continue;
    struct sigaction action {};
    if (sigaction(signal, nullptr, &action) != 0) continue;
    const bool handled = (action.sa_flags & SA_SIGINFO) != 0
                             ? action.sa_sigaction != nullptr
                             : action.sa_handler != SIG_DFL && action.sa_handler != SIG_IGN;
    if (handled && (action.sa_flags & SA_RESTART) == 0) return false;
  }
  return true;
}

}  // namespace softverbs
