// The engine's start and stop, the verbs calls that drive it (post_send,
// drive), and after_work(): what every pass ends with.
#include "udp/engine.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>

#include <algorithm>
#include <bit>
#include <boost/asio/post.hpp>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <functional>

#include "host/netdev.h"
#include "support/leaving.h"
#include "support/process_id.h"
#include "verbs/adversary.h"

namespace softverbs::udp {

using namespace wire;
using namespace parameters;

PortEngine::PortEngine(std::shared_ptr<DeviceMemory> memory, DeviceConfig config, std::vector<GidEntry> gids)
    : memory_(std::move(memory)),
      config_(std::move(config)),
      gids_(std::move(gids)),
      work_(boost::asio::make_work_guard(io_)) {
  if (const char* text = std::getenv("SOFTVERBS_FAULTS")) {
    std::string error;
    fault_override_ = FaultSettings::parse(text, &error);
    if (!fault_override_) std::fprintf(stderr, "softverbs: SOFTVERBS_FAULTS ignored: %s\n", error.c_str());
  }
  if (adversary::enabled()) [[unlikely]]
    adversarial_faults_ = FaultSettings{.loss_ppm = 2000,
                                        .duplicate_ppm = 10000,
                                        .reorder_ppm = 20000,
                                        .delay_ppm = 5000,
                                        .corrupt_ppm = 0,
                                        .delay_us = 300,
                                        .seed = adversary::process_seed()};
}

PortEngine::~PortEngine() {
  work_.reset();
  io_.stop();
  if (thread_.joinable()) thread_.join();
  {
    // ACKs still held go out: the peers' requests completed here.
    std::lock_guard guard(mutex_);
    send_what_is_owed_locked();
  }
  ready_waiter_.reset();
  timer_waiter_.reset();
  busy_watcher_ = nullptr;
  watchers_.clear();
}

void PortEngine::send_what_is_owed_locked() {
  // The device's processes share port 4791 (SO_REUSEPORT), so this
  // process's sockets may hold datagrams for others, which their close
  // would drop: they are routed on first (a REJ sent to a peer just before
  // its sender exited was lost so).
  drain_all_locked(Reads::All);
  flush_sends();
  while (!held_acks_.empty()) send_held_ack_locked(held_acks_.front().qpn);
  fault_delays_.release_due(Clock::time_point::max(), std::bind_front(&PortEngine::send_bytes, this));
  flush_sends();
}

void PortEngine::send_what_is_owed_before_exit() {
  if (current_pid() != started_by_) return;
  if (auto guard = leaving::lock_unless_stuck(mutex_); guard.owns_lock()) send_what_is_owed_locked();
}

bool PortEngine::started_here() const { return current_pid() == started_by_; }

bool PortEngine::start(std::string* error) {
  instance_ = memory_->shared().instance_id;
  started_by_ = current_pid();
  ready_set_ = Fd(::epoll_create1(EPOLL_CLOEXEC));
  if (ready_set_.get() < 0) {
    *error = std::string("epoll_create1: ") + std::strerror(errno);
    return false;
  }
  auto netdev = query_netdev(config_.netdev);
  if (netdev) ifindex_ = netdev->ifindex;
  // The addresses to listen on: the IP GIDs of the table.
  for (const GidEntry& entry : gids_) {
    if (entry.gid.is_zero() || entry.type != GidType::RoceV2) continue;
    if (std::find(local_addresses_.begin(), local_addresses_.end(), entry.gid.raw) == local_addresses_.end())
      local_addresses_.push_back(entry.gid.raw);
  }
  if (local_addresses_.empty()) {
    *error = "device " + config_.name + " has no IP address (no RoCE v2 GID) on " + config_.netdev +
             " to send UDP from; give the netdev an address and run `softverbs up` again";
    return false;
  }
  if (!listen_on_addresses(error) || !open_forward_socket(error) || !start_timer(error)) return false;
  load_average_ = Fd(::open("/proc/loadavg", O_RDONLY | O_CLOEXEC));
  cpu_set_t usable;
  if (sched_getaffinity(0, sizeof usable, &usable) == 0) usable_cpus_ = CPU_COUNT(&usable);
  boost::asio::post(io_, [this] { io_check(); });
  thread_ = std::thread([this] { run_thread(); });
  return true;
}

bool PortEngine::listen_on_addresses(std::string* error) {
  // One device per address and network namespace, as with rxe: another
  // device's claim on one of our addresses is an error, not a silent mix.
  for (const IpAddress& address : local_addresses_) {
    const std::string claim = claim_of_another_device(address, instance_);
    if (claim.empty()) continue;
    *error = "the address " + format_address(address) + " of " + config_.netdev +
             " already carries the UDP transport of another softverbs device (" + claim +
             "); one device per address and network namespace";
    return false;
  }
  for (const IpAddress& address : local_addresses_) {
    int fd = bind_udp(address, kRoceV2Port, ifindex_);
    if (fd < 0) {
      int saved = errno;
      *error = "cannot bind UDP port " + std::to_string(kRoceV2Port) + " on " + format_address(address) + ": " +
               std::strerror(saved);
      if (saved == EADDRINUSE)
        *error += " (another program owns it: a kernel rxe device, or softverbs running as another user)";
      return false;
    }
    receive_fd_by_address_[address] = fd;
    add_watcher_locked(Fd(fd), address, false);
    if (Fd claim = claim_address(address, instance_); claim.get() >= 0) claims_.push_back(std::move(claim));
  }
  return true;
}

bool PortEngine::open_forward_socket(std::string* error) {
  // Packets for our QPs that other processes of the device received reach
  // us on a loopback UDP socket (a local datagram socket would queue only
  // net.unix.max_dgram_qlen of them).
  IpAddress loopback{};
  loopback[10] = loopback[11] = 0xff;
  loopback[12] = 127;
  loopback[15] = 1;
  int forward_fd = bind_udp(loopback, 0, 0);
  if (forward_fd < 0) {
    *error = std::string("cannot bind the UDP transport's forwarding socket on 127.0.0.1 (is lo up?): ") +
             std::strerror(errno);
    return false;
  }
  sockaddr_in bound{};
  socklen_t bound_length = sizeof bound;
  getsockname(forward_fd, reinterpret_cast<sockaddr*>(&bound), &bound_length);
  forward_port_ = ntohs(bound.sin_port);
  forward_fd_ = forward_fd;
  add_watcher_locked(Fd(forward_fd), {}, true);
  return true;
}

bool PortEngine::start_timer(std::string* error) {
  int timer_fd = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (timer_fd < 0) {
    *error = std::string("timerfd_create: ") + std::strerror(errno);
    return false;
  }
  timer_waiter_.emplace(io_, timer_fd);
  wait_for_timer();
  return true;
}

// ---- the verbs calls -------------------------------------------------------------------

int PortEngine::post_send(uint32_t qpn, const SendWqe& wqe) {
  send_stale_pending_events();
  DeferredChannelWakeups wakeups;  // sent once the lock is free
  std::lock_guard guard(mutex_);
  // Read once the lock is ours: the io thread may have held it for a while.
  const Clock::time_point now = note_app_active();
  PassClock clock(*this, now);
  UdpQp* qp = find(qpn);
  if (qp != nullptr && qp->failed) {
    flush_posted(*this, *qp, wqe);
    return 0;
  }
  if (qp == nullptr || !qp->sending) return EINVAL;
  held_acks_.learn(qpn, now);
  requester_post(*this, *qp, wqe);
  note_timer_locked(*qp);
  const bool drained = reads_left_to_this_call();
  if (drained) drain_all_locked(Reads::All);
  last_poster_ = current_thread_id();
  // The first post after a poll joins a burst too if the polls before it
  // were followed by bursts (ib_write_bw posts up to its queue depth after
  // each completion), rather than leave alone and be answered alone.
  const bool follows_post = posts_since_drive_++ > 0;
  // So does any post to a QP with many packets unacknowledged (see
  // kPacketsInFlightToHold): their ACKs bring more.
  const bool in_burst =
      ((follows_post ? now - last_post_returned_ < kBurstGap
                     : bursts_after_polls_ >= kBurstsBeforeFirstPostWaits && now - last_drive_at_ < kBurstGap) ||
       many_in_flight(*qp)) &&
      batch_may_wait(now);
  // The one signaled request among many that the application will poll for
  // leaves with what the burst has gathered so far: the peer works through
  // them while the rest is posted.
  const bool polled_for = wqe.signaled && unsignaled_posts_in_row_ >= kUnsignaledBeforeSignaledLeaves;
  unsignaled_posts_in_row_ = wqe.signaled ? 0 : unsignaled_posts_in_row_ + 1;
  after_work(Acks::Send, in_burst && !polled_for ? Sends::MayWait : Sends::Now);
  if (sends_waiting() && batch_.held_for_qpn != qpn) {
    batch_.held_for_qpn = qpn;
    batch_.held_since = now;
  }
  last_post_returned_ = drained ? Clock::now() : now;
  return 0;
}

void PortEngine::drive() {
  send_stale_pending_events();
  const Clock::time_point now = note_app_active();
  DeferredChannelWakeups wakeups;  // sent once the lock is free
  std::unique_lock guard(mutex_, std::try_to_lock);
  if (!guard.owns_lock()) return;  // the background thread is at it
  PassClock clock(*this, now);
  if (posts_since_drive_ > 1)
    bursts_after_polls_ = std::min<uint32_t>(bursts_after_polls_ + 1, kBurstsBeforeFirstPostWaits);
  else if (posts_since_drive_ == 1)
    bursts_after_polls_ = 0;
  posts_since_drive_ = 0;
  last_drive_at_ = now;
  if (reads_left_to_this_call())
    drain_all_locked(Reads::All);
  else if (channel_waiters_.load(std::memory_order_relaxed) == 0)  // else the waiting thread reads them
    drain_polling_locked();
  after_work(idle_app_acks(), keeps_batch_for_acks(now) ? Sends::MayWait : Sends::Now);
}

bool PortEngine::keeps_batch_for_acks(Clock::time_point now) {
  const SendBatch& b = batch_;
  if (b.count == 0 || b.held_for_qpn == 0 || b.count >= kHeldBatchPackets || now - b.held_since >= kBurstGap ||
      !batch_may_wait(now))
    return false;
  const UdpQp* qp = find(b.held_for_qpn);
  return qp != nullptr && many_in_flight(*qp);
}

bool PortEngine::batch_may_wait(Clock::time_point now) const {
  return now >= deferral_paused_until_ && !app_waits_for_events() && !watching_.load(std::memory_order_relaxed);
}

bool PortEngine::many_in_flight(const UdpQp& qp) const {
  // (The batch's packets have PSNs already: not counted, they are not in flight.)
  const int32_t unacknowledged = psn_distance(qp.requester.next_psn, qp.requester.acked_psn);
  return qp.type == QpType::Rc &&
         unacknowledged - static_cast<int32_t>(batch_.count) >= static_cast<int32_t>(kPacketsInFlightToHold);
}

// ---- a pass's end ----------------------------------------------------------------------

bool PortEngine::after_work(Acks acks, Sends sends) {
  const Clock::time_point now = this->now();
  // Due timers first: a retransmission may add to the answers below.
  run_due_timers_locked(now);
  // SENDs that wait for a receive: one may have been posted since, or
  // their time is up (an RNR NAK then).
  if (!awaiting_receive_qps_.empty()) retry_all_awaiting_locked(now);
  bool more = false;
  bool answered_short_request = false;
  send_answers_locked(acks, now, more, answered_short_request);
  if (more) schedule_remaining_answers_locked();
  if (sends == Sends::Now || !batch_can_grow()) flush_sends();
  arm_for_deadlines_locked(now);
  return answered_short_request;
}

inline void PortEngine::run_due_timers_locked(Clock::time_point now) {
  for (size_t i = 0; i < timed_qps_.size();) {
    UdpQp& qp = *timed_qps_[i];
    if (next_deadline(qp) <= now) completer_tick(*this, qp);
    if (next_deadline(qp) != Clock::time_point::max()) {
      ++i;
      continue;
    }
    qp.timer_listed = false;  // its timer stopped: out (the order of the rest does not matter)
    timed_qps_[i] = timed_qps_.back();
    timed_qps_.pop_back();
  }
  fault_delays_.release_due(now, std::bind_front(&PortEngine::send_bytes, this));
}

inline void PortEngine::schedule_remaining_answers_locked() {
  // Long READ responses go out in slices, so that requests and ACKs
  // in the other direction are not starved; the rest on the next pass.
  for (auto& [qpn, qp] : qps_)
    if (!qp.responder.outbox.empty()) touched_.push_back(qpn);
  boost::asio::post(io_, [this] {
    DeferredChannelWakeups wakeups;  // sent once the lock is free
    std::lock_guard guard(mutex_);
    after_work(Acks::Hold);
  });
}

inline void PortEngine::arm_for_deadlines_locked(Clock::time_point now) {
  // The io thread must know of a new deadline if it would sleep past it:
  // on its own thread it re-arms its timer, from another it is woken (or,
  // for a distant deadline, the timer is set from here: kArmedFromAnyThread).
  // (Not for an ACK held while the io thread steps aside for the
  // application: the application's next call sends it, or the io thread
  // when its timer finds the application gone, within kAppIdleAfter; a
  // wake-up per ACK would cost more than the hold saves. While the io
  // thread watches the sockets it has no such timer to come back by.)
  const bool on_io_thread = std::this_thread::get_id() == thread_.get_id();
  const Clock::time_point earliest =
      (on_io_thread && !looking_for_channel_waiter_) || watching_.load(std::memory_order_relaxed)
          ? earliest_deadline_locked()
          : earliest_protocol_deadline_locked();
  if (earliest.time_since_epoch().count() < armed_.load(std::memory_order_relaxed)) {
    if (on_io_thread || earliest - now >= kArmedFromAnyThread)
      arm_timer(earliest);
    else
      wake_io_thread();
  }
}

void PortEngine::list_timer_locked(UdpQp& qp) {
  qp.timer_listed = true;
  timed_qps_.push_back(&qp);
}

int32_t PortEngine::window(const UdpQp& qp) const {
  // The QPs with requests outstanding are the ones whose timer runs (an RNR
  // wait counts too); a QP about to send its first is not listed yet.
  const size_t sharing = timed_qps_.size() + (qp.timer_listed ? 0 : 1);
  const size_t share = parameters::kInFlightBytes / (sharing * std::max<uint32_t>(qp.mtu, 256));
  return std::clamp(static_cast<int32_t>(std::bit_floor(share)), parameters::kMinWindow,
                    parameters::window_packets(qp.mtu));
}

Clock::time_point PortEngine::earliest_deadline_locked() const {
  return std::min(earliest_protocol_deadline_locked(), held_acks_.earliest_due());
}

Clock::time_point PortEngine::earliest_protocol_deadline_locked() const {
  Clock::time_point earliest = Clock::time_point::max();
  for (const UdpQp* qp : timed_qps_) earliest = std::min(earliest, next_deadline(*qp));
  earliest = std::min(earliest, fault_delays_.earliest_due());
  return std::min(earliest, earliest_receive_wait_locked());
}

}  // namespace softverbs::udp
