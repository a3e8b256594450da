#include "verbs/retry_timer.h"

#include <pthread.h>

#include <algorithm>
#include <boost/asio/steady_timer.hpp>
#include <mutex>

#include "support/background.h"

namespace softverbs {

namespace {

constexpr auto kMinimumInterval = std::chrono::milliseconds(1);

// One lock for every context's passes and timers, held across fork() so that
// a child never inherits a pass half done.
std::mutex& passes_lock() {
  static std::mutex* lock = [] {
    auto* made = new std::mutex;  // NOLINT: lives as long as the process, as the runtime's thread
    pthread_atfork([] { passes_lock().lock(); }, [] { passes_lock().unlock(); },
                   [] { new (&passes_lock()) std::mutex; });
    return made;
  }();
  return *lock;
}

}  // namespace

struct RetryTimer::State {
  std::function<Clock::time_point()> pass;  // empty once the owner is gone
  std::unique_ptr<boost::asio::steady_timer> timer;
  uint64_t generation = 0;  // the runtime's, when `timer` was made
  Clock::time_point armed_for = Clock::time_point::max();
};

namespace {

void arm_locked(const std::shared_ptr<RetryTimer::State>& state, RetryTimer::Clock::time_point when);

void fire(const std::shared_ptr<RetryTimer::State>& state, const boost::system::error_code& error) {
  if (error) return;  // re-armed, or its owner is gone
  std::lock_guard guard(passes_lock());
  if (!state->pass) return;
  state->armed_for = RetryTimer::Clock::time_point::max();
  const RetryTimer::Clock::time_point next = state->pass();
  if (next != RetryTimer::Clock::time_point::max()) arm_locked(state, next);
}

void arm_locked(const std::shared_ptr<RetryTimer::State>& state, RetryTimer::Clock::time_point when) {
  const uint64_t generation = background::generation();
  if (state->timer && state->generation != generation) background::abandon(std::move(state->timer));
  if (!state->timer) {
    state->timer = std::make_unique<boost::asio::steady_timer>(background::io_context());
    state->generation = generation;
  }
  state->armed_for = std::max(when, RetryTimer::Clock::now() + kMinimumInterval);
  state->timer->expires_at(state->armed_for);
  state->timer->async_wait([state](const boost::system::error_code& error) { fire(state, error); });
}

}  // namespace

RetryTimer::RetryTimer(std::function<Clock::time_point()> pass) : state_(std::make_shared<State>()) {
  state_->pass = std::move(pass);
}

RetryTimer::~RetryTimer() {
  std::lock_guard guard(passes_lock());
  state_->pass = nullptr;
  if (!state_->timer) return;
  if (state_->generation != background::generation())
    background::abandon(std::move(state_->timer));
  else
    state_->timer->cancel();
}

void RetryTimer::schedule(Clock::time_point when) {
  std::lock_guard guard(passes_lock());
  // In a forked child, what was armed is the parent's.
  if (when >= state_->armed_for && state_->generation == background::generation()) return;
  arm_locked(state_, when);
}

}  // namespace softverbs
