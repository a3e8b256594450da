#include "device/queues.h"

#include <cerrno>
#include <cstring>

#include "device/device_clock.h"
#include "device/event_socket.h"
#include "device/receive_queue.h"

namespace softverbs {

namespace {

// Appends a WQE to `rq` (its poster's lock held; see RecvQueue): 0, EINVAL
// or ENOMEM.
int append_wqe(DeviceMemory& memory, RecvQueue& rq, uint64_t wr_id, std::span<const Sge> sges) {
  if (sges.size() > rq.max_sge) return EINVAL;
  if (rq.posted - rq.consumed_seen >= rq.capacity) {
    // Acquire: the takers' reads of the slots they freed came first.
    rq.consumed_seen = std::atomic_ref<uint64_t>(rq.consumed).load(std::memory_order_acquire);
    if (rq.posted - rq.consumed_seen >= rq.capacity) return ENOMEM;
  }
  RecvWqe* wqe = memory.recv_slot(rq, rq.posted);
  wqe->wr_id = wr_id;
  wqe->num_sge = static_cast<uint32_t>(sges.size());
  // A receive with no SGE is valid (for WRITE with immediate): no copy.
  if (!sges.empty()) std::memcpy(DeviceMemory::sges_of(wqe), sges.data(), sges.size_bytes());
  std::atomic_ref<uint32_t>(wqe->sequence).store(wqe_sequence(rq.posted), std::memory_order_release);
  ++rq.posted;
  return 0;
}

// Completes a receive WQE with a flush error on `recv_cq`.
void complete_flushed(DeviceMemory& memory, int recv_cq, uint32_t qpn, uint64_t wr_id) {
  Completion flushed;
  flushed.wr_id = wr_id;
  flushed.status = WcStatus::WrFlushError;
  flushed.opcode = WcOpcode::Receive;
  flushed.qp_num = qpn;
  deliver_completion(memory, recv_cq, flushed, false);
}

// Returns once no post of a receive to `qp` is under way.
void wait_for_receive_posts(QpRecord& qp) { SharedLock post(qp.receive_post_lock); }

}  // namespace

int post_receive(DeviceMemory& memory, QpRecord& qp, uint64_t wr_id, std::span<const Sge> sges) {
  // The SRQ, the SGE limit and the CQ are fixed while the QP lives.
  if (qp.srq >= 0 || sges.size() > qp.rq.max_sge) return EINVAL;
  {
    // The state is read under the post lock: a move to ERR or RESET sets
    // the state, then passes through this lock (wait_for_receive_posts),
    // then empties the queue, so this WQE is either in the queue by then or
    // sees the new state.
    SharedLock post(qp.receive_post_lock);
    const QpState state = load_state(qp);
    if (state == QpState::Reset) return EINVAL;
    if (state != QpState::Error) return append_wqe(memory, qp.rq, wr_id, sges);
  }
  // In ERR: after the WQEs still queued, which the move to ERR may not have
  // flushed yet.
  flush_receive_queue(memory, qp);
  complete_flushed(memory, qp.recv_cq, qp.qpn, wr_id);
  return 0;
}

int post_srq_receive(DeviceMemory& memory, SrqRecord& srq, uint64_t wr_id, std::span<const Sge> sges) {
  SharedLock lock(srq.lock);
  if (!srq.live) return EINVAL;
  return append_wqe(memory, srq.rq, wr_id, sges);
}

namespace {

// The CapturedChannelWakeups living on this thread, if any (initial-exec,
// as deferring_wakeups below).
thread_local CapturedChannelWakeups* capturing_wakeups __attribute__((tls_model("initial-exec"))) = nullptr;

// The owner reads 8 bytes (its ibv_cq pointer) from the channel fd, as
// libibverbs' ibv_get_cq_event expects of a kernel completion channel.
void send_channel_wakeup(const ChannelWakeup& wakeup) {
  if (capturing_wakeups != nullptr && capturing_wakeups->capture(wakeup)) return;
  send_datagram(wakeup.channel, &wakeup.owner_handle, sizeof wakeup.owner_handle);
}

// The outermost DeferredChannelWakeups living on this thread, if any. (A
// plain pointer: the wake-ups it holds back are its own. Initial-exec: in
// glibc's static TLS, which this library, dlopen'ed by libibverbs, may use;
// TLS allocated on a thread's first use was a block LeakSanitizer's
// scan of thread memory crashed on.)
thread_local DeferredChannelWakeups* deferring_wakeups __attribute__((tls_model("initial-exec"))) = nullptr;

void notify_channel(const ChannelWakeup& wakeup) {
  if (deferring_wakeups != nullptr)
    deferring_wakeups->hold(wakeup);
  else
    send_channel_wakeup(wakeup);
}

}  // namespace

DeferredChannelWakeups::DeferredChannelWakeups() : outermost_(deferring_wakeups == nullptr) {
  if (outermost_) deferring_wakeups = this;  // else the outer one sends them
}

DeferredChannelWakeups::~DeferredChannelWakeups() {
  if (!outermost_) return;
  flush();
  deferring_wakeups = nullptr;
}

CapturedChannelWakeups::CapturedChannelWakeups(const SocketAddress& channel)
    : channel_(channel), outer_(capturing_wakeups) {
  capturing_wakeups = this;
}

CapturedChannelWakeups::~CapturedChannelWakeups() {
  capturing_wakeups = outer_;
  for (uint64_t handle : handles_) send_channel_wakeup(ChannelWakeup{handle, channel_});
}

uint64_t CapturedChannelWakeups::take() {
  if (handles_.empty()) return 0;
  const uint64_t first = handles_.front();
  handles_.erase(handles_.begin());
  return first;
}

bool CapturedChannelWakeups::capture(const ChannelWakeup& wakeup) {
  if (wakeup.channel.length != channel_.length || std::memcmp(wakeup.channel.path, channel_.path, channel_.length) != 0)
    return false;
  handles_.push_back(wakeup.owner_handle);
  return true;
}

void DeferredChannelWakeups::flush() {
  for (const ChannelWakeup& wakeup : held_) send_channel_wakeup(wakeup);
  held_.clear();
}

namespace {
// The QP fatal event of an overrun on this thread, sent once the QP is in ERR
// (every caller of deliver_completion moves it there on the same thread).
struct PendingFatal {
  uint32_t qpn = 0;
  SocketAddress owner_async;
  uint64_t owner_handle = 0;
};
thread_local PendingFatal pending_overrun_fatal;
}  // namespace

void raise_overrun_fatal(const QpRecord& qp) {
  if (pending_overrun_fatal.qpn == 0 || pending_overrun_fatal.qpn != qp.qpn) return;
  const PendingFatal pending = pending_overrun_fatal;
  pending_overrun_fatal = {};
  send_async_event(pending.owner_async, pending.owner_handle, AsyncEventType::QpFatal);
}

bool deliver_completion(DeviceMemory& memory, int cq_index, const Completion& completion, bool solicited) {
  if (cq_index < 0 || cq_index >= limits::kMaxCq) return false;
  CqRecord& cq = memory.shared().cqs[cq_index];
  bool wake = false;
  bool stored = false;
  ChannelWakeup target;
  {
    SharedLock lock(cq.lock);
    if (!cq.live) return false;
    CompletionRing ring = memory.completion_ring(cq);
    bool overflowed_before = ring.overflowed();
    if (cq.stamps_completions) {
      Completion stamped = completion;
      stamped.timestamp_ns = device_clock_ns();
      stored = ring.push(stamped);
    } else {
      stored = ring.push(completion);
    }
    if (!stored && !overflowed_before) {
      // An HCA reports a CQ overrun as an asynchronous CQ error, once.
      send_async_event(cq.owner_async, cq.owner_handle, AsyncEventType::CqError);
    }
    if (!stored) {
      if (cq.lost_completions++ == 0) cq.first_lost = completion;
      // The QP whose completion was lost cannot go on: QP fatal, to its owner
      // (the caller moves it to ERR: see deliver_completion in queues.h).
      // (Its owner and handle never change while it lives: read unlocked,
      // since the caller may hold that QP's lock.)
      // The event waits until the QP is in ERR (raise_overrun_fatal), so that
      // the owner's query after it never sees the QP still in RTS.
      const QpRecord* qp = memory.qp_by_number(completion.qp_num);
      if (qp != nullptr && load_state(*qp) != QpState::Error)
        pending_overrun_fatal = {qp->qpn, qp->owner_async, qp->owner_handle};
    }
    bool solicited_match = solicited || completion.status != WcStatus::Success;
    if (stored && (cq.armed == CqArm::NextCompletion || (cq.armed == CqArm::SolicitedOnly && solicited_match)) &&
        cq.channel.length != 0) {
      cq.armed = CqArm::None;
      wake = true;
      target.owner_handle = cq.owner_handle;
      target.channel = cq.channel;
    }
  }
  if (wake) notify_channel(target);
  return stored;
}

void move_to_error_after_overrun(DeviceMemory& memory, uint32_t qpn) {
  QpRecord* qp = memory.qp_by_number(qpn);
  if (qp != nullptr && move_to_error(*qp, qpn)) flush_receive_queue(memory, *qp);
}

bool move_to_error(QpRecord& qp, uint32_t qpn) {
  SharedLock lock(qp.lock);
  if (!qp.live || qp.qpn != qpn || load_state(qp) == QpState::Error) return false;
  set_state(qp, QpState::Error);
  raise_overrun_fatal(qp);
  return true;
}

void flush_receive_queue(DeviceMemory& memory, QpRecord& qp) {
  wait_for_receive_posts(qp);  // see post_receive
  // The lock is held across the completions, so that two flushes (the one
  // of the move to ERR, one of a post that saw ERR) complete the WQEs in
  // their order, as an HCA flushes its receive queue.
  SharedLock lock(qp.lock);
  while (RecvWqe* wqe = posted_head(memory, qp.rq)) {
    const uint64_t wr_id = wqe->wr_id;
    consume_head(qp.rq);
    complete_flushed(memory, qp.recv_cq, qp.qpn, wr_id);
  }
}

void flush_after_error(DeviceMemory& memory, QpRecord& qp, bool moved) {
  bool on_srq;
  SocketAddress owner_async;
  uint64_t owner_handle;
  {
    SharedLock lock(qp.lock);
    on_srq = qp.srq >= 0;
    owner_async = qp.owner_async;
    owner_handle = qp.owner_handle;
  }
  flush_receive_queue(memory, qp);
  if (moved && on_srq) send_async_event(owner_async, owner_handle, AsyncEventType::QpLastWqeReached);
}

void purge_completions(DeviceMemory& memory, int cq_index, uint32_t qpn) {
  if (cq_index < 0 || cq_index >= limits::kMaxCq) return;
  CqRecord& cq = memory.shared().cqs[cq_index];
  SharedLock poll_lock(cq.ring.consumer.poll_lock);
  SharedLock lock(cq.lock);
  if (!cq.live) return;
  CompletionRing ring = memory.completion_ring(cq);
  ring.remove_if([qpn](const Completion& entry) { return entry.qp_num == qpn; });
}

void discard_receive_queue(DeviceMemory& memory, QpRecord& qp) {
  wait_for_receive_posts(qp);  // see post_receive
  while (posted_head(memory, qp.rq) != nullptr) consume_head(qp.rq);
}

uint32_t rnr_timer_microseconds(uint8_t encoded) {
  // IB spec table 45 (RNR NAK timer field), in microseconds.
  static constexpr uint32_t kTable[32] = {655360, 10,    20,    30,     40,     60,     80,     120,
                                          160,    240,   320,   480,    640,    960,    1280,   1920,
                                          2560,   3840,  5120,  7680,   10240,  15360,  20480,  30720,
                                          40960,  61440, 81920, 122880, 163840, 245760, 327680, 491520};
  return kTable[encoded & 31];
}

}  // namespace softverbs
