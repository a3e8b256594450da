#include "verbs/device_qp.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "device/device_limits.h"
#include "device/event_socket.h"
#include "device/queues.h"
#include "device/receive_queue.h"
#include "device/shared_mutex.h"
#include "shm/requester.h"
#include "support/debug_log.h"
#include "support/process_id.h"
#include "verbs/adversary.h"
#include "verbs/device_context.h"
#include "wire/roce_headers.h"

namespace softverbs {

std::unique_ptr<DeviceQp> DeviceQp::create(DeviceContext& context, QpSetup& setup) {
  DeviceMemory& memory = *context.memory;
  const int index = memory.allocate_qp();
  if (index < 0) {
    errno = ENOMEM;
    return nullptr;
  }
  QpRecord& record = memory.shared().qps[index];
  QpCapacities& caps = setup.caps;
  // With an SRQ the QP has no receive queue of its own, nor has an XRC QP.
  const bool own_receive_queue = setup.srq < 0 && setup.xrc == XrcRole::None;
  RecvQueue rq;
  if (own_receive_queue) {
    rq = allocate_receive_queue(memory, caps.max_recv_wr, caps.max_recv_sge);
    if (rq.ring_offset == 0) {
      SharedLock lock(record.lock);
      record.live = 0;
      errno = ENOMEM;
      return nullptr;
    }
  }
  caps.max_send_wr = std::max<uint32_t>(caps.max_send_wr, 1);
  caps.max_recv_wr = own_receive_queue ? rq.capacity : 0;
  caps.max_send_sge = std::max<uint32_t>(caps.max_send_sge, 1);
  // A send WQE has room for its SGEs or its inline bytes, whichever is
  // more, and either may use it, as on rxe: a QP created with no inline
  // size still sends 16 bytes inline per SGE (rdma_xclient relies on it).
  caps.max_inline_data = std::max<uint32_t>(
      caps.max_inline_data, std::min<uint32_t>(caps.max_send_sge * uint32_t{sizeof(Sge)}, limits::kMaxInlineData));
  caps.max_send_sge = std::max<uint32_t>(
      caps.max_send_sge, std::min<uint32_t>(caps.max_inline_data / uint32_t{sizeof(Sge)}, limits::kMaxSge));
  caps.max_recv_sge = own_receive_queue ? rq.max_sge : 0;
  if (setup.xrc == XrcRole::Recv) caps = {};
  {
    SharedLock lock(record.lock);
    record.type = setup.type;
    record.xrc = setup.xrc;
    record.xrcd_id = setup.xrcd_id;
    record.pd_handle = setup.pd_handle;
    record.signal_all = setup.signal_all ? 1 : 0;
    record.send_cq = setup.send_cq;
    record.recv_cq = setup.recv_cq;
    record.srq = setup.srq;
    record.caps = caps;
    record.rq = rq;
    record.owner_async = setup.owner_async;
    record.attributes.path_mtu = context.active_mtu;
  }
  return std::make_unique<DeviceQp>(context, index, setup.send_cq, setup.srq >= 0);
}

size_t DeviceQp::outstanding_sends() {
  std::lock_guard guard(mutex_);
  size_t outstanding = waiting_.size();
  if (over_udp_) outstanding += context_.udp_transport()->outstanding_sends(qpn_);
  return outstanding;
}

void DeviceQp::set_owner_handle(uint64_t handle) {
  QpRecord& qp = record();
  SharedLock lock(qp.lock);
  qp.owner_handle = handle;
}

DeviceQp::DeviceQp(DeviceContext& context, int index, int send_cq, bool on_srq)
    : context_(context),
      memory_(*context.memory),
      index_(index),
      send_cq_(send_cq),
      on_srq_(on_srq),
      qpn_(memory_.shared().qps[index].qpn),
      maker_(current_pid()) {
  std::lock_guard guard(context_.qps_mutex);
  context_.qps_.push_back(this);
}

DeviceQp::~DeviceQp() {
  {
    std::lock_guard guard(context_.qps_mutex);  // waits out a retry pass
    std::erase(context_.qps_, this);
    std::lock_guard listing(context_.waiting_qps_mutex_);
    std::erase(context_.waiting_qps_, this);
  }
  if (!made_by_this_process(maker_)) {
    // A forked child's copy: the QP, its UDP flow and the epoll
    // registrations the child shares with its parent stay the parent's.
    std::lock_guard guard(mutex_);
    drop_waiting_sends();
    return;
  }
  if (over_udp_) context_.udp_transport()->forget_qp(qpn_);
  QpRecord& qp = record();
  uint64_t ring = 0, bytes = 0;
  bool ours;
  {
    SharedLock lock(qp.lock);
    // A record that is no longer this QP's is not freed twice.
    ours = qp.live && qp.qpn == qpn_;
    if (ours) {
      qp.live = 0;
      ring = qp.rq.ring_offset;
      bytes = ring_bytes(qp.rq);
    }
  }
  if (ours) {
    memory_.release(ring, bytes);
    {
      ExclusiveLock lock(memory_.shared().memory_lock);
      memory_.shared().multicast.detach_everywhere(qpn_);
      memory_.shared().mrs.unbind_windows_of_qp(qpn_);
    }
    if (UdpTransport* udp = context_.udp_if_running(); udp && qp.type == QpType::Ud) udp->leave_groups(qpn_);
  }
  // Completions already in the CQs stay there, as rxe leaves them: libfabric's
  // rxm destroys a QP on the peer's disconnect and reads the CQ after that.
  std::lock_guard guard(mutex_);
  drop_waiting_sends();
}

QpRecord& DeviceQp::record() const { return memory_.shared().qps[index_]; }

void DeviceQp::complete(const Completion& completion) {
  if (deliver_completion(memory_, send_cq_, completion, false)) return;
  // The CQ overran: the QP goes to ERR, as on an HCA (once: the flushes of
  // that move may be lost too).
  if (load_state(record()) == QpState::Error) return;
  enter_error_state();
  if (over_udp_) context_.udp_transport()->sync_qp(index_);
}

void DeviceQp::complete_flushed(uint64_t wr_id) {
  Completion flushed;
  flushed.wr_id = wr_id;
  flushed.status = WcStatus::WrFlushError;
  flushed.qp_num = qpn_;
  complete(flushed);
}

void DeviceQp::purge_own_completions() {
  purge_completions(memory_, send_cq_, qpn_);
  purge_completions(memory_, record().recv_cq, qpn_);
  if (adversary::enabled()) [[unlikely]] {
    adversary::purge_qp(memory_, send_cq_, qpn_);
    adversary::purge_qp(memory_, record().recv_cq, qpn_);
  }
}

// Completes the waiting sends flushed (the QP is in ERR).
void DeviceQp::flush_waiting_sends() {
  while (!waiting_.empty()) {
    complete_flushed(waiting_.front().wr_id);
    waiting_.pop_front();
    context_.waiting_sends_.fetch_sub(1, std::memory_order_release);
  }
  update_waiting_listing();
}

void DeviceQp::drop_waiting_sends() {
  context_.waiting_sends_.fetch_sub(static_cast<int>(waiting_.size()), std::memory_order_release);
  waiting_.clear();
  update_waiting_listing();
}

void DeviceQp::update_waiting_listing() {
  const bool waits = !waiting_.empty();
  if (waits == waiting_listed_) return;  // changes only under the listing's mutex
  std::lock_guard listing(context_.waiting_qps_mutex_);
  if (waits)
    context_.waiting_qps_.push_back(this);
  else
    std::erase(context_.waiting_qps_, this);
  waiting_listed_ = waits;
}

// Takes the QP to ERR: waiting sends and queued receives complete flushed.
void DeviceQp::enter_error_state() {
  QpRecord& qp = record();
  // A QP on an SRQ reports, once, that no more receives will complete on it.
  if (move_to_error(qp, qpn_) && on_srq_)
    send_async_event(qp.owner_async, qp.owner_handle, AsyncEventType::QpLastWqeReached);
  flush_waiting_sends();
  flush_receive_queue(memory_, qp);
}

// The device was removed (`softverbs down`): the QP goes to ERR, as on an
// HCA that is gone, and what it had outstanding completes flushed, once.
void DeviceQp::fail_after_removal() {
  if (removal_handled_) return;
  removal_handled_ = true;
  enter_error_state();
  if (over_udp_) context_.udp_transport()->sync_qp(index_);
}

// Adversarial mode answers the first SEND to each RC QP with an RNR NAK,
// where this QP retries RNR: a correct program sees only a delay.
bool DeviceQp::first_send_meets_rnr(const QpRecord& qp, const SendWqe& send) {
  return qp.type == QpType::Rc && qp.attributes.rnr_retry > 0 && !send.rnr_retries_left &&
         send_opcode_info(send.opcode).is(wr_mask::kSend) &&
         adversary::rnr_for_first_send(qp.xrc == XrcRole::Send ? send.remote_srqn : qp.attributes.dest_qpn);
}

// Runs one send; false if it must wait (and `send` is updated for later).
bool DeviceQp::attempt(SendWqe& send) {
  QpRecord& qp = record();
  Completion completion;
  SendOutcome outcome = adversary::enabled() && first_send_meets_rnr(qp, send)
                            ? SendOutcome::ReceiverNotReady
                            : execute_send(memory_, qp, send, completion);
  // Only a send that must wait reads the clock (see bench/NOTES.md).
  if (outcome == SendOutcome::ReceiverNotReady) {
    if (!send.rnr_retries_left) send.rnr_retries_left = qp.attributes.rnr_retry == 7 ? -1 : qp.attributes.rnr_retry;
    int& left = *send.rnr_retries_left;
    if (left == 0) {
      completion.status = WcStatus::RnrRetryExceededError;
    } else {
      if (left > 0) --left;
      uint8_t timer = 1;
      if (QpRecord* target = memory_.qp_by_number(qp.attributes.dest_qpn)) timer = target->attributes.min_rnr_timer;
      send.next_attempt = Clock::now() + std::chrono::microseconds(rnr_timer_microseconds(timer));
      return false;
    }
  } else if (completion.status == WcStatus::RetryExceededError) {
    // No responder yet: a real RC requester retransmits for
    // 4.096 us * 2^timeout per try, retry_cnt + 1 tries (timeout 0: for ever).
    const Clock::time_point attempted_at = Clock::now();
    // The budget starts at the first attempt that found no responder.
    if (send.give_up == Clock::time_point::max() && qp.attributes.timeout != 0) {
      double per_try = 4.096e-6 * static_cast<double>(uint64_t{1} << qp.attributes.timeout);
      send.give_up = attempted_at + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(per_try * (qp.attributes.retry_count + 1)));
    }
    if (attempted_at < send.give_up) {
      send.next_attempt = attempted_at + std::chrono::microseconds(50);
      return false;
    }
  }
  if (completion.status != WcStatus::Success) {
    complete(completion);
    enter_error_state();
    return true;
  }
  if (send.signaled) complete(completion);
  return true;
}

