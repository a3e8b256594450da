// The requester: walks a QP's send queue and turns work requests into
// packets: SEND and RDMA WRITE segmented at the path MTU into first, middle,
// last or only packets (a WRITE without immediate into WRITE ONLY packets
// unless asked otherwise: see WriteFraming); an RDMA READ as one request
// whose responses use one PSN each; an atomic or an ATOMIC WRITE as one
// request. For RC it keeps at most its window of PSNs unacknowledged
// (TransportPort::window) and at most max_rd_atomic READs and atomics (ATOMIC WRITEs among them) outstanding.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "device/memory_window.h"
#include "support/debug_log.h"
#include "support/process_id.h"
#include "udp/internal.h"
#include "udp/parameters.h"

namespace softverbs::udp {

namespace {

using namespace wire;
using namespace parameters;

Service service_of(const UdpQp& qp) {
  if (qp.xrc != XrcRole::None) return Service::Xrc;
  switch (qp.type) {
    case QpType::Uc:
      return Service::Uc;
    case QpType::Ud:
      return Service::Ud;
    case QpType::Rc:
      break;
  }
  return Service::Rc;
}

// How an RDMA WRITE of more than one packet goes on the wire. An HCA sends
// it as one message, FIRST (with the RETH) then MIDDLE and LAST packets; over
// UDP that costs two sends per 64 KiB at path MTU 4096, since a UDP GSO send
// carries datagrams of one length (but the last) and FIRST is 16 bytes
// longer than the rest, and on loopback a send costs about the same whatever
// it carries (bench/udp_pingpong). So by default each packet is a WRITE ONLY
// message of its own, with a RETH for its part of the range: all of one
// length, up to 15 in one send. The responder places the same bytes at the
// same addresses, in PSN order, and the requester's completion is the same;
// what differs from an HCA is the capture, and that a WRITE whose range runs
// past the remote region has its parts before that point placed before the
// NAK. SOFTVERBS_UDP_WRITES=messages sends them as an HCA does. A WRITE
// with immediate stays one message: its immediate's receive completion
// reports the whole length.
enum class WriteFraming { Packets, Messages };

WriteFraming configured_write_framing() {
  static const WriteFraming framing = [] {
    const char* text = std::getenv("SOFTVERBS_UDP_WRITES");
    if (text == nullptr || std::strcmp(text, "packets") == 0) return WriteFraming::Packets;
    if (std::strcmp(text, "messages") == 0) return WriteFraming::Messages;
    std::fprintf(stderr, "softverbs: SOFTVERBS_UDP_WRITES=%s is neither packets nor messages; using packets\n", text);
    return WriteFraming::Packets;
  }();
  return framing;
}

uint8_t segment_opcode(const UdpQp& qp, const SendWqe& wqe, uint32_t index, uint32_t count) {
  const bool first = index == 0, last = index + 1 == count;
  const SendOpcodeInfo& info = send_opcode_info(wqe.opcode);
  const bool write = info.is(wr_mask::kWrite), immediate = info.is(wr_mask::kImmediate);
  OpPosition position = first ? (last ? OpPosition::Only : OpPosition::First)  //
                              : (last ? OpPosition::Last : OpPosition::Middle);
  if (write && !immediate && configured_write_framing() == WriteFraming::Packets) position = OpPosition::Only;
  // A SEND with invalidate's last (or only) packet carries the IETH (RC and XRC).
  if (info.is(wr_mask::kInvalidate) && (position == OpPosition::Last || position == OpPosition::Only))
    return opcode(service_of(qp), position == OpPosition::Only ? op::kSendOnlyInvalidate : op::kSendLastInvalidate);
  const bool with_immediate = immediate && (position == OpPosition::Last || position == OpPosition::Only);
  return opcode_for(service_of(qp), write ? OpKind::Write : OpKind::Send, position, with_immediate);
}

// May a packet with this PSN go now? Always when nothing is outstanding.
bool window_open(const UdpQp& qp, uint32_t psn, int32_t window) {
  if (qp.type != QpType::Rc) return true;
  return psn_distance(psn, qp.requester.acked_psn) <= window;
}

void note_sent(TransportPort& port, UdpQp& qp, uint32_t psn) {
  RequesterState& r = qp.requester;
  if (r.sent_any && psn_distance(psn, r.highest_sent_psn) <= 0) {
    port.counters().add(Counter::Retransmissions);
  } else {
    r.highest_sent_psn = psn;
    r.sent_any = true;
  }
}

void assign_psns(UdpQp& qp, SendWqe& wqe) {
  RequesterState& r = qp.requester;
  if (send_opcode_info(wqe.opcode).is(wr_mask::kLocal))
    wqe.psn_count = 0;
  else if (wqe.expects_response())
    wqe.psn_count = wqe.is_read() ? packets_for(wqe.length, qp.mtu) : 1;
  else
    wqe.psn_count = qp.type == QpType::Ud ? 1 : packets_for(wqe.length, qp.mtu);
  wqe.first_psn = r.next_psn;
  wqe.read_next_psn = r.next_psn;
  wqe.assigned = true;
  r.next_psn = psn_add(r.next_psn, wqe.psn_count);
}

// A WQE's local SGEs checked whole, once, for the run of its packets that
// one requester pass sends: its regions cannot go away in between (see
// gather_local), and a key lookup per packet is a large share of a packet's
// work at small path MTUs. Unresolved for inline data and when a check
// fails: each packet is then checked alone, so that the packets before a
// bad piece still go, as before.
class ResolvedSges {
 public:
  void resolve(DeviceMemory& memory, const UdpQp& qp, const SendWqe& wqe) {
    resolved_ = false;
    if (wqe.flags & send_flag::kInline) return;
    pieces_ = {};
    for (const Sge& sge : wqe.sges) {
      ResolvedRange where;
      if (sge.length != 0) {  // never looked up by gather_local either
        const KeyCheck verdict = memory.shared().mrs.check_local(sge.lkey, qp.pd_handle, sge.address, sge.length, 0,
                                                                 &where, MemoryRegionTable::Lock::NotHeld);
        if (verdict != KeyCheck::Ok || where.owner_pid != current_pid()) return;
      }
      if (!pieces_.push_back({reinterpret_cast<void*>(where.address), sge.length})) return;
    }
    resolved_ = true;
  }
  bool resolved() const { return resolved_; }
  // As gather_local, from the addresses resolved.
  bool gather(uint64_t offset, uint64_t length, LocalVectors& out) const {
    if (length == 0) return true;
    for (const iovec& piece : pieces_) {
      if (offset >= piece.iov_len) {
        offset -= piece.iov_len;
        continue;
      }
      const uint64_t take = std::min<uint64_t>(piece.iov_len - offset, length);
      out.push_back({static_cast<uint8_t*>(piece.iov_base) + offset, take});
      length -= take;
      offset = 0;
      if (length == 0) return true;
    }
    return false;
  }

