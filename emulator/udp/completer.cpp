// The completer: what comes back to a requester. ACKs (coalesced: one ACK
// acknowledges every request up to its PSN), NAKs (PSN sequence error: go
// back and resend; RNR: wait the encoded time, then resend; the others: the
// work request fails), READ responses (an ATOMIC WRITE's among them) and
// atomic ACKs. It retires work requests strictly in order and runs the
// retransmission timer: after 4.096 us x 2^timeout without progress it
// resends from the oldest unacknowledged PSN, retry_cnt times, then fails
// with IBV_WC_RETRY_EXC_ERR.
#include <algorithm>
#include <cstring>

#include "device/event_socket.h"
#include "device/queues.h"
#include "support/debug_log.h"
#include "support/payload_copy.h"
#include "udp/internal.h"

namespace softverbs::udp {

namespace {

using namespace wire;

// The WQE whose PSN range holds `psn`; -1 if none.
ptrdiff_t find_wqe(const RequesterState& r, uint32_t psn) {
  for (size_t i = 0; i < r.queue.size(); ++i) {
    const SendWqe& wqe = r.queue[i];
    if (!wqe.assigned) break;
    int32_t into = psn_distance(psn, wqe.first_psn);
    if (into >= 0 && static_cast<uint32_t>(into) < wqe.psn_count) return static_cast<ptrdiff_t>(i);
  }
  return -1;
}

// True if `psn` is one this QP has handed out.
bool was_sent(const RequesterState& r, uint32_t psn) {
  return r.sent_any && psn_distance(psn, r.next_psn) < 0 && psn_distance(psn, r.acked_psn) > -(1 << 22);
}

void reset_budgets(UdpQp& qp) {
  qp.requester.retries_left = qp.attributes.retry_count;
  qp.requester.rnr_retries_left = qp.attributes.rnr_retry == 7 ? -1 : qp.attributes.rnr_retry;
}

// Every request up to `psn` is acknowledged. Progress restarts the timer
// and the retry budgets.
void advance(TransportPort& port, UdpQp& qp, uint32_t psn) {
  RequesterState& r = qp.requester;
  if (psn_distance(psn, r.acked_psn) <= 0 || psn_distance(psn, r.next_psn) >= 0) return;
  r.acked_psn = psn;
  reset_budgets(qp);
  r.ack_deadline = port.now() + ack_timeout(qp);
}

// An earlier READ or atomic than `index` still waiting: its response was
// lost, and what arrived since says so. Returns true after going back to it.
bool resend_lost_response(TransportPort& port, UdpQp& qp, size_t index) {
  RequesterState& r = qp.requester;
  for (size_t i = 0; i < index && i < r.queue.size(); ++i) {
    SendWqe& wqe = r.queue[i];
    if (!wqe.expects_response() || wqe.finished) continue;
    uint32_t psn = wqe.is_read() ? wqe.read_next_psn : wqe.first_psn;
    if (r.rerequest_pending && r.rerequest_psn == psn) return true;
    r.rerequest_pending = true;
    r.rerequest_psn = psn;
    go_back(port, qp, psn);
    return true;
  }
  return false;
}

WcStatus status_for_nak(uint8_t code) {
  switch (code) {
    case aeth::kNakRemoteAccessError:
      return WcStatus::RemoteAccessError;
    case aeth::kNakRemoteOperationalError:
      return WcStatus::RemoteOperationError;
    default:
      return WcStatus::RemoteInvalidRequestError;
  }
}

void on_acknowledge(TransportPort& port, UdpQp& qp, const TransportPacket& packet) {
  RequesterState& r = qp.requester;
  const uint32_t psn = packet.bth.psn;
  if (!was_sent(r, psn)) return;  // stale or not ours
  const uint8_t syndrome = packet.aeth.syndrome;
  switch (aeth::kind(syndrome)) {
    case 0x00: {  // ACK
      const uint32_t acknowledged_before = r.acked_psn;
      advance(port, qp, psn);
      // An ACK past the PSN an RNR NAK turned back (the responder took a
      // duplicate of that request after the NAK): that wait is over, and
      // the requests behind it go now, not at the RNR timer's end, which
      // may lie beyond what the retry budget allows for their ACKs.
      if (r.acked_psn != acknowledged_before) r.resume_at = Clock::time_point::min();
      // A READ or atomic at or before the acknowledged PSN that has no
      // response yet: the response was lost.
      size_t covered = 0;
      while (covered < r.queue.size() && r.queue[covered].assigned &&
             psn_distance(r.queue[covered].last_psn(), psn) <= 0)
        ++covered;
      resend_lost_response(port, qp, covered);
      return;
    }
    case aeth::kRnrNak: {
      port.counters().add(Counter::RnrNaksReceived);
      // For a request acknowledged since (the NAK of a first copy, arriving
      // after the ACK of a duplicate): stale, no wait.
      if (psn_distance(psn, r.acked_psn) <= 0) return;
      advance(port, qp, psn_add(psn, kPsnMask));  // psn - 1
      ptrdiff_t index = find_wqe(r, psn);
      if (index < 0) return;
      if (r.rnr_retries_left == 0) {
        r.queue[static_cast<size_t>(index)].error = WcStatus::RnrRetryExceededError;
        debug_log("QP %#x: RNR retries exhausted at PSN %#x", qp.qpn, psn);
        return;
      }
      if (r.rnr_retries_left > 0) --r.rnr_retries_left;
      r.resume_at = port.now() + std::chrono::microseconds(rnr_timer_microseconds(aeth::value(syndrome)));
      go_back(port, qp, psn);
      // The wait is not a loss: the timer restarts once sending resumes.
      r.ack_deadline = Clock::time_point::max();
      return;
    }
    case aeth::kNak: {
      const uint8_t code = aeth::value(syndrome);
      advance(port, qp, psn_add(psn, kPsnMask));
      if (code == aeth::kNakSequenceError) {
        port.counters().add(Counter::SequenceNaksReceived);
        // For a PSN acknowledged since (the NAK overtaken by a later ACK):
        // the peer has it, and going back would only send duplicates.
        if (psn_distance(psn, r.acked_psn) <= 0) return;
        go_back(port, qp, psn);
        return;
      }
      port.counters().add(Counter::ErrorNaksReceived);
      ptrdiff_t index = find_wqe(r, psn);
      if (index < 0) return;
      r.queue[static_cast<size_t>(index)].error = status_for_nak(code);
      debug_log("QP %#x: NAK code %u at PSN %#x (wr_id %#llx)", qp.qpn, code, psn,
                static_cast<unsigned long long>(r.queue[static_cast<size_t>(index)].wr_id));
      return;
    }
    default:
      port.counters().add(Counter::MalformedPackets);
      return;
  }
}

// The requests a response answers: a READ's data, an atomic's ACK, an
// ATOMIC WRITE's zero-length READ RESPONSE ONLY.
enum class Answering : uint8_t { Read, Atomic, AtomicWrite };

bool answers(const SendWqe& wqe, Answering what) {
  switch (what) {
    case Answering::Read:
      return wqe.is_read();
    case Answering::Atomic:
      return wqe.is_atomic();
    case Answering::AtomicWrite:
      return wqe.is_atomic_write();
  }
  return false;
}

// The request of that kind that a response with this PSN answers, if it
// still waits for it and no earlier one lost its response (then that one is
// asked again instead).
SendWqe* awaiting_response(TransportPort& port, UdpQp& qp, uint32_t psn, Answering what) {
  RequesterState& r = qp.requester;
  if (!was_sent(r, psn)) return nullptr;
  ptrdiff_t found = find_wqe(r, psn);
  if (found < 0) return nullptr;
  const size_t index = static_cast<size_t>(found);
  SendWqe& wqe = r.queue[index];
  if (!answers(wqe, what) || wqe.finished) {
    port.counters().add(Counter::DuplicatesReceived);
    return nullptr;
  }
  if (resend_lost_response(port, qp, index)) return nullptr;
  return &wqe;
}

// An ATOMIC WRITE is done once its zero-length READ RESPONSE ONLY, an ACK
// in its AETH, is in (IBA 1.5, as rxe answers it).
void on_atomic_write_response(TransportPort& port, UdpQp& qp, const TransportPacket& packet) {
  const uint32_t psn = packet.bth.psn;
  SendWqe* waiting = awaiting_response(port, qp, psn, Answering::AtomicWrite);
  if (waiting == nullptr) return;
  SendWqe& wqe = *waiting;
  if ((packet.bth.opcode & 0x1f) != op::kReadResponseOnly || !packet.payload.empty() ||
      aeth::kind(packet.aeth.syndrome) != 0) {
    debug_log("QP %#x: ATOMIC WRITE at PSN %#x answered by %s with %zu bytes", qp.qpn, psn,
              opcode_info(packet.bth.opcode).name, packet.payload.size());
    wqe.error = WcStatus::BadResponseError;
    return;
  }
  wqe.finished = true;
  advance(port, qp, psn);
}

void on_read_response(TransportPort& port, UdpQp& qp, const TransportPacket& packet) {
  RequesterState& r = qp.requester;
  const uint32_t psn = packet.bth.psn;
  const ptrdiff_t answered = find_wqe(r, psn);
  if (answered >= 0 && r.queue[static_cast<size_t>(answered)].is_atomic_write())
    return on_atomic_write_response(port, qp, packet);
  SendWqe* waiting = awaiting_response(port, qp, psn, Answering::Read);
  if (waiting == nullptr) return;
  SendWqe& wqe = *waiting;
  advance(port, qp, psn_add(wqe.first_psn, kPsnMask));  // everything before the READ
  if (psn != wqe.read_next_psn) {
    if (psn_distance(psn, wqe.read_next_psn) < 0) {
      port.counters().add(Counter::DuplicatesReceived);
      return;
    }
    // A response is missing: ask again for the rest, once per gap.
    port.counters().add(Counter::OutOfSequenceDropped);
    if (!(r.rerequest_pending && r.rerequest_psn == wqe.read_next_psn)) {
      r.rerequest_pending = true;
      r.rerequest_psn = wqe.read_next_psn;
      go_back(port, qp, wqe.read_next_psn);
    }
    return;
  }
  if (r.rerequest_pending && r.rerequest_psn == psn) r.rerequest_pending = false;
  const uint8_t operation = packet.bth.opcode & 0x1f;
  const bool last = operation == op::kReadResponseLast || operation == op::kReadResponseOnly;
  const uint64_t remaining = wqe.length - wqe.read_done;
  const uint64_t expected = std::min<uint64_t>(remaining, qp.mtu);
  if (packet.payload.size() != expected || last != (remaining <= qp.mtu)) {
    debug_log("QP %#x: READ response PSN %#x carries %zu bytes, expected %llu%s", qp.qpn, psn, packet.payload.size(),
              static_cast<unsigned long long>(expected), last ? " (last)" : "");
    wqe.error = WcStatus::BadResponseError;
    return;
  }
  {
    LocalVectors into;
    if (!gather_local(port.memory(), qp, wqe, wqe.read_done, packet.payload.size(), access::kLocalWrite, into)) {
      wqe.error = WcStatus::LocalProtectionError;
      return;
    }
    scatter(into, packet.payload);
  }
  wqe.read_done += packet.payload.size();
  wqe.read_next_psn = psn_add(wqe.read_next_psn, 1);
  advance(port, qp, psn);
  if (last) wqe.finished = true;
}

void on_atomic_acknowledge(TransportPort& port, UdpQp& qp, const TransportPacket& packet) {
  const uint32_t psn = packet.bth.psn;
  SendWqe* waiting = awaiting_response(port, qp, psn, Answering::Atomic);
  if (waiting == nullptr) return;
  SendWqe& wqe = *waiting;
  if (aeth::kind(packet.aeth.syndrome) != 0) {
    wqe.error = WcStatus::BadResponseError;
    return;
  }
  {
    LocalVectors into;
    if (!gather_local(port.memory(), qp, wqe, 0, 8, access::kLocalWrite, into)) {
      wqe.error = WcStatus::LocalProtectionError;
      return;
    }
    uint64_t original = packet.atomic_ack_original;  // host order, as the initiator reads it
    scatter(into, std::span(reinterpret_cast<const uint8_t*>(&original), 8));
  }
  wqe.finished = true;
  advance(port, qp, psn);
}

Completion completion_of(const UdpQp& qp, const SendWqe& wqe, WcStatus status) {
  Completion c;
  c.wr_id = wqe.wr_id;
  c.status = status;
  c.opcode = completion_opcode(wqe.opcode);
  c.qp_num = qp.qpn;
  c.byte_len = status == WcStatus::Success ? static_cast<uint32_t>(wqe.length) : 0;
  return c;
}

}  // namespace

void scatter(std::span<const iovec> to, std::span<const uint8_t> from) {
  size_t at = 0;
  for (const iovec& v : to) {
    size_t take = std::min(v.iov_len, from.size() - at);
    copy_payload(v.iov_base, from.data() + at, take);
    at += take;
    if (at == from.size()) break;
  }
}

Clock::duration ack_timeout(const UdpQp& qp) {
  // timeout 0 means "infinite" (IBA 9.7.6.1.3): never give up, but still
  // resend now and then, since a lost packet would otherwise stall forever.
  if (qp.attributes.timeout == 0) return std::chrono::seconds(1);
  auto exact = std::chrono::nanoseconds(
      static_cast<int64_t>(4096.0 * static_cast<double>(uint64_t{1} << qp.attributes.timeout)));
  // Below a millisecond a timer only measures scheduling noise.
  return std::max<Clock::duration>(exact, std::chrono::milliseconds(1));
}

void go_back(TransportPort& port, UdpQp& qp, uint32_t psn) {
  RequesterState& r = qp.requester;
  ptrdiff_t found = find_wqe(r, psn);
  if (found < 0) return;
  const size_t index = static_cast<size_t>(found);
  for (size_t i = index; i < r.queue.size() && r.queue[i].assigned; ++i) {
    SendWqe& wqe = r.queue[i];
    if (wqe.expects_response()) {
      // A READ is asked again from its first missing response; an atomic
      // again whole (the responder replays its saved result).
      if (!wqe.finished) wqe.packets_sent = 0;
    } else {
      wqe.packets_sent = i == index ? static_cast<uint32_t>(psn_distance(psn, wqe.first_psn)) : 0;
    }
  }
  r.cursor = std::min(r.cursor, index);
  (void)port;
}

void completer_receive(TransportPort& port, UdpQp& qp, const TransportPacket& packet) {
  if (qp.type != QpType::Rc || !qp.sending) return;
  const OpKind kind = opcode_info(packet.bth.opcode).kind;
  if (kind == OpKind::Acknowledge)
    on_acknowledge(port, qp, packet);
  else if (kind == OpKind::AtomicAcknowledge)
    on_atomic_acknowledge(port, qp, packet);
  else
    on_read_response(port, qp, packet);
  complete_in_order(port, qp);
  if (qp.sending) requester_run(port, qp);
}

void complete_in_order(TransportPort& port, UdpQp& qp) {
  RequesterState& r = qp.requester;
  DeviceMemory& memory = port.memory();
  bool retired = false;
  while (!r.queue.empty()) {
    SendWqe& wqe = r.queue.front();
    if (wqe.error != WcStatus::Success) {
      // Errors are reported whether or not the request was signaled, and
      // the QP goes to ERR (IBA 10.8.3).
      deliver_completion(memory, qp.send_cq, completion_of(qp, wqe, wqe.error), false);
      r.queue.pop_front();
      enter_error(port, qp);
      return;
    }
    if (!wqe.assigned) break;
    bool done;
    if (qp.type != QpType::Rc)
      done = wqe.fully_sent();
    else if (wqe.expects_response())
      done = wqe.finished;
    else
      done = wqe.fully_sent() && psn_distance(wqe.last_psn(), r.acked_psn) <= 0;
    if (!done) break;
    if (wqe.holds_rd_atomic) --r.rd_atomic_in_flight;
    if (wqe.signaled && !deliver_completion(memory, qp.send_cq, completion_of(qp, wqe, WcStatus::Success), false)) {
      // The CQ overran: the QP goes to ERR and what follows flushes, as on an HCA.
      r.queue.pop_front();
      if (r.cursor > 0) --r.cursor;
      enter_error(port, qp);
      return;
    }
    retired = true;
    r.queue.pop_front();
    if (r.cursor > 0) --r.cursor;
  }
  if (retired) {
    r.last_completion = port.now();
    r.completed_at_call = port.application_calls();
  }
  if (r.queue.empty() || !r.queue.front().assigned) {
    r.ack_deadline = Clock::time_point::max();
    r.rerequest_pending = false;
  }
}

void completer_tick(TransportPort& port, UdpQp& qp) {
  RequesterState& r = qp.requester;
  const Clock::time_point now = port.now();
  if (r.resume_at != Clock::time_point::min() && now >= r.resume_at) {
    r.resume_at = Clock::time_point::min();
    requester_run(port, qp);
  }
  if (qp.type != QpType::Rc || now < r.ack_deadline) return;
  port.counters().add(Counter::Timeouts);
  if (r.queue.empty() || !r.queue.front().assigned) {
    r.ack_deadline = Clock::time_point::max();
    return;
  }
  if (qp.attributes.timeout != 0) {
    if (r.retries_left <= 0) {
      debug_log("QP %#x: no ACK after %d retries of %lld us: IBV_WC_RETRY_EXC_ERR", qp.qpn, qp.attributes.retry_count,
                static_cast<long long>(std::chrono::duration_cast<std::chrono::microseconds>(ack_timeout(qp)).count()));
      if (r.queue.front().error == WcStatus::Success) r.queue.front().error = WcStatus::RetryExceededError;
      complete_in_order(port, qp);
      return;
    }
    --r.retries_left;
  }
  // Resend from the oldest request without its answer. A READ, atomic or
  // ATOMIC WRITE waiting for its response may lie before acked_psn: an ACK
  // for a later duplicate acknowledges past it, but only the response ends it.
  SendWqe& oldest = r.queue.front();
  uint32_t from = psn_add(r.acked_psn, 1);
  if (oldest.expects_response() && !oldest.finished) from = oldest.is_read() ? oldest.read_next_psn : oldest.first_psn;
  if (psn_distance(from, oldest.first_psn) < 0) from = oldest.first_psn;
  r.rerequest_pending = false;
  go_back(port, qp, from);
  r.ack_deadline = now + ack_timeout(qp);
  requester_run(port, qp);
}

Clock::time_point next_deadline(const UdpQp& qp) {
  Clock::time_point next = qp.requester.ack_deadline;
  if (qp.requester.resume_at != Clock::time_point::min()) next = std::min(next, qp.requester.resume_at);
  return next;
}

void enter_error(TransportPort& port, UdpQp& qp) {
  DeviceMemory& memory = port.memory();
  QpRecord& record = memory.shared().qps[qp.index];
  const bool moved = move_to_error(record, qp.qpn);
  RequesterState& r = qp.requester;
  for (size_t i = 0; i < r.queue.size(); ++i) {
    Completion flushed = completion_of(qp, r.queue[i], WcStatus::WrFlushError);
    deliver_completion(memory, qp.send_cq, flushed, false);
  }
  r.queue.clear();
  r.cursor = 0;
  r.rd_atomic_in_flight = 0;
  r.ack_deadline = Clock::time_point::max();
  r.resume_at = Clock::time_point::min();
  qp.responder.outbox.clear();
  qp.responder.awaiting_receive.clear();  // a QP in ERR takes nothing in
  qp.responder.in_message = MessageKind::None;
  qp.sending = false;
  qp.connected = false;
  qp.failed = true;
  flush_after_error(memory, record, moved);
}

void flush_posted(TransportPort& port, const UdpQp& qp, const SendWqe& wqe) {
  deliver_completion(port.memory(), qp.send_cq, completion_of(qp, wqe, WcStatus::WrFlushError), false);
}

}  // namespace softverbs::udp