// Retries this QP's waiting sends whose time has come, in order; returns
// when the next one is due.
DeviceQp::Clock::time_point DeviceQp::retry_due() {
  std::lock_guard guard(mutex_);
  const QpState state = load_state(record());
  if (state == QpState::Sqd) return Clock::time_point::max();  // drained: waits for RTS
  if (state == QpState::Error) {
    // Moved to ERR by someone else (a peer's failed delivery, the device's
    // removal): what waits completes flushed.
    flush_waiting_sends();
    return Clock::time_point::max();
  }
  while (!waiting_.empty()) {
    if (Clock::now() < waiting_.front().next_attempt) return waiting_.front().next_attempt;
    // Out of the queue while it runs: an error flushes what stays queued.
    SendWqe head = std::move(waiting_.front());
    waiting_.pop_front();
    context_.waiting_sends_.fetch_sub(1, std::memory_order_release);
    if (!attempt(head)) {
      waiting_.push_front(std::move(head));
      context_.waiting_sends_.fetch_add(1, std::memory_order_release);
      return waiting_.front().next_attempt;
    }
  }
  update_waiting_listing();
  return Clock::time_point::max();
}

DeviceQp::PostBatch::PostBatch(DeviceQp& qp) : qp_(qp), lock_(qp.mutex_) {
  if (adversary::enabled()) [[unlikely]]
    adversary::maybe_stall();
  if (qp_.memory_.removed()) qp_.fail_after_removal();
}

