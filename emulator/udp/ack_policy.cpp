// Which answers a pass sends and which ACKs it holds back (see
// udp/ack_policy.h), and request packets that wait for a receive
// (kReceiveGrace).
#include "udp/ack_policy.h"

#include <algorithm>

#include "support/debug_log.h"
#include "udp/engine.h"

namespace softverbs::udp {

using namespace wire;
using namespace parameters;

// ---- held ACKs -------------------------------------------------------------------------

Clock::time_point HeldAcks::earliest_due() const {
  Clock::time_point earliest = Clock::time_point::max();
  for (const Held& held : held_) earliest = std::min(earliest, due(held));
  return earliest;
}

void HeldAcks::learn(uint32_t qpn, Clock::time_point now) {
  // How long after taking a request in did this application post? Its ACK
  // waited from then (held, or left alone when the hold ran out).
  Clock::time_point since;
  auto pacing = pacing_.find(qpn);
  if (auto held = find(qpn); held != held_.end()) {
    since = held->since;
  } else if (pacing != pacing_.end() && pacing->second.left_alone_since != Clock::time_point::max()) {
    since = pacing->second.left_alone_since;
    pacing->second.left_alone_since = Clock::time_point::max();
  } else {
    return;
  }
  const Clock::duration answer = now - since;
  const Clock::duration hold =
      answer <= kMaxAckHold ? std::clamp<Clock::duration>(answer * 2, kAckHold, kMaxAckHold) : kAckHold;
  if (pacing != pacing_.end())
    pacing->second.hold = hold;
  else if (hold != Clock::duration(kAckHold))
    pacing_[qpn].hold = hold;
}

void PortEngine::send_answers_locked(Acks acks, Clock::time_point now, bool& more, bool& answered_short_request) {
  // A pass that posted a request sends every held ACK; any pass sends those
  // whose hold ran out.
  for (const HeldAcks::Held& held : held_acks_)
    if (acks == Acks::Send || held_acks_.due(held) <= now) touched_.push_back(held.qpn);
  if (touched_.size() > 1) {
    std::sort(touched_.begin(), touched_.end());
    touched_.erase(std::unique(touched_.begin(), touched_.end()), touched_.end());
  }
  for (uint32_t qpn : touched_) {
    UdpQp* qp = find(qpn);
    if (qp == nullptr) continue;
    const auto held = held_acks_.find(qpn);
    const bool hold_ran_out = held != held_acks_.end() && held_acks_.due(*held) <= now;
    const auto& outbox = qp->responder.outbox;
    // An ACK that its requester asked for, from a QP whose application let
    // the last hold run out without posting, leaves now: that application
    // takes requests in and does not answer them (a WRITE's target, a
    // receiver of SENDs), and a requester with nothing else in flight (see
    // udp/requester.cpp) would wait out the hold and a wake-up of this
    // thread for each request.
    const bool only_ack = outbox.size() == 1 && outbox.front().kind == Response::Kind::Ack;
    const bool ack_awaited = only_ack && outbox.front().requested && held_acks_.app_left_last_ack_alone(qpn);
    if (acks == Acks::Hold && only_ack && !hold_ran_out && !ack_awaited) {
      if (held == held_acks_.end()) held_acks_.hold(qpn, now);
      continue;
    }
    if (ack_awaited) answered_short_request = true;  // see kAnswerSpin
    if (held != held_acks_.end()) {
      // Left alone because its hold ran out (see HeldAcks::learn).
      if (acks == Acks::Hold && hold_ran_out) held_acks_.note_left_alone(qpn, held->since);
      held_acks_.erase(held);
    }
    if (!outbox.empty() &&
        (outbox.front().kind == Response::Kind::AtomicAck ||
         (outbox.front().kind == Response::Kind::ReadData && outbox.front().packets <= kAnswerSpinAfterPackets)))
      answered_short_request = true;
    if (responder_send(*this, *qp, kReadBudgetPerPass)) more = true;
  }
  touched_.clear();
}

void PortEngine::send_held_ack_locked(uint32_t qpn) {
  auto held = held_acks_.find(qpn);
  if (held == held_acks_.end()) return;
  held_acks_.erase(held);
  if (UdpQp* qp = find(qpn)) responder_send(*this, *qp, kReadBudgetPerPass);
  flush_sends();
}

// ---- request packets that wait for a receive ----------------------------------------------

void PortEngine::take_request_locked(UdpQp& qp, const TransportPacket& packet, std::span<const uint8_t> bytes) {
  ResponderState& s = qp.responder;
  // Once per run of packets, not per packet: send_answers_locked sorts these.
  if (touched_.empty() || touched_.back() != qp.qpn) touched_.push_back(qp.qpn);
  bool may_wait = true;
  if (!s.awaiting_receive.empty()) {
    if (s.awaiting_receive.size() < kMaxAwaitingPackets) {
      s.awaiting_receive.emplace_back(bytes.begin(), bytes.end());  // in order, behind the one that waits
      return;
    }
    // The requester goes on sending: waiting on would only buffer more.
    retry_awaiting_locked(qp, false);
    may_wait = false;
  }
  // The answer to a request may come before the request's ACK (in the same
  // UDP GSO send: see after_work), or after it while the application is
  // still on its way from the poll that can have returned the completion to
  // the receive it posts in answer (one call since, or none), or soon after.
  // Only a packet that takes a receive can wait, and only such a packet
  // reads the clock.
  const RequesterState& r = qp.requester;
  const bool calls_since_completion_at_most_one =
      r.completed_at_call != UINT64_MAX && application_calls() - r.completed_at_call <= 1;
  may_wait = may_wait && qp.type == QpType::Rc && opcode_info(packet.bth.opcode).consumes_receive() &&
             (!r.queue.empty() || calls_since_completion_at_most_one || r.last_completion > now() - kReceiveGrace);
  if (responder_receive(*this, qp, packet, may_wait) != Taken::AwaitsReceive) return;
  s.awaiting_receive.emplace_back(bytes.begin(), bytes.end());
  debug_log("QP %#x: SEND at PSN %#x waits for a receive", qp.qpn, packet.bth.psn);
  s.await_until = now() + kReceiveGrace;
  awaiting_receive_qps_.push_back(qp.qpn);
  note_awaiting_count_locked();
  counters().add(Counter::ReceiveWaits);
}

void PortEngine::retry_awaiting_locked(UdpQp& qp, bool may_wait) {
  ResponderState& s = qp.responder;
  while (!s.awaiting_receive.empty()) {
    // Taken off first: serving it can move the QP to error (a CQ overrun),
    // which empties the queue under us.
    auto bytes = std::move(s.awaiting_receive.front());
    s.awaiting_receive.pop_front();
    const auto packet = parse(bytes);  // parsed once already: cannot fail
    if (packet && responder_receive(*this, qp, *packet, may_wait) == Taken::AwaitsReceive) {
      s.awaiting_receive.push_front(std::move(bytes));
      return;
    }
  }
  s.await_until = Clock::time_point::max();
  touched_.push_back(qp.qpn);
  std::erase(awaiting_receive_qps_, qp.qpn);
  note_awaiting_count_locked();
}

void PortEngine::retry_all_awaiting_locked(Clock::time_point now) {
  const std::vector<uint32_t> waiting = awaiting_receive_qps_;  // retrying shortens the list
  for (uint32_t qpn : waiting)
    if (UdpQp* qp = find(qpn)) retry_awaiting_locked(*qp, now < qp->responder.await_until);
}

Clock::time_point PortEngine::earliest_receive_wait_locked() const {
  Clock::time_point earliest = Clock::time_point::max();
  for (uint32_t qpn : awaiting_receive_qps_) {
    auto it = qps_.find(qpn);
    if (it != qps_.end()) earliest = std::min(earliest, it->second.responder.await_until);
  }
  return earliest;
}

}  // namespace softverbs::udp
