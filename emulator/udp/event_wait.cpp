// A thread of the application that blocks in ibv_get_cq_event reads the
// device's sockets itself while it waits, as a thread woken by an HCA's
// interrupt would find the completion already written: a packet wakes this
// thread alone. (Left to the io thread, a packet woke it, and it woke the
// application through the channel: two cross-CPU wake-ups per message.)
#include <fcntl.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "support/signals.h"
#include "udp/engine.h"
#include "udp/transport.h"

namespace softverbs::udp {

using namespace parameters;

uint64_t PortEngine::wait_for_channel(int channel_fd, const SocketAddress& channel) {
  Clock::time_point ack_due;
  {
    std::lock_guard guard(mutex_);
    // An event an earlier wait kept for this channel is the answer, whether
    // or not the channel's fd blocks.
    for (auto it = pending_events_.begin(); it != pending_events_.end(); ++it) {
      if (it->channel.length != channel.length || std::memcmp(it->channel.path, channel.path, channel.length) != 0)
        continue;
      const uint64_t handle = it->handle;
      pending_events_.erase(it);
      pending_event_count_.store(pending_events_.size(), std::memory_order_relaxed);
      return handle;
    }
    // Counted before the lock is let go: a wait that ends meanwhile keeps
    // no events from a thread that is about to sleep.
    channel_waiters_.fetch_add(1, std::memory_order_relaxed);
    // Packets to the socket a polling pass took out of the ready set
    // would not end the poll below.
    if (busy_watcher_ != nullptr) join_ready_set_locked(*busy_watcher_);
    ack_due = held_acks_.earliest_due();
  }
  // However this wait ends (a return, or pthread_cancel in ppoll), it stops
  // counting, and a wait that did not sleep has the io thread look at once:
  // a look during it left the sockets to this thread and may have stopped
  // watching them.
  bool slept = false;
  bool counted = true;
  struct EndOfWait {
    PortEngine& engine;
    const bool& slept;
    bool& counted;
    ~EndOfWait() {
      if (counted) engine.channel_waiters_.fetch_sub(1, std::memory_order_relaxed);
      if (!slept) engine.arm_timer(Clock::now());
    }
  } end_of_wait{*this, slept, counted};
  const int flags = ::fcntl(channel_fd, F_GETFL);
  if (flags < 0 || (flags & O_NONBLOCK) != 0) return 0;  // the caller wants EAGAIN, not a wait
  // The events this thread's passes raise on the channel come back here
  // rather than through the socket.
  CapturedChannelWakeups captured(channel);
  bool interrupted = false;
  while (captured.empty()) {
    pollfd waits[2] = {{channel_fd, POLLIN, 0}, {ready_set_.get(), POLLIN, 0}};
    // Until a held ACK falls due (this thread sends it then), or for good.
    timespec until_due{};
    const bool holding = ack_due != Clock::time_point::max();
    if (holding) {
      const auto left = std::max<Clock::duration>(ack_due - Clock::now(), Clock::duration::zero());
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
      until_due = {static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
    }
    const int ready = ::ppoll(waits, 2, holding ? &until_due : nullptr, nullptr);
    // A handler always ends ppoll; a read of the channel ends with EINTR
    // only where it would not restart.
    if (ready < 0 && errno == EINTR) {
      if (interrupted_reads_restart()) continue;
      interrupted = true;
      break;
    }
    // An error: the blocking read that follows behaves as the kernel's
    // channel would.
    if (ready < 0 || waits[0].revents != 0) break;
    if (!slept) {
      // Sleeping here, rather than finding an event its own poll of the
      // channel saw: the io thread leaves the sockets to this thread.
      slept = true;
      app_sleeps_in_channel_.store(true, std::memory_order_relaxed);
    }
    DeferredChannelWakeups wakeups;  // sent once the lock is free
    std::lock_guard guard(mutex_);
    PassClock clock(*this, Clock::now());
    if ((waits[1].revents & POLLIN) != 0) drain_all_locked(Reads::All);
    // An ACK for a request that just arrived waits for the application's
    // answer to the request, and leaves with it in one send: the peer,
    // sleeping on its channel, is woken once for both.
    after_work(Acks::Hold);
    ack_due = held_acks_.earliest_due();
  }
  const uint64_t taken = interrupted ? UdpTransport::kChannelWaitInterrupted : captured.take();
  const Clock::time_point now = Clock::now();
  {
    std::lock_guard guard(mutex_);
    // The rest wait for this application's next wait on the channel, if no
    // other thread waits now (it would not see them).
    counted = false;
    if (channel_waiters_.fetch_sub(1, std::memory_order_relaxed) == 1 && !captured.empty()) {
      for (uint64_t handle : captured.release_rest()) pending_events_.push_back({channel, handle, now});
      pending_event_count_.store(pending_events_.size(), std::memory_order_relaxed);
    }
  }
  if (!slept) return taken;
  channel_wait_ended_.store(now.time_since_epoch().count(), std::memory_order_relaxed);
  // If the application now stays away from ibv_get_cq_event, the io thread
  // takes the sockets over (at a look no sooner than this).
  arm_timer(now + kAppIdleAfter);
  return taken;
}

void PortEngine::send_pending_events(Clock::duration age) {
  std::vector<PendingEvent> due;
  {
    std::lock_guard guard(mutex_);
    const Clock::time_point now = Clock::now();
    std::erase_if(pending_events_, [&](const PendingEvent& event) {
      if (now - event.since < age) return false;
      due.push_back(event);
      return true;
    });
    pending_event_count_.store(pending_events_.size(), std::memory_order_relaxed);
  }
  for (const PendingEvent& event : due) send_datagram(event.channel, &event.handle, sizeof event.handle);
}

bool PortEngine::app_reads_in_channel_waits(Clock::time_point now) const {
  if (channel_waiters_.load(std::memory_order_relaxed) > 0) return true;
  const Clock::time_point ended(Clock::duration(channel_wait_ended_.load(std::memory_order_relaxed)));
  return app_sleeps_in_channel_.load(std::memory_order_relaxed) && now - ended < kAppIdleAfter;
}

void PortEngine::look_while_app_reads(std::unique_lock<std::mutex>& guard, Clock::time_point now) {
  // A packet must not wake this thread as well as the waiting one.
  if (watching_) stop_watching();
  if (!guard.owns_lock()) guard.lock();
  // Retransmissions and other timers due, and ACKs whose hold ran out (the
  // others wait for the application's answer, as in its waits). While no
  // thread waits, no look for the held ones before the application may
  // have stopped: its answer or its next wait sends them (a look at every
  // hold's end came every few round trips). A thread asleep in a wait may
  // not know of an ACK held since it computed its timeout: looked for then.
  const bool waiters = channel_waiters_.load(std::memory_order_relaxed) > 0;
  looking_for_channel_waiter_ = !waiters;
  after_work(Acks::Hold);
  looking_for_channel_waiter_ = false;
  Clock::time_point next = waiters ? earliest_deadline_locked() : earliest_protocol_deadline_locked();
  guard.unlock();
  if (!waiters) {
    const Clock::time_point ended(Clock::duration(channel_wait_ended_.load(std::memory_order_relaxed)));
    next = std::min(next, std::max(now, ended + kAppIdleAfter));
  }
  arm_timer(next);
}

}  // namespace softverbs::udp