 private:
  SmallVector<iovec, limits::kMaxSge> pieces_;
  bool resolved_ = false;
};

// Sends packet `index` of a SEND or WRITE; false if its data failed the
// lkey check (the WQE then carries the error). `sges`: its SGEs resolved
// in this run of its packets, or nullptr.
bool send_segment(TransportPort& port, UdpQp& qp, SendWqe& wqe, uint32_t index, int32_t window,
                  const ResolvedSges* sges) {
  const uint64_t offset = uint64_t{index} * qp.mtu;
  const uint64_t length = std::min<uint64_t>(qp.mtu, wqe.length - std::min(wqe.length, offset));
  TransportPacket packet;
  packet.bth.opcode = segment_opcode(qp, wqe, index, wqe.psn_count);
  const OpcodeInfo& segment = opcode_info(packet.bth.opcode);
  packet.bth.dest_qp = qp.dest_qpn;
  packet.bth.psn = psn_add(wqe.first_psn, index);
  packet.xrc_srqn = wqe.remote_srqn;
  const bool last = index + 1 == wqe.psn_count;
  packet.bth.solicited = last && (wqe.flags & send_flag::kSolicited);
  const bool nothing_older_in_flight = &wqe == &qp.requester.queue.front();
  // AckReq at the end of a message with nothing older in flight or whose
  // completion the application will poll for (a signaled one), and every
  // half window, so that the window moves while the responder holds
  // unasked-for ACKs to coalesce them.
  const uint32_t ack_interval = static_cast<uint32_t>(window) / 2;
  packet.bth.ack_request = qp.type == QpType::Rc && ((last && (nothing_older_in_flight || wqe.signaled)) ||
                                                     (psn_add(packet.bth.psn, 1) % ack_interval) == 0);
  // Only a FIRST or an ONLY packet carries the RETH: a FIRST's names the
  // whole message, an ONLY's the bytes it carries (all of a one-packet
  // WRITE, or its part of one sent as WRITE ONLY packets).
  packet.reth = {wqe.remote_address + offset, wqe.rkey,
                 static_cast<uint32_t>(
                     segment.kind == OpKind::Write && segment.position == OpPosition::First ? wqe.length : length)};
  packet.immediate = be32toh(wqe.imm_data);
  packet.invalidate_rkey = wqe.invalidate_rkey;

  LocalVectors payload;
  const bool gathered = sges != nullptr ? sges->gather(offset, length, payload)
                                        : gather_local(port.memory(), qp, wqe, offset, length, 0, payload);
  if (!gathered) {
    wqe.error = WcStatus::LocalProtectionError;
    return false;
  }
  note_sent(port, qp, packet.bth.psn);
  port.transmit(qp, qp.path, qp.dest_qpn, packet, payload);
  return true;
}

void send_read_request(TransportPort& port, UdpQp& qp, SendWqe& wqe) {
  TransportPacket packet;
  packet.bth.opcode = opcode(service_of(qp), op::kReadRequest);
  packet.xrc_srqn = wqe.remote_srqn;
  packet.bth.dest_qp = qp.dest_qpn;
  packet.bth.psn = wqe.read_next_psn;
  packet.bth.ack_request = true;
  // A re-request after lost responses asks only for what is missing.
  packet.reth = {wqe.remote_address + wqe.read_done, wqe.rkey, static_cast<uint32_t>(wqe.length - wqe.read_done)};
  note_sent(port, qp, packet.bth.psn);
  port.transmit(qp, qp.path, qp.dest_qpn, packet, {});
}

void send_atomic_request(TransportPort& port, UdpQp& qp, SendWqe& wqe) {
  TransportPacket packet;
  const bool swap = wqe.opcode == SendOpcode::AtomicCompareSwap;
  packet.bth.opcode = opcode(service_of(qp), swap ? op::kCompareSwap : op::kFetchAdd);
  packet.xrc_srqn = wqe.remote_srqn;
  packet.bth.dest_qp = qp.dest_qpn;
  packet.bth.psn = wqe.first_psn;
  packet.bth.ack_request = true;
  packet.atomic.virtual_address = wqe.remote_address;
  packet.atomic.rkey = wqe.rkey;
  packet.atomic.swap_add = swap ? wqe.swap : wqe.compare_add;
  packet.atomic.compare = swap ? wqe.compare_add : 0;
  note_sent(port, qp, packet.bth.psn);
  port.transmit(qp, qp.path, qp.dest_qpn, packet, {});
}

// An ATOMIC WRITE: RETH and its 8 bytes; false if they failed the lkey
// check (the WQE then carries the error).
bool send_atomic_write_request(TransportPort& port, UdpQp& qp, SendWqe& wqe) {
  TransportPacket packet;
  packet.bth.opcode = opcode(service_of(qp), op::kAtomicWrite);
  packet.xrc_srqn = wqe.remote_srqn;
  packet.bth.dest_qp = qp.dest_qpn;
  packet.bth.psn = wqe.first_psn;
  packet.bth.ack_request = true;
  packet.reth = {wqe.remote_address, wqe.rkey, static_cast<uint32_t>(wqe.length)};
  LocalVectors payload;
  if (!gather_local(port.memory(), qp, wqe, 0, wqe.length, 0, payload)) {
    wqe.error = WcStatus::LocalProtectionError;
    return false;
  }
  note_sent(port, qp, packet.bth.psn);
  port.transmit(qp, qp.path, qp.dest_qpn, packet, payload);
  return true;
}

bool send_ud(TransportPort& port, UdpQp& qp, SendWqe& wqe) {
  TransportPacket packet;
  const bool immediate = send_opcode_info(wqe.opcode).is(wr_mask::kImmediate);
  packet.bth.opcode = opcode(Service::Ud, immediate ? op::kSendOnlyImm : op::kSendOnly);
  packet.bth.dest_qp = wqe.remote_qpn;
  packet.bth.psn = wqe.first_psn;
  packet.bth.solicited = wqe.flags & send_flag::kSolicited;
  // A qkey with the high bit set means "the QP's own qkey" (IBA 10.2.5).
  packet.deth.qkey = (wqe.remote_qkey & 0x80000000u) ? qp.attributes.qkey : wqe.remote_qkey;
  packet.deth.source_qp = qp.cm_agent ? kGsiQpn : qp.qpn;
  packet.immediate = be32toh(wqe.imm_data);
  LocalVectors payload;
  if (!gather_local(port.memory(), qp, wqe, 0, wqe.length, 0, payload)) {
    wqe.error = WcStatus::LocalProtectionError;
    return false;
  }
  port.transmit(qp, wqe.ud_path, wqe.remote_qpn, packet, payload);
  return true;
}

}  // namespace

bool gather_local(DeviceMemory& memory, const UdpQp& qp, const SendWqe& wqe, uint64_t offset, uint64_t length,
                  uint32_t access, LocalVectors& out) {
  if (length == 0) return true;
  if (wqe.flags & send_flag::kInline) {
    if (offset + length > wqe.inline_bytes.size()) return false;
    out.push_back({const_cast<uint8_t*>(wqe.inline_bytes.data()) + offset, length});
    return true;
  }
  // No device-wide lock: the regions are this process's own, and its
  // deregistrations wait for the engine (UdpTransport::hold_data_paths).
  for (const Sge& sge : wqe.sges) {
    if (offset >= sge.length) {
      offset -= sge.length;
      continue;
    }
    uint64_t take = std::min<uint64_t>(sge.length - offset, length);
    ResolvedRange where;
    KeyCheck verdict = memory.shared().mrs.check_local(sge.lkey, qp.pd_handle, sge.address + offset, take, access,
                                                       &where, MemoryRegionTable::Lock::NotHeld);
    if (verdict != KeyCheck::Ok || where.owner_pid != current_pid()) {
      debug_log("QP %#x wr_id %#llx: local SGE lkey %#x addr %#llx len %u refused (check %d)", qp.qpn,
                static_cast<unsigned long long>(wqe.wr_id), sge.lkey, static_cast<unsigned long long>(sge.address),
                sge.length, static_cast<int>(verdict));
      return false;
    }
    out.push_back({reinterpret_cast<void*>(where.address), take});
    length -= take;
    offset = 0;
    if (length == 0) return true;
  }
  return length == 0;
}

int32_t TransportPort::window(const UdpQp& qp) const { return parameters::window_packets(qp.mtu); }

void requester_post(TransportPort& port, UdpQp& qp, const SendWqe& wqe) {
  qp.requester.queue.push_back(wqe);
  requester_run(port, qp);
}

void requester_run(TransportPort& port, UdpQp& qp) {
  RequesterState& r = qp.requester;
  if (!qp.sending || port.now() < r.resume_at) return;
  const uint32_t rd_atomic_limit = std::max<uint32_t>(1, qp.attributes.max_rd_atomic);
  const int32_t window = qp.type == QpType::Rc ? port.window(qp) : window_packets(qp.mtu);
  bool executed_local = false;
  while (r.cursor < r.queue.size()) {
    SendWqe& wqe = r.queue[r.cursor];
    if (wqe.error != WcStatus::Success) break;
    if (!wqe.assigned) {
      if (qp.draining) break;
      // A fenced request waits for every earlier READ and atomic.
      if ((wqe.flags & send_flag::kFence) && r.rd_atomic_in_flight > 0) break;
      assign_psns(qp, wqe);
    }
    if (send_opcode_info(wqe.opcode).is(wr_mask::kLocal)) {
      // Executed once, here in queue order; it takes no PSN, so it
      // completes once everything before it is acknowledged.
      if (!wqe.finished) {
        wqe.finished = true;
        wqe.error = execute_local_operation(port.memory(), qp.pd_handle, qp.qpn, wqe);
        executed_local = true;
        if (wqe.error != WcStatus::Success) break;
      }
      ++r.cursor;
      continue;
    }
    if (qp.type == QpType::Ud) {
      if (send_ud(port, qp, wqe)) wqe.packets_sent = 1;
      ++r.cursor;
      continue;
    }
    if (wqe.expects_response()) {
      if (wqe.finished || wqe.fully_sent()) {
        ++r.cursor;
        continue;
      }
      if (!wqe.holds_rd_atomic) {
        if (r.rd_atomic_in_flight >= rd_atomic_limit) break;
        wqe.holds_rd_atomic = true;
        ++r.rd_atomic_in_flight;
      }
      const uint32_t psn = wqe.is_read() ? wqe.read_next_psn : wqe.first_psn;
      if (!window_open(qp, psn, window)) break;
      if (wqe.is_read())
        send_read_request(port, qp, wqe);
      else if (wqe.is_atomic_write()) {
        if (!send_atomic_write_request(port, qp, wqe)) break;
      } else
        send_atomic_request(port, qp, wqe);
      wqe.packets_sent = 1;
      ++r.cursor;
      continue;
    }
    bool failed = false;
    ResolvedSges sges;  // from the run's second packet on (a one-packet message needs one lookup anyway)
    for (uint32_t in_run = 0; wqe.packets_sent < wqe.psn_count; ++in_run) {
      if (!window_open(qp, psn_add(wqe.first_psn, wqe.packets_sent), window)) break;
      if (in_run == 1) sges.resolve(port.memory(), qp, wqe);
      if (!send_segment(port, qp, wqe, wqe.packets_sent, window, sges.resolved() ? &sges : nullptr)) {
        failed = true;
        break;
      }
      ++wqe.packets_sent;
    }
    if (failed || !wqe.fully_sent()) break;
    ++r.cursor;
  }
  // UC and UD requests are done once sent; a request that failed before it
  // went out completes (in order) with its error.
  if (qp.type != QpType::Rc || executed_local || (!r.queue.empty() && r.queue.front().error != WcStatus::Success)) {
    complete_in_order(port, qp);
    if (!qp.sending) return;
  }
  if (qp.type == QpType::Rc) {
    bool outstanding = !r.queue.empty() && r.queue.front().assigned;
    if (outstanding && r.ack_deadline == Clock::time_point::max()) r.ack_deadline = port.now() + ack_timeout(qp);
  }
}

}  // namespace softverbs::udp
