// The responder: executes the requests that arrive for a QP, in the QP
// owner's own process (so data lands with one memcpy), as a pipeline of
// checks in the order of the IB spec's responder chapter (and rxe_resp.c):
//   check_psn -> check_op_sequence -> check_op_valid -> check_resource ->
//   check_length -> check_rkey -> execute -> acknowledge.
// Each check either lets the packet through or ends it with its verdict:
// drop, ACK a duplicate, NAK (PSN sequence error, RNR, invalid request,
// remote access, remote operational error). Answers queue in an outbox and
// leave in order; READ responses are paced by responder_send().
#include <algorithm>
#include <cstring>
#include <optional>

#include "device/memory_window.h"
#include "device/queues.h"
#include "device/receive_queue.h"
#include "shm/memory_copy.h"
#include "support/debug_log.h"
#include "support/payload_copy.h"
#include "support/process_id.h"
#include "udp/internal.h"
#include "udp/parameters.h"
#include "verbs/adversary.h"

namespace softverbs::udp {

namespace {

using namespace wire;
using namespace parameters;

using Kind = OpKind;
using Position = OpPosition;

struct Classified {
  Kind kind = Kind::Send;
  Position position = Position::Only;
  bool immediate = false;
  // Not of the packet but of this handing-in: whether the caller lets it
  // wait for a receive (see responder_receive), and where check_rkey found
  // the first byte of the WRITE it let through, for execute_write to place
  // the payload without a second lookup (the region stays registered while
  // the engine's mutex is held).
  bool may_await_receive = false;
  std::optional<uint64_t> write_checked_address{};
};

// A request packet as the opcode table describes it.
Classified classify(uint8_t opcode) {
  const OpcodeInfo& info = opcode_info(opcode);
  return {info.kind, info.position, info.immediate()};
}

bool starts_message(Position p) { return p == Position::First || p == Position::Only; }
bool ends_message(Position p) { return p == Position::Last || p == Position::Only; }

QpRecord& record_of(TransportPort& port, const UdpQp& qp) { return port.memory().shared().qps[qp.index]; }

// ---- answers -------------------------------------------------------------------

void queue_ack(UdpQp& qp, bool requested) {
  ResponderState& s = qp.responder;
  uint32_t psn = psn_add(s.expected_psn, kPsnMask);  // expected - 1
  if (!s.outbox.empty() && s.outbox.back().kind == Response::Kind::Ack) {
    s.outbox.back().psn = psn;
    s.outbox.back().msn = s.msn;
    s.outbox.back().requested |= requested;
    return;
  }
  Response ack;
  ack.kind = Response::Kind::Ack;
  ack.psn = psn;
  ack.msn = s.msn;
  ack.requested = requested;
  s.outbox.push_back(ack);
}

void queue_nak(UdpQp& qp, uint32_t psn, uint8_t syndrome) {
  Response nak;
  nak.kind = Response::Kind::Nak;
  nak.psn = psn;
  nak.syndrome = syndrome;
  nak.msn = qp.responder.msn;
  qp.responder.outbox.push_back(nak);
}

void complete_receive(TransportPort& port, UdpQp& qp, WcStatus status, WcOpcode opcode, uint32_t byte_len,
                      const TransportPacket* packet, bool with_immediate) {
  ResponderState& s = qp.responder;
  Completion c;
  c.wr_id = s.receive_wr_id;
  c.status = status;
  c.opcode = opcode;
  c.byte_len = status == WcStatus::Success ? byte_len : 0;
  c.qp_num = qp.qpn;
  c.src_qp = qp.dest_qpn;
  if (with_immediate && packet != nullptr) {
    c.imm_data = htobe32(packet->immediate);
    c.flags |= wc_flag::kWithImm;
  }
  if (status == WcStatus::Success && packet != nullptr && (opcode_info(packet->bth.opcode).headers & header::kIeth)) {
    c.imm_data = packet->invalidate_rkey;
    c.flags |= wc_flag::kWithInvalidate;
  }
  bool solicited = packet != nullptr && packet->bth.solicited;
  s.have_receive = false;
  // An overrun CQ takes the QP to ERR, as on an HCA.
  if (!deliver_completion(port.memory(), s.receive_cq >= 0 ? s.receive_cq : qp.recv_cq, c, solicited))
    enter_error(port, qp);
}

// A request the responder cannot carry out (IBA class B/C/D errors on RC):
// the NAK goes out with everything queued before it, the receive WQE in
// progress (if any) completes with `receive_status`, and the QP goes to ERR.
void fail_request(TransportPort& port, UdpQp& qp, uint32_t psn, uint8_t nak_code, WcStatus receive_status) {
  port.counters().add(Counter::ErrorNaksSent);
  queue_nak(qp, psn, static_cast<uint8_t>(aeth::kNak | nak_code));
  responder_send(port, qp, UINT32_MAX);
  if (qp.responder.have_receive) complete_receive(port, qp, receive_status, WcOpcode::Receive, 0, nullptr, false);
  enter_error(port, qp);
}

// UC has no NAKs: the rest of the message is dropped, silently.
void drop_message(UdpQp& qp, const Classified& what) {
  ResponderState& s = qp.responder;
  s.in_message = MessageKind::None;
  s.drop_until_first = !ends_message(what.position);
}

// ---- the checks ----------------------------------------------------------------

enum class Verdict : uint8_t {
  Continue,
  Done,
  AwaitReceive,  // no receive posted, and the caller lets the packet wait for one
};

Verdict handle_duplicate(TransportPort& port, UdpQp& qp, const TransportPacket& packet, const Classified& what);

Verdict check_psn(TransportPort& port, UdpQp& qp, const TransportPacket& packet, Classified& what) {
  ResponderState& s = qp.responder;
  const int32_t distance = psn_distance(packet.bth.psn, s.expected_psn);
  if (qp.type == QpType::Uc) {
    if (distance != 0) {
      // Packets were lost: whatever message was under way is gone.
      port.counters().add(Counter::OutOfSequenceDropped);
      s.in_message = MessageKind::None;
      s.drop_until_first = !starts_message(what.position);
      s.expected_psn = packet.bth.psn;
    }
    if (s.drop_until_first) {
      if (!starts_message(what.position)) {
        s.expected_psn = psn_add(packet.bth.psn, 1);
        return Verdict::Done;
      }
      s.drop_until_first = false;
    }
    return Verdict::Continue;
  }
  if (distance > 0) {
    port.counters().add(Counter::OutOfSequenceDropped);
    if (!s.sequence_nak_sent) {
      s.sequence_nak_sent = true;
      port.counters().add(Counter::SequenceNaksSent);
      queue_nak(qp, s.expected_psn, aeth::kNak | aeth::kNakSequenceError);
    }
    return Verdict::Done;
  }
  if (distance < 0) return handle_duplicate(port, qp, packet, what);
  return Verdict::Continue;
}

Verdict check_op_sequence(TransportPort& port, UdpQp& qp, const TransportPacket& packet, Classified& what) {
  ResponderState& s = qp.responder;
  bool valid;
  if (what.position == Position::Middle || what.position == Position::Last)
    valid = s.in_message == (what.kind == Kind::Send ? MessageKind::Send : MessageKind::Write);
  else
    valid = s.in_message == MessageKind::None;
  if (valid) return Verdict::Continue;
  debug_log("QP %#x: opcode %s out of sequence at PSN %#x", qp.qpn, opcode_info(packet.bth.opcode).name,
            packet.bth.psn);
  if (qp.type == QpType::Uc) {
    drop_message(qp, what);
    s.expected_psn = psn_add(packet.bth.psn, 1);
    return Verdict::Done;
  }
  fail_request(port, qp, packet.bth.psn, aeth::kNakInvalidRequest, WcStatus::RemoteInvalidRequestError);
  return Verdict::Done;
}

Verdict check_op_valid(TransportPort& port, UdpQp& qp, const TransportPacket& packet, Classified& what) {
  uint32_t needed = 0;
  if (what.kind == Kind::Write || what.kind == Kind::AtomicWrite) needed = access::kRemoteWrite;
  if (what.kind == Kind::ReadRequest) needed = access::kRemoteRead;
  if (what.kind == Kind::Atomic) needed = access::kRemoteAtomic;
  if ((qp.attributes.access_flags & needed) == needed) return Verdict::Continue;
  if (qp.type == QpType::Uc) {
    drop_message(qp, what);
    qp.responder.expected_psn = psn_add(packet.bth.psn, 1);
    return Verdict::Done;
  }
  debug_log("QP %#x: %s refused by the QP's access flags %#x", qp.qpn, opcode_info(packet.bth.opcode).name,
            qp.attributes.access_flags);
  // An operation the QP does not allow is a remote access error, as HCAs
  // report it.
  fail_request(port, qp, packet.bth.psn, aeth::kNakRemoteAccessError, WcStatus::RemoteAccessError);
  return Verdict::Done;
}

// Every XRC request names, in its XRCETH, an XRC SRQ of the XRC_RECV QP's
// domain; one that does not is an invalid request (IBA 9.7.5.2: class C,
// the responder fails too). The SRQ's PD is the one this request's keys
// are checked in: an XRC_RECV QP has none of its own.
Verdict check_xrc_srq(TransportPort& port, UdpQp& qp, const TransportPacket& packet, Classified&) {
  if (qp.xrc != XrcRole::Recv) return Verdict::Continue;
  const SrqRecord* srq = find_xrc_srq(port.memory(), record_of(port, qp), packet.xrc_srqn);
  if (srq != nullptr) {
    qp.pd_handle = srq->pd_handle;
    return Verdict::Continue;
  }
  debug_log("QP %#x: XRC SRQ %#x is no XRC SRQ of its domain", qp.qpn, packet.xrc_srqn);
  fail_request(port, qp, packet.bth.psn, aeth::kNakInvalidRequest, WcStatus::RemoteInvalidRequestError);
  return Verdict::Done;
}

// Adversarial mode answers the first SEND to each RC QP with an RNR NAK,
// where the requester is known to retry RNR: its QP, found in this
// device, is connected to this one and has rnr_retry > 0.
bool adversarial_rnr(TransportPort& port, const UdpQp& qp) {
  if (qp.type != QpType::Rc || qp.xrc != XrcRole::None) return false;
  const QpRecord* requester = port.memory().qp_by_number(qp.attributes.dest_qpn);
  if (requester == nullptr || requester->attributes.dest_qpn != qp.qpn || requester->attributes.rnr_retry == 0)
    return false;
  return adversary::rnr_for_first_send(qp.qpn);
}

// A SEND's first packet, or the last of a WRITE with immediate, needs a
// receive WQE: none posted means RNR (RC) or a dropped message (UC).
Verdict check_resource(TransportPort& port, UdpQp& qp, const TransportPacket& packet, Classified& what) {
  ResponderState& s = qp.responder;
  if (!opcode_info(packet.bth.opcode).consumes_receive() || s.have_receive) return Verdict::Continue;
  if (adversary::enabled() && what.kind == Kind::Send && adversarial_rnr(port, qp)) [[unlikely]] {
    port.counters().add(Counter::RnrNaksSent);
    queue_nak(qp, packet.bth.psn, static_cast<uint8_t>(aeth::kRnrNak | (qp.attributes.min_rnr_timer & 0x1f)));
    return Verdict::Done;
  }
  ReceivePlacement receive;
  bool taken;
  {
    QpRecord& record = record_of(port, qp);
    SharedLock lock(record.lock);
    taken = record.live && record.qpn == qp.qpn &&
            (qp.xrc == XrcRole::Recv ? take_xrc_receive(port.memory(), record, packet.xrc_srqn, receive)
                                     : take_receive(port.memory(), record, receive));
  }
  if (!taken) {
    if (qp.type == QpType::Uc) {
      drop_message(qp, what);
      s.expected_psn = psn_add(packet.bth.psn, 1);
      return Verdict::Done;
    }
    if (what.may_await_receive) return Verdict::AwaitReceive;
    port.counters().add(Counter::RnrNaksSent);
    queue_nak(qp, packet.bth.psn, static_cast<uint8_t>(aeth::kRnrNak | (qp.attributes.min_rnr_timer & 0x1f)));
    return Verdict::Done;
  }
  s.have_receive = true;
  s.receive_cq = receive.cq;
  s.receive_wr_id = receive.wr_id;
  s.receive_sges = receive.sges;
  s.receive_capacity = receive.capacity;
  s.received = 0;
  if (receive.protection_error) {
    if (qp.type == QpType::Uc) {
      complete_receive(port, qp, WcStatus::LocalProtectionError, WcOpcode::Receive, 0, nullptr, false);
      drop_message(qp, what);
      s.expected_psn = psn_add(packet.bth.psn, 1);
      return Verdict::Done;
    }
    fail_request(port, qp, packet.bth.psn, aeth::kNakRemoteOperationalError, WcStatus::LocalProtectionError);
    return Verdict::Done;
  }
  return Verdict::Continue;
}

Verdict check_length(TransportPort& port, UdpQp& qp, const TransportPacket& packet, Classified& what) {
  ResponderState& s = qp.responder;
  const uint64_t length = packet.payload.size();
  bool valid = true;
  switch (what.position) {
    case Position::First:
    case Position::Middle:
      valid = length == qp.mtu;
      break;
    case Position::Last:
      valid = length >= 1 && length <= qp.mtu;
      break;
    case Position::Only:
      valid = length <= qp.mtu;
      break;
  }
  if (what.kind == Kind::Write) {
    uint64_t total = starts_message(what.position) ? packet.reth.dma_length : s.write_length;
    uint64_t before = starts_message(what.position) ? 0 : s.written;
    if (before + length > total || (ends_message(what.position) && before + length != total)) valid = false;
  }
  if (what.kind == Kind::ReadRequest && packet.reth.dma_length > limits::kMaxMessageSize) valid = false;
  if (what.kind == Kind::AtomicWrite && (length != 8 || packet.reth.dma_length != 8)) valid = false;
  if (valid && what.kind == Kind::Send && s.received + length > s.receive_capacity) {
    // The message does not fit the receive buffer: the receiver sees
    // IBV_WC_LOC_LEN_ERR, the sender IBV_WC_REM_INV_REQ_ERR.
    debug_log("QP %#x: SEND of more than %llu bytes into a %llu-byte receive buffer", qp.qpn,
              static_cast<unsigned long long>(s.received + length),
              static_cast<unsigned long long>(s.receive_capacity));
    if (qp.type == QpType::Uc) {
      complete_receive(port, qp, WcStatus::LocalLengthError, WcOpcode::Receive, 0, nullptr, false);
      drop_message(qp, what);
      s.expected_psn = psn_add(packet.bth.psn, 1);
      return Verdict::Done;
    }
    fail_request(port, qp, packet.bth.psn, aeth::kNakInvalidRequest, WcStatus::LocalLengthError);
    return Verdict::Done;
  }
  if (valid) return Verdict::Continue;
  debug_log("QP %#x: %s with %llu payload bytes is malformed for MTU %u", qp.qpn, opcode_info(packet.bth.opcode).name,
            static_cast<unsigned long long>(length), qp.mtu);
  if (qp.type == QpType::Uc) {
    if (s.have_receive) complete_receive(port, qp, WcStatus::LocalLengthError, WcOpcode::Receive, 0, nullptr, false);
    drop_message(qp, what);
    s.expected_psn = psn_add(packet.bth.psn, 1);
    return Verdict::Done;
  }
  fail_request(port, qp, packet.bth.psn, aeth::kNakInvalidRequest, WcStatus::RemoteInvalidRequestError);
  return Verdict::Done;
}

// A range of registered memory that a request names by key: an rkey's
// (WRITE, READ, atomics) or an lkey's (the receive buffer a SEND fills).
struct KeyedRange {
  uint32_t key = 0;
  uint64_t address = 0;  // as the key names it (its region's iova space)
  uint64_t length = 0;
  uint32_t needed = 0;  // the right exercised (access::k*)
  bool local_key = false;
};

// This process's own regions are looked up without the device's memory_lock
// by default, as the range found stays good while the engine's mutex is
// held (see gather_local); an XRC_RECV QP's, which may be another
// process's, under it.
KeyCheck check_key(TransportPort& port, const UdpQp& qp, const KeyedRange& range, ResolvedRange& where,
                   MemoryRegionTable::Lock lock = MemoryRegionTable::Lock::NotHeld) {
  if (qp.xrc == XrcRole::Recv && lock == MemoryRegionTable::Lock::NotHeld) {
    MemoryReadLock memory_lock(port.memory());
    return check_key(port, qp, range, where, MemoryRegionTable::Lock::Held);
  }
  MemoryRegionTable& mrs = port.memory().shared().mrs;
  KeyCheck verdict =
      range.local_key
          ? mrs.check_local(range.key, qp.pd_handle, range.address, range.length, range.needed, &where, lock)
          : mrs.check_remote(range.key, qp.pd_handle, qp.qpn, range.address, range.length, range.needed, &where, lock);
  if (verdict == KeyCheck::Ok && !reaches_memory_of(where.owner_pid, current_pid(), qp.xrc))
    verdict = KeyCheck::InvalidKey;
  return verdict;
}

KeyCheck check_remote(TransportPort& port, const UdpQp& qp, uint32_t rkey, uint64_t iova, uint64_t length,
                      uint32_t needed, ResolvedRange& where,
                      MemoryRegionTable::Lock lock = MemoryRegionTable::Lock::NotHeld) {
  return check_key(port, qp, KeyedRange{rkey, iova, length, needed, false}, where, lock);
}

// Moves `range.length` bytes between `local` and the memory `range` names
// (into it when `into_memory`); false if the key no longer allows it (the
// region was deregistered under the message) or the copy failed. Another
// process's memory is reached by copy_to_process / copy_from_process
// under memory_lock, which keeps its key valid while the bytes move.
bool move_bytes(TransportPort& port, const UdpQp& qp, const KeyedRange& range, void* local, bool into_memory) {
  if (range.length == 0) return true;
  DeviceMemory& memory = port.memory();
  std::optional<MemoryReadLock> memory_lock;
  if (qp.xrc == XrcRole::Recv) memory_lock.emplace(memory);
  ResolvedRange where;
  if (check_key(port, qp, range, where,
                memory_lock ? MemoryRegionTable::Lock::Held : MemoryRegionTable::Lock::NotHeld) != KeyCheck::Ok)
    return false;
  if (where.owner_pid == current_pid()) {
    auto* mine = reinterpret_cast<void*>(where.address);
    if (into_memory)
      copy_payload(mine, local, range.length);
    else
      copy_payload(local, mine, range.length);
    return true;
  }
  const iovec piece{local, range.length};
  const RemoteRange remote{where.address, range.length, range.key, range.needed};
  return (into_memory ? copy_to_process(memory, where.owner_pid, std::span(&piece, 1), std::span(&remote, 1))
                      : copy_from_process(memory, where.owner_pid, std::span(&piece, 1), std::span(&remote, 1))) == 0;
}

bool store(TransportPort& port, const UdpQp& qp, const KeyedRange& range, const uint8_t* bytes) {
  return move_bytes(port, qp, range, const_cast<uint8_t*>(bytes), true);
}

bool load(TransportPort& port, const UdpQp& qp, const KeyedRange& range, uint8_t* into) {
  return move_bytes(port, qp, range, into, false);
}

Verdict check_rkey(TransportPort& port, UdpQp& qp, const TransportPacket& packet, Classified& what) {
  if (!starts_message(what.position) || what.kind == Kind::Send) return Verdict::Continue;
  uint32_t rkey;
  uint64_t iova, length;
  uint32_t needed;
  if (what.kind == Kind::Atomic) {
    rkey = packet.atomic.rkey;
    iova = packet.atomic.virtual_address;
    length = 8;
    needed = access::kRemoteAtomic;
    if (iova % 8 != 0) {
      debug_log("QP %#x: atomic at unaligned address %#llx", qp.qpn, static_cast<unsigned long long>(iova));
      fail_request(port, qp, packet.bth.psn, aeth::kNakInvalidRequest, WcStatus::RemoteInvalidRequestError);
      return Verdict::Done;
    }
  } else {
    rkey = packet.reth.rkey;
    iova = packet.reth.virtual_address;
    length = packet.reth.dma_length;
    needed = what.kind == Kind::ReadRequest ? access::kRemoteRead : access::kRemoteWrite;
  }
  // A zero-length RDMA operation touches no memory and checks no key (IBA 9.4.4).
  if (length == 0) return Verdict::Continue;
  ResolvedRange where;
  KeyCheck verdict = check_remote(port, qp, rkey, iova, length, needed, where);
  if (verdict == KeyCheck::Ok) {
    if (what.kind == Kind::Write && where.owner_pid == current_pid()) what.write_checked_address = where.address;
    // An ATOMIC WRITE's alignment is checked after its key, as rxe does.
    if (what.kind == Kind::AtomicWrite && iova % 8 != 0) {
      debug_log("QP %#x: ATOMIC WRITE at unaligned address %#llx", qp.qpn, static_cast<unsigned long long>(iova));
      fail_request(port, qp, packet.bth.psn, aeth::kNakInvalidRequest, WcStatus::RemoteInvalidRequestError);
      return Verdict::Done;
    }
    return Verdict::Continue;
  }
  debug_log("QP %#x: %s rkey %#x addr %#llx len %llu refused (check %d)", qp.qpn, opcode_info(packet.bth.opcode).name,
            rkey, static_cast<unsigned long long>(iova), static_cast<unsigned long long>(length),
            static_cast<int>(verdict));
  if (qp.type == QpType::Uc) {
    drop_message(qp, what);
    qp.responder.expected_psn = psn_add(packet.bth.psn, 1);
    return Verdict::Done;
  }
  fail_request(port, qp, packet.bth.psn, aeth::kNakRemoteAccessError, WcStatus::RemoteAccessError);
  return Verdict::Done;
}

// ---- execution -----------------------------------------------------------------

// Copies a SEND's payload into the receive WQE at the current offset.
bool place_send_payload(TransportPort& port, UdpQp& qp, std::span<const uint8_t> payload) {
  ResponderState& s = qp.responder;
  if (payload.empty()) return true;
  uint64_t skip = s.received;
  size_t at = 0;
  for (const Sge& sge : s.receive_sges) {
    if (skip >= sge.length) {
      skip -= sge.length;
      continue;
    }
    uint64_t take = std::min<uint64_t>(sge.length - skip, payload.size() - at);
    if (!store(port, qp, KeyedRange{sge.lkey, sge.address + skip, take, access::kLocalWrite, true},
               payload.data() + at))
      return false;
    at += take;
    skip = 0;
    if (at == payload.size()) break;
  }
  s.received += payload.size();
  return true;
}

void execute_send(TransportPort& port, UdpQp& qp, const TransportPacket& packet, const Classified& what) {
  ResponderState& s = qp.responder;
  if (!place_send_payload(port, qp, packet.payload)) {
    // The receive buffer was deregistered under the message.
    if (qp.type == QpType::Uc) {
      complete_receive(port, qp, WcStatus::LocalProtectionError, WcOpcode::Receive, 0, nullptr, false);
      drop_message(qp, what);
      s.expected_psn = psn_add(packet.bth.psn, 1);
      return;
    }
    fail_request(port, qp, packet.bth.psn, aeth::kNakRemoteOperationalError, WcStatus::LocalProtectionError);
    return;
  }
  if (ends_message(what.position) && (opcode_info(packet.bth.opcode).headers & header::kIeth) &&
      !invalidate_on_receive(port.memory(), qp.pd_handle, qp.qpn, packet.invalidate_rkey)) {
    // IBA class J: the receive fails, the QP goes to ERR, and the requester
    // hears of it as an invalid request.
    fail_request(port, qp, packet.bth.psn, aeth::kNakInvalidRequest, WcStatus::RemoteInvalidRequestError);
    return;
  }
  s.expected_psn = psn_add(packet.bth.psn, 1);
  if (ends_message(what.position)) {
    complete_receive(port, qp, WcStatus::Success, WcOpcode::Receive, static_cast<uint32_t>(s.received), &packet,
                     what.immediate);
    s.in_message = MessageKind::None;
    s.msn = psn_add(s.msn, 1);
  } else {
    s.in_message = MessageKind::Send;
  }
}

void execute_write(TransportPort& port, UdpQp& qp, const TransportPacket& packet, const Classified& what) {
  ResponderState& s = qp.responder;
  if (starts_message(what.position)) {
    s.write_iova = packet.reth.virtual_address;
    s.write_rkey = packet.reth.rkey;
    s.write_length = packet.reth.dma_length;
    s.written = 0;
  }
  // Checked again per packet: the region may have been deregistered since
  // the first one (which check_rkey checked just now).
  auto place = [&]() {
    if (packet.payload.empty()) return true;
    if (what.write_checked_address) {  // the first packet, whose range in this process check_rkey found
      copy_payload(reinterpret_cast<void*>(*what.write_checked_address), packet.payload.data(), packet.payload.size());
      return true;
    }
    return store(port, qp,
                 KeyedRange{s.write_rkey, s.write_iova + s.written, packet.payload.size(), access::kRemoteWrite, false},
                 packet.payload.data());
  };
  if (!place()) {
    if (qp.type == QpType::Uc) {
      drop_message(qp, what);
      s.expected_psn = psn_add(packet.bth.psn, 1);
      return;
    }
    fail_request(port, qp, packet.bth.psn, aeth::kNakRemoteAccessError, WcStatus::RemoteAccessError);
    return;
  }
  s.written += packet.payload.size();
  s.expected_psn = psn_add(packet.bth.psn, 1);
  if (ends_message(what.position)) {
    if (what.immediate)
      complete_receive(port, qp, WcStatus::Success, WcOpcode::ReceiveRdmaWithImm, static_cast<uint32_t>(s.write_length),
                       &packet, true);
    s.in_message = MessageKind::None;
    s.msn = psn_add(s.msn, 1);
  } else {
    s.in_message = MessageKind::Write;
  }
}

void remember(UdpQp& qp, const ReplayEntry& entry) {
  auto& replay = qp.responder.replay;
  replay.push_back(entry);
  while (replay.size() > std::max<size_t>(kReplayEntries, qp.attributes.max_dest_rd_atomic)) replay.pop_front();
}

void queue_read_response(UdpQp& qp, uint32_t psn, const Reth& reth) {
  Response read;
  read.kind = Response::Kind::ReadData;
  read.psn = psn;
  read.rkey = reth.rkey;
  read.iova = reth.virtual_address;
  read.length = reth.dma_length;
  read.packets = packets_for(reth.dma_length, qp.mtu);
  read.msn = qp.responder.msn;
  qp.responder.outbox.push_back(read);
}

void execute_read(UdpQp& qp, const TransportPacket& packet) {
  ResponderState& s = qp.responder;
  s.msn = psn_add(s.msn, 1);
  queue_read_response(qp, packet.bth.psn, packet.reth);
  uint32_t count = packets_for(packet.reth.dma_length, qp.mtu);
  remember(qp, {packet.bth.psn, count, false, 0});
  s.expected_psn = psn_add(packet.bth.psn, count);
}

// The 8 bytes at `where` (checked for `rkey` under memory_lock and the
// atomics lock, which the caller holds) replaced by update(original), as one
// atomic operation where they are this process's and aligned, else under the
// locks only; the original, or nullopt if another process's copy failed.
template <typename Update>
std::optional<uint64_t> update_word(DeviceMemory& memory, const ResolvedRange& where, uint32_t rkey, uint32_t needed,
                                    Update update) {
  if (where.owner_pid != current_pid()) {
    // Another process's, through an XRC_RECV QP: read and written by copy.
    uint64_t original = 0;
    iovec value{&original, 8};
    const RemoteRange remote{where.address, 8, rkey, needed};
    if (needed != access::kRemoteWrite &&
        copy_from_process(memory, where.owner_pid, std::span(&value, 1), std::span(&remote, 1)) != 0)
      return std::nullopt;
    uint64_t updated = update(original);
    iovec next{&updated, 8};
    if (updated != original || needed == access::kRemoteWrite)
      if (copy_to_process(memory, where.owner_pid, std::span(&next, 1), std::span(&remote, 1)) != 0)
        return std::nullopt;
    return original;
  }
  uint64_t original;
  if (where.address % 8 == 0) {
    auto* target = reinterpret_cast<uint64_t*>(where.address);
    original = __atomic_load_n(target, __ATOMIC_SEQ_CST);
    while (
        !__atomic_compare_exchange_n(target, &original, update(original), false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return original;
  }
  // Aligned as an iova but not in the process (a registration whose iova
  // and address differ in alignment): atomic under the locks only.
  auto* target = reinterpret_cast<uint8_t*>(where.address);
  std::memcpy(&original, target, 8);
  const uint64_t updated = update(original);
  std::memcpy(target, &updated, 8);
  return original;
}

void execute_atomic(TransportPort& port, UdpQp& qp, const TransportPacket& packet) {
  ResponderState& s = qp.responder;
  DeviceMemory& memory = port.memory();
  std::optional<uint64_t> original;
  {
    MemoryReadLock memory_lock(memory);
    SharedLock atomics(memory.shared().atomics_lock);
    ResolvedRange where;
    const bool fetch_add = (packet.bth.opcode & 0x1f) == op::kFetchAdd;
    const uint64_t operand = packet.atomic.swap_add, compare = packet.atomic.compare;
    if (check_remote(port, qp, packet.atomic.rkey, packet.atomic.virtual_address, 8, access::kRemoteAtomic, where,
                     MemoryRegionTable::Lock::Held) != KeyCheck::Ok) {
      original = 0;  // checked in check_rkey; cannot change under memory_lock
    } else {
      original = update_word(memory, where, packet.atomic.rkey, access::kRemoteAtomic, [&](uint64_t value) {
        return fetch_add ? value + operand : value == compare ? operand : value;
      });
    }
  }
  if (!original) {  // the other process's memory could not be reached
    fail_request(port, qp, packet.bth.psn, aeth::kNakRemoteAccessError, WcStatus::RemoteAccessError);
    return;
  }
  s.msn = psn_add(s.msn, 1);
  Response ack;
  ack.kind = Response::Kind::AtomicAck;
  ack.psn = packet.bth.psn;
  ack.msn = s.msn;
  ack.original = *original;
  s.outbox.push_back(ack);
  remember(qp, {packet.bth.psn, 1, true, *original});
  s.expected_psn = psn_add(packet.bth.psn, 1);
}

// Its 8 bytes in one store, under the device's atomics lock so that device
// atomics never interleave with it; answered by a zero-length READ RESPONSE
// ONLY, and remembered so that a duplicate is answered again, not redone.
void execute_atomic_write(TransportPort& port, UdpQp& qp, const TransportPacket& packet) {
  ResponderState& s = qp.responder;
  DeviceMemory& memory = port.memory();
  bool stored = true;
  {
    MemoryReadLock memory_lock(memory);
    SharedLock atomics(memory.shared().atomics_lock);
    ResolvedRange where;
    uint64_t value;
    std::memcpy(&value, packet.payload.data(), 8);
    // Checked in check_rkey; cannot change under memory_lock.
    if (check_remote(port, qp, packet.reth.rkey, packet.reth.virtual_address, 8, access::kRemoteWrite, where,
                     MemoryRegionTable::Lock::Held) == KeyCheck::Ok) {
      if (where.owner_pid == current_pid() && where.address % 8 == 0)
        __atomic_store_n(reinterpret_cast<uint64_t*>(where.address), value, __ATOMIC_RELEASE);
      else
        stored = update_word(memory, where, packet.reth.rkey, access::kRemoteWrite, [&](uint64_t) {
                   return value;
                 }).has_value();
    }
  }
  if (!stored) {
    fail_request(port, qp, packet.bth.psn, aeth::kNakRemoteAccessError, WcStatus::RemoteAccessError);
    return;
  }
  s.msn = psn_add(s.msn, 1);
  queue_read_response(qp, packet.bth.psn, Reth{packet.reth.virtual_address, packet.reth.rkey, 0});
  remember(qp, {packet.bth.psn, 1, false, 0});
  s.expected_psn = psn_add(packet.bth.psn, 1);
}

// A request seen before (RC): SEND and WRITE are acknowledged again, a READ
// answered again from memory, an atomic answered with its saved result, an
// ATOMIC WRITE with its empty READ RESPONSE.
Verdict handle_duplicate(TransportPort& port, UdpQp& qp, const TransportPacket& packet, const Classified& what) {
  ResponderState& s = qp.responder;
  port.counters().add(Counter::DuplicatesReceived);
  const uint32_t psn = packet.bth.psn;
  if (what.kind == Kind::Send || what.kind == Kind::Write) {
    // The requester is waiting for this ACK (its first one was lost).
    queue_ack(qp, true);
    return Verdict::Done;
  }
  for (auto entry = s.replay.rbegin(); entry != s.replay.rend(); ++entry) {
    int32_t into = psn_distance(psn, entry->psn);
    if (into < 0 || static_cast<uint32_t>(into) >= entry->psn_count) continue;
    if (entry->atomic) {
      if (what.kind != Kind::Atomic || into != 0) return Verdict::Done;
      Response ack;
      ack.kind = Response::Kind::AtomicAck;
      ack.psn = psn;
      ack.msn = s.msn;
      ack.original = entry->original;
      s.outbox.push_back(ack);
      return Verdict::Done;
    }
    if (what.kind == Kind::AtomicWrite) {
      if (into == 0) queue_read_response(qp, psn, Reth{packet.reth.virtual_address, packet.reth.rkey, 0});
      return Verdict::Done;
    }
    if (what.kind != Kind::ReadRequest) return Verdict::Done;
    // Asked again, perhaps only for the missing tail: it must stay within
    // the PSNs of the original request.
    if (packets_for(packet.reth.dma_length, qp.mtu) > entry->psn_count - static_cast<uint32_t>(into))
      return Verdict::Done;
    if (packet.reth.dma_length != 0) {
      ResolvedRange where;
      if (check_remote(port, qp, packet.reth.rkey, packet.reth.virtual_address, packet.reth.dma_length,
                       access::kRemoteRead, where) != KeyCheck::Ok)
        return Verdict::Done;
    }
    queue_read_response(qp, psn, packet.reth);
    return Verdict::Done;
  }
  return Verdict::Done;  // too old to answer: the requester's timer copes
}

// ---- sending answers ------------------------------------------------------------

void send_control(TransportPort& port, UdpQp& qp, const Response& r) {
  TransportPacket packet;
  packet.bth.dest_qp = qp.dest_qpn;
  packet.bth.psn = r.psn;
  packet.aeth.msn = r.msn;
  const Service service = qp.xrc != XrcRole::None ? Service::Xrc : Service::Rc;
  if (r.kind == Response::Kind::AtomicAck) {
    packet.bth.opcode = opcode(service, op::kAtomicAcknowledge);
    packet.aeth.syndrome = aeth::kAck;
    packet.atomic_ack_original = r.original;
  } else {
    packet.bth.opcode = opcode(service, op::kAcknowledge);
    packet.aeth.syndrome = r.kind == Response::Kind::Ack ? aeth::kAck : r.syndrome;
  }
  port.transmit(qp, qp.path, qp.dest_qpn, packet, {});
}

// Sends read response packets of `r`; false if its region went away (the
// rest becomes a remote access NAK).
bool send_read_data(TransportPort& port, UdpQp& qp, Response& r, uint32_t& budget) {
  std::array<uint8_t, 4096> bounce;  // the largest path MTU
  while (r.packets_sent < r.packets && budget > 0) {
    const uint32_t index = r.packets_sent;
    const uint64_t length = std::min<uint64_t>(qp.mtu, r.length - r.sent);
    TransportPacket packet;
    uint8_t operation;
    if (r.packets == 1)
      operation = op::kReadResponseOnly;
    else if (index == 0)
      operation = op::kReadResponseFirst;
    else if (index + 1 == r.packets)
      operation = op::kReadResponseLast;
    else
      operation = op::kReadResponseMiddle;
    packet.bth.opcode = opcode(qp.xrc != XrcRole::None ? Service::Xrc : Service::Rc, operation);
    packet.bth.dest_qp = qp.dest_qpn;
    packet.bth.psn = psn_add(r.psn, index);
    packet.aeth = {aeth::kAck, r.msn};
    iovec piece{nullptr, 0};
    if (length != 0) {
      ResolvedRange where;
      if (check_remote(port, qp, r.rkey, r.iova + r.sent, length, access::kRemoteRead, where) != KeyCheck::Ok)
        return false;
      if (where.owner_pid == current_pid()) {
        piece = {reinterpret_cast<void*>(where.address), length};
      } else {  // another process's (XRC): copied out first, as transmit copies it anyway
        if (!load(port, qp, KeyedRange{r.rkey, r.iova + r.sent, length, access::kRemoteRead, false}, bounce.data()))
          return false;
        piece = {bounce.data(), length};
      }
    }
    port.transmit(qp, qp.path, qp.dest_qpn, packet, std::span(&piece, length != 0 ? 1 : 0));
    r.sent += length;
    ++r.packets_sent;
    --budget;
  }
  return true;
}

}  // namespace

bool responder_send(TransportPort& port, UdpQp& qp, uint32_t budget) {
  ResponderState& s = qp.responder;
  while (!s.outbox.empty() && budget > 0) {
    Response& r = s.outbox.front();
    if (r.kind != Response::Kind::ReadData) {
      send_control(port, qp, r);
      s.outbox.pop_front();
      --budget;
      continue;
    }
    if (!send_read_data(port, qp, r, budget)) {
      Response nak;
      nak.kind = Response::Kind::Nak;
      nak.psn = psn_add(r.psn, r.packets_sent);
      nak.syndrome = aeth::kNak | aeth::kNakRemoteAccessError;
      nak.msn = s.msn;
      port.counters().add(Counter::ErrorNaksSent);
      send_control(port, qp, nak);
      s.outbox.pop_front();
      continue;
    }
    if (r.packets_sent == r.packets) s.outbox.pop_front();
  }
  return !s.outbox.empty();
}

Taken responder_receive(TransportPort& port, UdpQp& qp, const TransportPacket& packet, bool may_await_receive) {
  if (!qp.connected) {
    port.counters().add(Counter::UnknownQp);
    return Taken::Done;
  }
  const Service service = qp.xrc != XrcRole::None ? Service::Xrc : qp.type == QpType::Rc ? Service::Rc : Service::Uc;
  // An XRC_SEND QP only initiates: a request to it is as malformed as one of
  // another service (its PD's memory is no XRC target's).
  if ((packet.bth.opcode & 0xe0) != static_cast<uint8_t>(service) || qp.xrc == XrcRole::Send) {
    port.counters().add(Counter::MalformedPackets);
    return Taken::Done;
  }
  Classified what = classify(packet.bth.opcode);
  // The checks before check_resource change nothing for a packet they let
  // through, so one that waits can be handed in again as it is.
  what.may_await_receive = may_await_receive;
  using Check = Verdict (*)(TransportPort&, UdpQp&, const TransportPacket&, Classified&);
  static constexpr Check kPipeline[] = {check_psn,      check_op_sequence, check_xrc_srq, check_op_valid,
                                        check_resource, check_length,      check_rkey};
  for (Check check : kPipeline) {
    const Verdict verdict = check(port, qp, packet, what);
    if (verdict == Verdict::AwaitReceive) return Taken::AwaitsReceive;
    if (verdict == Verdict::Done) return Taken::Done;
    if (!qp.connected) return Taken::Done;  // a check failed the QP
  }
  ResponderState& s = qp.responder;
  s.sequence_nak_sent = false;
  switch (what.kind) {
    case Kind::Send:
      execute_send(port, qp, packet, what);
      break;
    case Kind::Write:
      execute_write(port, qp, packet, what);
      break;
    case Kind::ReadRequest:
      execute_read(qp, packet);
      break;
    case Kind::Atomic:
      execute_atomic(port, qp, packet);
      break;
    case Kind::AtomicWrite:
      execute_atomic_write(port, qp, packet);
      break;
    default:
      break;  // responses go to the completer
  }
  if (!qp.connected || qp.type != QpType::Rc) return Taken::Done;
  // READ, atomic and ATOMIC WRITE answers acknowledge by themselves. Every message is
  // acknowledged (several in one ACK where they arrive close together);
  // AckReq asks for it without delay (see PortEngine::send_answers_locked).
  if (what.kind == Kind::Send || what.kind == Kind::Write) {
    if (packet.bth.ack_request || ends_message(what.position) || ++s.unacknowledged >= kAckEveryPackets) {
      s.unacknowledged = 0;
      // Only the end of a message waits for its ACK: an AckReq within one
      // keeps the requester's window moving, for which a held ACK is soon
      // enough.
      queue_ack(qp, packet.bth.ack_request && ends_message(what.position));
    }
  }
  return Taken::Done;
}

namespace {

// The 40 bytes a UD receive buffer gets first: for RoCEv2 over IPv4 the IPv4
// header in its last 20 bytes, as RoCE NICs and rxe write it, for IPv6 the
// IPv6 header (ibv_init_ah_from_wc tells them apart).
std::array<uint8_t, 40> ud_grh(const TransportPacket& packet, const FlowAddress& flow, bool immediate) {
  const size_t datagram =
      kBthBytes + 8 + (immediate ? 4 : 0) + packet.payload.size() + pad_bytes(packet.payload.size()) + kIcrcBytes;
  std::array<uint8_t, kMaxIpUdpHeaders> headers;
  write_ip_udp_headers(flow, datagram, true, headers);
  std::array<uint8_t, 40> grh{};
  if (flow.ipv4())
    std::memcpy(grh.data() + 20, headers.data(), 20);
  else
    std::memcpy(grh.data(), headers.data(), 40);
  return grh;
}

// Writes the GRH and then the payload into the receive's SGEs; false if an
// SGE's key does not grant this QP local write access.
bool place_datagram(TransportPort& port, const UdpQp& qp, const ReceivePlacement& receive, std::span<const uint8_t> grh,
                    std::span<const uint8_t> payload) {
  const uint64_t total = grh.size() + payload.size();
  // The GRH, then the payload, as one stream of bytes.
  auto source = [&](uint64_t offset, uint8_t* out, uint64_t length) {
    while (length > 0) {
      uint64_t take;
      if (offset < grh.size()) {
        take = std::min<uint64_t>(length, grh.size() - offset);
        std::memcpy(out, grh.data() + offset, take);
      } else {
        take = length;
        copy_payload(out, payload.data() + (offset - grh.size()), take);
      }
      out += take;
      offset += take;
      length -= take;
    }
  };
  DeviceMemory& memory = port.memory();
  uint64_t at = 0;
  for (size_t i = 0; i < receive.sges.size() && at < total; ++i) {
    const Sge& sge = receive.sges[i];
    uint64_t take = std::min<uint64_t>(sge.length, total - at);
    ResolvedRange where;
    if (memory.shared().mrs.check_local(sge.lkey, qp.pd_handle, sge.address, take, access::kLocalWrite, &where,
                                        MemoryRegionTable::Lock::NotHeld) != KeyCheck::Ok ||
        where.owner_pid != current_pid())
      return false;
    source(at, reinterpret_cast<uint8_t*>(where.address), take);
    at += take;
  }
  return true;
}

}  // namespace

void ud_receive(TransportPort& port, UdpQp& qp, const TransportPacket& packet, const FlowAddress& flow) {
  if (!qp.connected) {
    port.counters().add(Counter::UnknownQp);
    return;
  }
  if (packet.deth.qkey != qp.attributes.qkey) {
    debug_log("UD QP %#x: packet from QP %#x with qkey %#x dropped (QP qkey %#x)", qp.qpn, packet.deth.source_qp,
              packet.deth.qkey, qp.attributes.qkey);
    port.counters().add(Counter::UnknownQp);
    return;
  }
  ReceivePlacement receive;
  bool taken;
  {
    QpRecord& record = record_of(port, qp);
    SharedLock lock(record.lock);
    taken = record.live && record.qpn == qp.qpn && take_receive(port.memory(), record, receive);
  }
  if (!taken) {  // UD: no receive posted, the datagram is dropped
    port.counters().add(Counter::UdNoReceiveDropped);
    return;
  }
  const bool immediate = (packet.bth.opcode & 0x1f) == op::kSendOnlyImm;
  const std::array<uint8_t, 40> grh = ud_grh(packet, flow, immediate);
  Completion c;
  c.wr_id = receive.wr_id;
  c.opcode = WcOpcode::Receive;
  c.qp_num = qp.qpn;
  c.src_qp = packet.deth.source_qp;
  c.flags = wc_flag::kGrh;
  c.sl = roce_packet_type(true, flow.ipv4());  // every packet here is RoCE v2
  if (immediate) {
    c.imm_data = htobe32(packet.immediate);
    c.flags |= wc_flag::kWithImm;
  }
  const uint64_t total = grh.size() + packet.payload.size();
  if (receive.protection_error) {
    c.status = WcStatus::LocalProtectionError;
  } else if (total > receive.capacity) {
    c.status = WcStatus::LocalLengthError;
  } else {
    const bool placed = place_datagram(port, qp, receive, grh, packet.payload);
    c.status = placed ? WcStatus::Success : WcStatus::LocalProtectionError;
    c.byte_len = placed ? static_cast<uint32_t>(total) : 0;
  }
  if (!deliver_completion(port.memory(), qp.recv_cq, c, packet.bth.solicited)) enter_error(port, qp);
}

}  // namespace softverbs::udp
