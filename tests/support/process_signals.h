// Signals as a timer or another process sends them, for tests of blocking
// calls that a signal's handler must interrupt (or must not).
#pragma once

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

namespace softverbs::test {

// Signals the process (as setitimer's SIGALRM does, not one thread) every
// 50 ms from a thread that blocks signals, until destroyed; once `backstop`
// has passed it runs `last_resort` instead, once, so that a wait the
// signals failed to end ends.
class ProcessSignaller {
 public:
  ProcessSignaller(int signal, std::chrono::milliseconds backstop, std::function<void()> last_resort)
      : thread_([this, signal, backstop, last_resort = std::move(last_resort)] {
          sigset_t all;
          sigfillset(&all);
          pthread_sigmask(SIG_BLOCK, &all, nullptr);
          const auto start = std::chrono::steady_clock::now();
          bool resorted = false;
          while (!stop_.load()) {
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
            if (std::chrono::steady_clock::now() - start < backstop) {
              kill(getpid(), signal);
            } else if (!resorted) {
              resorted = true;
              last_resort();
            }
          }
        }) {}
  ~ProcessSignaller() {
    stop_.store(true);
    thread_.join();
  }
  ProcessSignaller(const ProcessSignaller&) = delete;
  ProcessSignaller& operator=(const ProcessSignaller&) = delete;

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// SIGALRM's handler while this lives, with or without SA_RESTART; it
// counts the signals handled.
class AlarmHandler {
 public:
  explicit AlarmHandler(bool restart) {
    handled().store(0);
    struct sigaction action {};
    action.sa_handler = [](int) { handled().fetch_add(1); };
    action.sa_flags = restart ? SA_RESTART : 0;
    sigemptyset(&action.sa_mask);
    sigaction(SIGALRM, &action, &previous_);
  }
  ~AlarmHandler() { sigaction(SIGALRM, &previous_, nullptr); }
  AlarmHandler(const AlarmHandler&) = delete;
  AlarmHandler& operator=(const AlarmHandler&) = delete;

  int count() const { return handled().load(); }

 private:
  static std::atomic<int>& handled() {
    static std::atomic<int> alarms{0};
    return alarms;
  }
  struct sigaction previous_ {};
};

}  // namespace softverbs::test
