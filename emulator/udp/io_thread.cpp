// The io thread: one per device and process, blocked in Asio's reactor on
// its timerfd and (while it watches) the epoll set of every socket. While
// the application is in verbs calls, the calls do the work and this thread
// stays out of their way; once the application stops calling (or waits for
// CQ events), the thread reads and answers for it.
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <cstdlib>
#include <cstring>

#include "support/process_id.h"
#include "support/signals.h"
#include "udp/engine.h"

namespace softverbs::udp {

using namespace parameters;

void PortEngine::run_thread() {
  block_signals_on_this_thread();
  pthread_setname_np(pthread_self(), "softverbs-udp");
  // Its timers are microseconds apart (takeover, held ACKs): without this
  // the kernel may fire them up to 50 us late (the default timer slack).
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  io_.run();
}

// ---- watching the sockets ---------------------------------------------------------------

void PortEngine::start_watching() {
  if (!ready_waiter_) {
    int fd = ::dup(ready_set_.get());
    if (fd < 0) return;  // the timer still brings the io thread back
    ready_waiter_.emplace(io_, fd);
  }
  watching_.store(true, std::memory_order_relaxed);
  watch();
}

void PortEngine::stop_watching() {
  watching_.store(false, std::memory_order_relaxed);
  ++watch_generation_;
  // Out of Asio's epoll set too: a registered descriptor wakes the io
  // thread on every packet, even with no wait queued.
  ready_waiter_.reset();
}

void PortEngine::watch() {
  // One wait at a time: a completion that was already queued when watching
  // stopped (and started again) belongs to an old generation. The next
  // wait is queued before the sockets are read: Asio's registration is
  // edge-triggered, so a packet that arrived between the reading and a
  // later wait would not wake this thread.
  ready_waiter_->async_wait(boost::asio::posix::descriptor_base::wait_read,
                            [this, generation = watch_generation_](const boost::system::error_code& error) {
                              if (error || generation != watch_generation_) return;
                              watch();
                              io_check();
                            });
}

// ---- the timer and wake-ups ---------------------------------------------------------------

void PortEngine::arm_timer(Clock::time_point when) {
  std::lock_guard guard(timer_mutex_);
  if (when.time_since_epoch().count() >= armed_.load(std::memory_order_relaxed)) return;
  armed_.store(when.time_since_epoch().count(), std::memory_order_relaxed);
  const auto since_epoch = std::chrono::duration_cast<std::chrono::nanoseconds>(when.time_since_epoch()).count();
  itimerspec due{};
  // Zero would disarm it: a deadline at the clock's origin is long past.
  due.it_value.tv_sec = static_cast<time_t>(since_epoch / 1'000'000'000);
  due.it_value.tv_nsec = std::max<long>(1, static_cast<long>(since_epoch % 1'000'000'000));
  ::timerfd_settime(timer_waiter_->native_handle(), TFD_TIMER_ABSTIME, &due, nullptr);
}

void PortEngine::wait_for_timer() {
  // Queued before the timerfd is read, as in watch(): Asio's registration
  // is edge-triggered.
  timer_waiter_->async_wait(
      boost::asio::posix::descriptor_base::wait_read, [this](const boost::system::error_code& error) {
        if (error) return;
        wait_for_timer();
        uint64_t expirations;
        if (::read(timer_waiter_->native_handle(), &expirations, sizeof expirations) < 0)
          return;  // nothing due (EAGAIN): re-armed for later since
        {
          std::lock_guard guard(timer_mutex_);
          armed_.store(Clock::time_point::max().time_since_epoch().count(), std::memory_order_relaxed);
        }
        io_check();
      });
}

void PortEngine::wake_io_thread() {
  if (wake_pending_.exchange(true)) return;
  boost::asio::post(io_, [this] {
    wake_pending_.store(false);
    io_check();
  });
}

// ---- a look: step aside, or do the work ---------------------------------------------------

void PortEngine::io_check() {
  // Events kept for a wait that did not come (see pending_events_).
  if (pending_event_count_.load(std::memory_order_relaxed) != 0) send_pending_events(Clock::duration::zero());
  const Clock::time_point now = Clock::now();
  DeferredChannelWakeups wakeups;  // sent once the lock is free
  std::unique_lock guard(mutex_, std::try_to_lock);
  if (app_reads_in_channel_waits(now)) {
    look_while_app_reads(guard, now);
    return;
  }
  const bool polling = app_active(now);
  const Clock::time_point last_call(Clock::duration(last_drive_.load(std::memory_order_relaxed)));
  // A polling application's thread inside a verbs call holds the lock: it
  // is at work even if it made few calls since the last look (a sender of
  // long messages, whose posts take microseconds each). A program that
  // polls now and then, between long stretches of its own work, still
  // counts as idle, and its io thread answers for it at once.
  const bool in_call = !guard.owns_lock() && !app_waits_for_events();
  if (polling || in_call) {
    step_aside(guard, now, last_call, polling, in_call);
    return;
  }
  app_idle_after_ = kAppIdleAfterFirst;
  if (!watching_) start_watching();
  if (!guard.owns_lock()) guard.lock();
  send_what_posts_left_locked(now, last_call);
  drain_all_locked(Reads::All);
  if (after_work(app_waits_for_events() ? Acks::Send : Acks::Hold)) spin_for_requests(guard, wakeups);
  const Clock::time_point next = earliest_deadline_locked();
  guard.unlock();
  arm_timer(next);
}

void PortEngine::step_aside(std::unique_lock<std::mutex>& guard, Clock::time_point now, Clock::time_point last_call,
                            bool polling, bool in_call) {
  app_uses_events_.store(false, std::memory_order_relaxed);
  app_sleeps_in_channel_.store(false, std::memory_order_relaxed);
  // What woke a watching thread may wait in a socket, and the call may
  // be the application's last for a while (a post, then a spin on
  // memory): the call reads before it returns, as this thread would
  // have once it had the lock. (A call already past that point leaves
  // it to the next post or poll, or to this thread's next look.)
  if (in_call && watching_) reads_left_to_call_.store(true, std::memory_order_relaxed);
  if (watching_) stop_watching();
  // ACKs held past kAckHold leave now, whoever else is at work.
  // So do SENDs that waited out kReceiveGrace, as RNR NAKs.
  if (guard.owns_lock()) {
    send_what_posts_left_locked(now, last_call);
    if (std::min(held_acks_.earliest_due(), earliest_receive_wait_locked()) <= now) after_work(Acks::Hold);
    guard.unlock();
  }
  // The next look comes when the application may have stopped, not when
  // an ACK still held (or a SEND still waiting) falls due: the
  // application's own passes send those on time while it calls, and if
  // it stops, that look does (a look per held ACK would come every few
  // round trips).
  arm_timer((polling ? last_call : now) + app_idle_after_);
  // The wait doubles for an application found inside a call too: at a
  // fixed kAppIdleAfterFirst, io threads on busy cores could lock into
  // looking every 20 us, each look interrupting the polling thread it
  // then found inside a call (bench/NOTES.md).
  app_idle_after_ = std::min<Clock::duration>(2 * app_idle_after_, kAppIdleAfter);
}

void PortEngine::spin_for_requests(std::unique_lock<std::mutex>& guard, DeferredChannelWakeups& wakeups) {
  // A peer whose READ or atomic this thread answered for an idle
  // application waits for the answer and may send the next request a
  // round trip later: this thread keeps reading until kAnswerSpin passes
  // with no request to answer, rather than sleep and be woken for it.
  // (Back to Asio's loop now and then, for what else is queued there: a
  // packet that arrives meanwhile wakes the watch() handler again.)
  // Not where runnable threads outnumber the CPUs: the peer's thread may
  // wait for this one's CPU, and a packet wakes a sleeping thread at once.
  if (!cpus_to_spare()) return;
  const uint64_t calls = drive_count_.load(std::memory_order_relaxed);
  const Clock::time_point started = Clock::now();
  Clock::time_point last_answer = started;
  for (uint32_t round = 1;; ++round) {
    guard.unlock();
    wakeups.flush();
    guard.lock();
    // The application is back (its calls read the sockets), or stopping.
    if (drive_count_.load(std::memory_order_relaxed) != calls || io_.stopped()) break;
    if (round % kSpinRoundsPerLoadCheck == 0 && !cpus_to_spare()) break;
    drain_all_locked(Reads::All);
    const bool answered = after_work(app_waits_for_events() ? Acks::Send : Acks::Hold);
    const Clock::time_point t = Clock::now();
    if (answered) last_answer = t;
    if (t - last_answer > kAnswerSpin || t - started > kAnswerSpinPerLook) break;
  }
}

bool PortEngine::cpus_to_spare() {
  char text[128];
  const ssize_t length = load_average_.get() < 0 ? -1 : ::pread(load_average_.get(), text, sizeof text - 1, 0);
  if (length <= 0) return true;
  text[length] = '\0';
  // "0.52 0.48 0.41 2/345 12345": the fourth field counts the runnable.
  const char* field = text;
  for (int skip = 0; skip < 3 && field != nullptr; ++skip) {
    field = std::strchr(field, ' ');
    if (field != nullptr) ++field;
  }
  return field == nullptr || std::atoi(field) <= usable_cpus_;
}

void PortEngine::send_what_posts_left_locked(Clock::time_point now, Clock::time_point last_call) {
  // An application that has made no call since for kAppIdleAfterFirst was
  // waiting for it (see kDeferralPause), unless its posting thread was only
  // kept from its core; one that made its last call just now is in the
  // middle of a burst, whether or not the io thread counts it as polling.
  if (!sends_waiting()) return;
  if (now - last_call >= kAppIdleAfterFirst && !thread_waits_for_this_cpu(last_poster_)) {
    deferral_pause_ = now - deferral_paused_until_ < kDeferralPause
                          ? std::min<Clock::duration>(2 * deferral_pause_, kDeferralPause)
                          : Clock::duration(kFirstDeferralPause);
    deferral_paused_until_ = now + deferral_pause_;
  }
  flush_sends();
}

}  // namespace softverbs::udp
