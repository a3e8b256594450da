// Wakes a context's delayed sends (RNR, a peer not ready yet) while the
// application makes no verbs call: a timer on the background runtime, so
// that a program blocked in ibv_get_cq_event still sees such a send end.
#pragma once

#include <chrono>
#include <functional>
#include <memory>

namespace softverbs {

class RetryTimer {
 public:
  using Clock = std::chrono::steady_clock;
  // `pass` retries what is due and returns when the next retry is
  // (time_point::max() if none); it runs on the runtime's thread.
  explicit RetryTimer(std::function<Clock::time_point()> pass);
  // Returns once no pass is running.
  ~RetryTimer();
  RetryTimer(const RetryTimer&) = delete;
  RetryTimer& operator=(const RetryTimer&) = delete;

  // Asks for a pass at `when` (or at the earliest time already asked), not
  // sooner than 1 ms from now: the application's polls handle finer timers.
  void schedule(Clock::time_point when);

  struct State;  // shared with the pending timer's handler

 private:
  std::shared_ptr<State> state_;
};

}  // namespace softverbs