DeviceQp::PostBatch::~PostBatch() {
  lock_.unlock();
  if (due_ != Clock::time_point::max()) qp_.context_.retry_timer_.schedule(due_);
}

SendWqe& DeviceQp::PostBatch::blank_wqe() {
  qp_.scratch_.reset();
  return qp_.scratch_;
}

int DeviceQp::PostBatch::post(SendWqe& wqe) {
  QpRecord& record = qp_.record();
  const QpState state = load_state(record);
  if (!can_post_send(state)) return EINVAL;
  if (state == QpState::Error) {
    qp_.complete_flushed(wqe.wr_id);
    return 0;
  }
  if (qp_.over_udp_ && qp_.goes_over_udp(wqe)) {
    qp_.prepare_for_udp(wqe);
    return qp_.context_.udp_transport()->post_send(qp_.qpn_, wqe);
  }
  if (state == QpState::Sqd || !qp_.waiting_.empty() || !qp_.attempt(wqe)) {
    // A move keeps the vectors' buffers, so keep_inline's SGE stays right.
    SendWqe& kept = qp_.waiting_.emplace_back(std::move(wqe));
    kept.keep_inline();
    qp_.context_.waiting_sends_.fetch_add(1, std::memory_order_release);
    qp_.update_waiting_listing();
    due_ = std::min(due_, qp_.waiting_.front().next_attempt);
  }
  return 0;
}

}  // namespace softverbs
