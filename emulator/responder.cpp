// The responder's half of the data path: receive queues, data placement at
// the target, and completions (including completion-channel wake-ups).
#include <cerrno>
#include <cstring>

#include "data_path.h"
#include "event_socket.h"

namespace softverbs {

namespace {

// Appends a WQE to `rq` (its owner's lock held): 0, EINVAL or ENOMEM.
int append_wqe(DeviceMemory& memory, RecvQueue& rq, uint64_t wr_id, std::span<const Sge> sges) {
  if (sges.size() > rq.max_sge) return EINVAL;
  if (rq.posted - rq.consumed >= rq.capacity) return ENOMEM;
  RecvWqe* wqe = memory.recv_slot(rq, rq.posted);
  wqe->wr_id = wr_id;
  wqe->num_sge = static_cast<uint32_t>(sges.size());
  std::memcpy(DeviceMemory::sges_of(wqe), sges.data(), sges.size_bytes());
  std::atomic_thread_fence(std::memory_order_release);
  ++rq.posted;
  return 0;
}

}  // namespace

int post_receive(DeviceMemory& memory, QpRecord& qp, uint64_t wr_id, std::span<const Sge> sges) {
  Completion flushed;
  int recv_cq = -1;
  {
    SharedLock lock(qp.lock);
    if (qp.state == QpState::Reset || qp.srq >= 0 || sges.size() > qp.rq.max_sge) return EINVAL;
    if (qp.state == QpState::Error) {
      flushed.wr_id = wr_id;
      flushed.status = WcStatus::WrFlushError;
      flushed.opcode = WcOpcode::Receive;
      flushed.qp_num = qp.qpn;
      recv_cq = qp.recv_cq;
    } else {
      return append_wqe(memory, qp.rq, wr_id, sges);
    }
  }
  deliver_completion(memory, recv_cq, flushed, false);
  return 0;
}

int post_srq_receive(DeviceMemory& memory, SrqRecord& srq, uint64_t wr_id, std::span<const Sge> sges) {
  SharedLock lock(srq.lock);
  if (!srq.live) return EINVAL;
  return append_wqe(memory, srq.rq, wr_id, sges);
}

namespace {

// The owner reads 8 bytes (its ibv_cq pointer) from the channel fd, as
// libibverbs' ibv_get_cq_event expects of a kernel completion channel.
void send_channel_wakeup(const ChannelWakeup& wakeup) {
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

void DeferredChannelWakeups::flush() {
  for (const ChannelWakeup& wakeup : held_) send_channel_wakeup(wakeup);
  held_.clear();
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
    CompletionRing ring(cq.ring, std::span(memory.at<CompletionSlot>(cq.ring_offset), cq.ring.producer.capacity));
    bool overflowed_before = ring.overflowed();
    stored = ring.push(completion);
    if (!stored && !overflowed_before) {
      // An HCA reports a CQ overrun as an asynchronous CQ error, once.
      send_async_event(cq.owner_async, cq.owner_handle, AsyncEventType::CqError);
    }
    if (!stored) {
      // The QP whose completion was lost cannot go on: QP fatal, to its owner.
      // (Its owner and handle never change while it lives: read unlocked,
      // since the caller may hold that QP's lock.)
      if (const QpRecord* qp = memory.qp_by_number(completion.qp_num))
        send_async_event(qp->owner_async, qp->owner_handle, AsyncEventType::QpFatal);
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

void flush_receive_queue(DeviceMemory& memory, QpRecord& qp) {
  for (;;) {
    Completion flushed;
    {
      SharedLock lock(qp.lock);
      if (qp.rq.consumed == qp.rq.posted) return;
      RecvWqe* wqe = memory.recv_slot(qp.rq, qp.rq.consumed++);
      flushed.wr_id = wqe->wr_id;
      flushed.status = WcStatus::WrFlushError;
      flushed.opcode = WcOpcode::Receive;
      flushed.qp_num = qp.qpn;
    }
    deliver_completion(memory, qp.recv_cq, flushed, false);
  }
}

void purge_completions(DeviceMemory& memory, int cq_index, uint32_t qpn) {
  if (cq_index < 0 || cq_index >= limits::kMaxCq) return;
  CqRecord& cq = memory.shared().cqs[cq_index];
  SharedLock poll_lock(cq.ring.consumer.poll_lock);
  SharedLock lock(cq.lock);
  if (!cq.live) return;
  CompletionRing ring(cq.ring, std::span(memory.at<CompletionSlot>(cq.ring_offset), cq.ring.producer.capacity));
  ring.remove_if([qpn](const Completion& entry) { return entry.qp_num == qpn; });
}

void discard_receive_queue(QpRecord& qp) { qp.rq.consumed = qp.rq.posted; }

uint32_t rnr_timer_microseconds(uint8_t encoded) {
  // IB spec table 45 (RNR NAK timer field), in microseconds.
  static constexpr uint32_t kTable[32] = {655360, 10,    20,    30,     40,     60,     80,     120,
                                          160,    240,   320,   480,    640,    960,    1280,   1920,
                                          2560,   3840,  5120,  7680,   10240,  15360,  20480,  30720,
                                          40960,  61440, 81920, 122880, 163840, 245760, 327680, 491520};
  return kTable[encoded & 31];
}

}  // namespace softverbs
