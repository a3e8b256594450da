#include "progress_thread.h"

#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>

namespace softverbs::provider {

namespace {

constexpr auto kMinimumInterval = std::chrono::milliseconds(1);

class ProgressThread {
 public:
  ProgressThread() {
    // The thread does not survive fork(): a child starts its own.
    pthread_atfork([] { progress_thread_instance().mutex_.lock(); }, [] { progress_thread_instance().mutex_.unlock(); },
                   [] {
                     ProgressThread& self = progress_thread_instance();
                     self.started_ = false;
                     self.next_ = ProgressClock::time_point::max();
                     self.mutex_.unlock();
                   });
  }
  static ProgressThread& progress_thread_instance();

  void add(ContextState* context) {
    std::lock_guard guard(mutex_);
    contexts_.insert(context);
  }

  void remove(ContextState* context) {
    std::lock_guard guard(mutex_);  // a running pass holds the mutex
    contexts_.erase(context);
  }

  void schedule(ProgressClock::time_point when) {
    std::lock_guard guard(mutex_);
    if (when >= next_) return;
    next_ = std::max(when, ProgressClock::now() + kMinimumInterval);
    if (!started_) {
      started_ = true;
      std::thread([this] { run(); }).detach();
    }
    wake_.notify_one();
  }

 private:
  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      if (next_ == ProgressClock::time_point::max())
        wake_.wait(lock);
      else
        wake_.wait_until(lock, next_);
      if (ProgressClock::now() < next_) continue;
      next_ = ProgressClock::time_point::max();
      ProgressClock::time_point earliest = ProgressClock::time_point::max();
      for (ContextState* context : contexts_) earliest = std::min(earliest, progress_deferred_sends(*context));
      if (earliest != ProgressClock::time_point::max())
        next_ = std::max(earliest, ProgressClock::now() + kMinimumInterval);
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::set<ContextState*> contexts_;
  ProgressClock::time_point next_ = ProgressClock::time_point::max();
  bool started_ = false;
};

ProgressThread& ProgressThread::progress_thread_instance() {
  // Never destroyed: the detached thread may outlive static destruction.
  static ProgressThread* thread = new ProgressThread;  // NOLINT: intentionally leaked singleton
  return *thread;
}

ProgressThread& progress_thread() { return ProgressThread::progress_thread_instance(); }

}  // namespace

void register_for_progress(ContextState* context) { progress_thread().add(context); }
void unregister_from_progress(ContextState* context) { progress_thread().remove(context); }
void schedule_progress(ProgressClock::time_point when) { progress_thread().schedule(when); }

}  // namespace softverbs::provider
