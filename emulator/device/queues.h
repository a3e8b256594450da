// What every transport does to a device's queues: receive WQEs posted and
// taken, completions delivered (and completion channels woken), a QP moved
// to ERR and its queues flushed, a CQ cleaned of a QP's completions.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "device/completion_ring.h"
#include "device/device_memory.h"
#include "device/event_socket.h"
#include "device/work_request.h"

namespace softverbs {

// Adds a receive WQE to the QP's receive queue: 0, EINVAL (bad SGE count or
// state) or ENOMEM (queue full). In ERR the WQE completes at once, flushed.
int post_receive(DeviceMemory& memory, QpRecord& qp, uint64_t wr_id, std::span<const Sge> sges);

// Adds a receive WQE to a shared receive queue: 0, EINVAL or ENOMEM.
int post_srq_receive(DeviceMemory& memory, SrqRecord& srq, uint64_t wr_id, std::span<const Sge> sges);

// Pushes a completion into CQ `cq_index`, waking the owner's completion
// channel if the CQ is armed for it. False if the CQ overflowed: the CQ's
// owner gets IBV_EVENT_CQ_ERR (once), the QP's IBV_EVENT_QP_FATAL, and the
// caller moves the QP to ERR (as an HCA does), with move_to_error_after_overrun
// where it holds no lock of that QP.
bool deliver_completion(DeviceMemory& memory, int cq_index, const Completion& completion, bool solicited);

// The QP of a completion deliver_completion could not store (`qpn`, live
// in this device) goes to ERR; its receive queue flushes (the completions
// land once the application makes room).
void move_to_error_after_overrun(DeviceMemory& memory, uint32_t qpn);
// Sends the QP fatal event of an overrun this thread met on `qp`, now that
// the QP is in ERR (move_to_error does it; a caller that sets ERR itself
// calls it).
void raise_overrun_fatal(const QpRecord& qp);

// While one lives on a thread, the completion channel wake-ups that
// deliver_completion makes on that thread wait for flush() or its end
// (nested ones: the outermost). A transport that delivers completions
// under its lock holds one around the lock, so that the application it
// wakes finds the lock free: woken first, it waited for the lock in a
// futex, and each round trip of udp ibv_rc_pingpong -e had two handovers.
// A completion channel's wake-up: the datagram that tells its owner that
// CQ `owner_handle` has an event.
struct ChannelWakeup {
  uint64_t owner_handle = 0;
  SocketAddress channel;
};

class DeferredChannelWakeups {
 public:
  DeferredChannelWakeups();
  ~DeferredChannelWakeups();
  DeferredChannelWakeups(const DeferredChannelWakeups&) = delete;
  DeferredChannelWakeups& operator=(const DeferredChannelWakeups&) = delete;
  // Sends what waits now (the outermost one only).
  void flush();
  // deliver_completion's, on the outermost one.
  void hold(const ChannelWakeup& wakeup) { held_.push_back(wakeup); }

 private:
  // Made around every poll and post of a UDP device: no allocation until
  // something is held.
  bool outermost_ = false;
  std::vector<ChannelWakeup> held_;
};

// While one lives on a thread, the wake-ups of completion channel
// `channel` that this thread makes are kept in it instead of sent: the
// thread is about to read that channel itself (a UDP device's thread
// waiting in ibv_get_cq_event, which reads the sockets while it waits), and
// a datagram to itself cost three system calls. What it did not take()
// leaves as datagrams when it ends.
class CapturedChannelWakeups {
 public:
  explicit CapturedChannelWakeups(const SocketAddress& channel);
  ~CapturedChannelWakeups();
  CapturedChannelWakeups(const CapturedChannelWakeups&) = delete;
  CapturedChannelWakeups& operator=(const CapturedChannelWakeups&) = delete;
  bool empty() const { return handles_.empty(); }
  // The first wake-up captured (its CQ handle); 0 if none.
  uint64_t take();
  // send_channel_wakeup's: true if `wakeup` was for this channel, and kept.
  bool capture(const ChannelWakeup& wakeup);
  // The wake-ups not taken, which then are not sent when this ends.
  std::vector<uint64_t> release_rest() { return std::exchange(handles_, {}); }

 private:
  SocketAddress channel_;
  std::vector<uint64_t> handles_;
  CapturedChannelWakeups* outer_;
};

// Moves `qp` (its record live as `qpn`) to ERR under its lock. True if this
// call moved it: whoever does raises what an HCA raises once per move, such
// as IBV_EVENT_QP_LAST_WQE_REACHED for a QP on an SRQ.
bool move_to_error(QpRecord& qp, uint32_t qpn);

// Completes every receive WQE still queued on `qp` with IBV_WC_WR_FLUSH_ERR
// (its state already ERR, so that a concurrent ibv_post_recv either
// appended before or sees it; see post_receive).
void flush_receive_queue(DeviceMemory& memory, QpRecord& qp);

// What follows a move of `qp` to ERR (not under its lock): its receive WQEs
// complete flushed, and where this caller made the move (`moved`), a QP on
// an SRQ raises IBV_EVENT_QP_LAST_WQE_REACHED.
void flush_after_error(DeviceMemory& memory, QpRecord& qp, bool moved);

// Removes the completions of QP `qpn` from CQ `cq_index`, as an HCA's driver
// cleans a CQ when the QP is reset or destroyed.
void purge_completions(DeviceMemory& memory, int cq_index, uint32_t qpn);

// Discards queued receive WQEs without completing them (Modify QP to RESET:
// the caller holds the QP's lock and has set the state already, so that a
// concurrent ibv_post_recv either appended before or sees it; see
// post_receive).
void discard_receive_queue(DeviceMemory& memory, QpRecord& qp);

// IB encodings of the RNR NAK timer (min_rnr_timer), in microseconds.
uint32_t rnr_timer_microseconds(uint8_t encoded);

}  // namespace softverbs
