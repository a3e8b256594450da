// The shared-memory requester: validates a send work request against the
// MR table, finds the target QP, and executes the operation with one copy
// into or out of the target process.
#include "shm/requester.h"

#include <endian.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "device/cm_routing.h"
#include "device/event_socket.h"
#include "device/memory_window.h"
#include "device/queues.h"
#include "device/receive_queue.h"
#include "shm/memory_copy.h"
#include "support/debug_log.h"
#include "support/process_id.h"
#include "support/small_vector.h"
#include "wire/roce_headers.h"
#include "wire/roce_packet.h"

namespace softverbs {

namespace {

// A target QP that failed while its lock was held (it detected an error in
// a request, or its receive CQ overran): moved to ERR there, its receive
// queue flushed by execute_send after the lock is let go.
thread_local uint32_t failed_target_qpn = 0;

// The responder's side of an error it detected in a request (IBA class C:
// access, length, invalid request): its QP goes to ERR and its receives are
// flushed, as rxe's and an HCA's responder do. `target`'s lock is held.
void fail_target(QpRecord& target) {
  if (load_state(target) == QpState::Error) return;
  set_state(target, QpState::Error);
  failed_target_qpn = target.qpn;
}

constexpr size_t kGrhBytes = 40;

// A UD message must fit one packet of the path MTU.
uint64_t ud_mtu_bytes(const QpRecord& qp) {
  return qp.attributes.path_mtu != 0 ? (uint64_t{128} << qp.attributes.path_mtu) : 4096;
}

bool receive_capable(QpState state) {
  return state == QpState::Rtr || state == QpState::Rts || state == QpState::Sqd || state == QpState::Sqe;
}

// The requester's local buffers, resolved to this process's addresses.
struct LocalBuffers {
  SmallVector<iovec, limits::kMaxSge + 1> vectors;
  uint64_t length = 0;
};

WcStatus resolve_local(DeviceMemory& memory, const QpRecord& qp, const SendWqe& request, LocalBuffers& out) {
  if (request.flags & send_flag::kInline) {
    for (const Sge& sge : request.sges) {
      if (sge.length == 0) continue;
      out.vectors.push_back({reinterpret_cast<void*>(sge.address), sge.length});
      out.length += sge.length;
    }
    return WcStatus::Success;
  }
  uint32_t needed = send_opcode_info(request.opcode).is(wr_mask::kIntoLocal) ? access::kLocalWrite : 0;
  for (const Sge& sge : request.sges) {
    ResolvedRange where;
    KeyCheck verdict = memory.shared().mrs.check_local(sge.lkey, qp.pd_handle, sge.address, sge.length, needed, &where);
    if (verdict != KeyCheck::Ok || where.owner_pid != current_pid()) {
      debug_log("QP %#x wr_id %#llx: local SGE lkey %#x addr %#llx len %u refused (check %d, owner %d)", qp.qpn,
                static_cast<unsigned long long>(request.wr_id), sge.lkey, static_cast<unsigned long long>(sge.address),
                sge.length, static_cast<int>(verdict), where.owner_pid);
      return WcStatus::LocalProtectionError;
    }
    if (sge.length == 0) continue;
    out.vectors.push_back({reinterpret_cast<void*>(where.address), sge.length});
    out.length += sge.length;
  }
  if (out.length > limits::kMaxMessageSize) return WcStatus::LocalLengthError;
  return WcStatus::Success;
}

// The first `length` bytes of `ranges`; the rest is dropped.
using RemoteRanges = SmallVector<RemoteRange, limits::kMaxSge>;

RemoteRanges first_bytes(const RemoteRanges& ranges, uint64_t length) {
  RemoteRanges out;
  for (const RemoteRange& r : ranges) {
    if (length == 0) break;
    uint64_t take = std::min(r.length, length);
    out.push_back({r.address, take, r.key, r.access});
    length -= take;
  }
  return out;
}

// The 40 bytes a UD receive buffer starts with. Between RoCE v2 GIDs of
// IPv4 addresses a RoCE NIC puts the packet's IPv4 header in the last 20
// (which is how ibv_init_ah_from_wc tells the kinds apart); otherwise a GRH
// (RoCE v1, or the IPv6 header of RoCE v2, which has the GRH's layout).
bool ipv4_packet(const SendWqe& request) {
  return request.has_grh && request.roce_v2 && wire::is_ipv4_mapped(request.source_gid) &&
         wire::is_ipv4_mapped(request.destination_gid);
}

std::array<uint8_t, kGrhBytes> build_grh(const SendWqe& request, uint64_t payload) {
  std::array<uint8_t, kGrhBytes> grh{};
  if (ipv4_packet(request)) {
    wire::FlowAddress flow;
    flow.source = request.source_gid;
    flow.destination = request.destination_gid;
    flow.source_port = wire::flow_source_port(0, request.remote_qpn);
    flow.destination_port = wire::kRoceV2Port;
    flow.traffic_class = request.traffic_class;
    flow.hop_limit = request.hop_limit;
    // BTH + DETH (+ ImmDt) + payload + pad + ICRC, as the datagram would be.
    const bool immediate = send_opcode_info(request.opcode).is(wr_mask::kImmediate);
    const size_t datagram =
        wire::kBthBytes + 8 + (immediate ? 4 : 0) + payload + wire::pad_bytes(payload) + wire::kIcrcBytes;
    std::array<uint8_t, wire::kMaxIpUdpHeaders> headers;
    wire::write_ip_udp_headers(flow, datagram, true, headers);
    std::memcpy(grh.data() + 20, headers.data(), 20);
    return grh;
  }
  uint32_t first_word = (6u << 28) | (uint32_t{request.traffic_class} << 20) | (request.flow_label & 0xfffff);
  first_word = htobe32(first_word);
  std::memcpy(grh.data(), &first_word, 4);
  uint16_t payload_be = htobe16(static_cast<uint16_t>(payload));
  std::memcpy(grh.data() + 4, &payload_be, 2);
  grh[6] = 0x1b;  // next header: IB BTH
  grh[7] = request.hop_limit;
  std::memcpy(grh.data() + 8, request.source_gid.data(), 16);
  std::memcpy(grh.data() + 24, request.destination_gid.data(), 16);
  return grh;
}

// Whether a copy into or out of `target`'s process failed with `error`
// because that process is exiting: then nothing answers, as for a QP that
// is gone. The kernel says ESRCH once the process's first thread has let
// go of its memory, which may be before the thread that holds its
// ProcessTable record has exited.
bool target_gone(DeviceMemory& memory, const QpRecord& target, int error) {
  return error == ESRCH || !memory.owner_alive(target.owner_process);
}

// Where nobody answers: RC retries until retry_cnt runs out; UC and UD
// packets are lost silently and the sender completes successfully.
SendOutcome no_answer(const QpRecord& qp, Completion& completion) {
  if (qp.type == QpType::Rc) completion.status = WcStatus::RetryExceededError;
  return SendOutcome::Completed;
}

// The target's next receive WQE: from its own queue or SRQ, or for an
// XRC_RECV QP from the XRC SRQ the message names (already found valid).
bool take_target_receive(DeviceMemory& memory, QpRecord& target, const SendWqe& request, ReceivePlacement& out) {
  if (target.xrc == XrcRole::Recv) return take_xrc_receive(memory, target, request.remote_srqn, out);
  return take_receive(memory, target, out);
}

// A SEND with invalidate's receive completion, held back until the window
// is invalidated, which takes the table's lock as a writer (see execute_send).
struct HeldReceive {
  bool held = false;
  Completion receive;
  int recv_cq = -1;
  uint32_t pd_handle = 0;
};

// A SEND (with or without immediate, or invalidate) into `target`'s next
// receive WQE; the target's lock is held by the caller. With `held`, a
// receive that succeeds is left there rather than delivered.
SendOutcome place_send(DeviceMemory& memory, QpRecord& qp, QpRecord& target_record, const SendWqe& request,
                       const LocalBuffers& local, Completion& completion, HeldReceive* held = nullptr) {
  QpRecord* target = &target_record;
  const bool reliable = qp.type == QpType::Rc;
  ReceivePlacement receive;
  if (!take_target_receive(memory, *target, request, receive)) {
    if (reliable) return SendOutcome::ReceiverNotReady;
    return SendOutcome::Completed;  // UC/UD: dropped
  }
  Completion received;
  received.wr_id = receive.wr_id;
  received.opcode = WcOpcode::Receive;
  received.qp_num = target->qpn;
  received.src_qp = qp.gsi_agent ? kGsiQpn : qp.qpn;
  if (send_opcode_info(request.opcode).is(wr_mask::kImmediate)) {
    received.imm_data = request.imm_data;
    received.flags |= wc_flag::kWithImm;
  }
  if (send_opcode_info(request.opcode).is(wr_mask::kInvalidate)) {
    received.imm_data = request.invalidate_rkey;
    received.flags |= wc_flag::kWithInvalidate;
  }
  uint64_t header = qp.type == QpType::Ud ? kGrhBytes : 0;
  if (receive.protection_error) {
    received.status = WcStatus::LocalProtectionError;
    if (reliable) completion.status = WcStatus::RemoteOperationError;
  } else if (local.length + header > receive.capacity) {
    received.status = WcStatus::LocalLengthError;
    if (reliable) completion.status = WcStatus::RemoteInvalidRequestError;
  } else {
    int error = 0;
    if (header != 0) {
      // UD: the first 40 bytes of the receive buffer hold the GRH, then the
      // payload; one copy of both (one system call where the receive buffer
      // is not mapped here).
      received.flags |= request.has_grh ? wc_flag::kGrh : 0;
      if (request.has_grh) received.sl = roce_packet_type(request.roce_v2, ipv4_packet(request));
      auto grh = build_grh(request, local.length);
      SmallVector<iovec, limits::kMaxSge + 2> with_grh;
      with_grh.push_back({grh.data(), grh.size()});
      for (const iovec& vector : local.vectors) with_grh.push_back(vector);
      error = copy_to_process(memory, receive.owner, with_grh, first_bytes(receive.vectors, header + local.length));
    } else if (local.length > 0) {
      error = copy_to_process(memory, receive.owner, local.vectors, receive.vectors);
    }
    if (error != 0 && target_gone(memory, *target, error)) {
      // It died while the bytes moved: as a QP that is gone, it answers
      // nothing (and completes nothing).
      return no_answer(qp, completion);
    }
    if (error != 0) {
      debug_log("SEND from QP %#x to QP %#x: copy into process %d failed: %s", qp.qpn, target->qpn, receive.owner,
                strerror(error));
      received.status = WcStatus::LocalProtectionError;
      if (reliable) completion.status = WcStatus::RemoteOperationError;
    }
    received.byte_len = static_cast<uint32_t>(local.length + header);
  }
  if (received.status != WcStatus::Success && qp.type != QpType::Ud) fail_target(*target);
  if (held != nullptr && received.status == WcStatus::Success) {
    *held = HeldReceive{true, received, receive.completion_cq(*target), target->pd_handle};
    return SendOutcome::Completed;
  }
  // An overrun CQ takes the QP to ERR, as on an HCA (its lock is held here:
  // execute_send flushes its receive queue once it is let go).
  if (!deliver_completion(memory, receive.completion_cq(*target), received, request.flags & send_flag::kSolicited)) {
    set_state(*target, QpState::Error);
    raise_overrun_fatal(*target);
    failed_target_qpn = target->qpn;
  }
  return SendOutcome::Completed;
}

// A UD SEND to QP1 of this device: the CM agent the MAD belongs to, or 0
// where the device answers it (into the sender, as from the peer's QP1) or
// drops it.
uint32_t route_to_cm_agent(DeviceMemory& memory, QpRecord& qp, const SendWqe& request, const LocalBuffers& local) {
  std::array<uint8_t, wire::cm::kMadBytes> mad;
  if (local.length != mad.size()) return 0;
  size_t at = 0;
  for (const iovec& piece : local.vectors) {
    std::memcpy(mad.data() + at, piece.iov_base, piece.iov_len);
    at += piece.iov_len;
  }
  CmDelivery delivery = route_cm_mad(memory, mad);
  if (delivery.answer && qp.gsi_agent) {
    SendWqe reply = request;
    std::swap(reply.source_gid, reply.destination_gid);
    reply.opcode = SendOpcode::Send;
    reply.flags = 0;
    LocalBuffers answer;
    answer.vectors.push_back({delivery.answer->data(), delivery.answer->size()});
    answer.length = delivery.answer->size();
    Completion ignored;
    SharedLock lock(qp.lock);
    if (qp.live && receive_capable(qp.state)) place_send(memory, qp, qp, reply, answer, ignored);
  }
  return delivery.agent_qpn;
}

// One send's execution against its target QP: what every one-sided
// operation shares (the outcome of a target that answers nothing, of a copy
// that failed, the remote key check), and each operation's own steps.
class Execution {
 public:
  // `target_pd`: the PD its rkeys must belong to (an XRC_RECV QP has none:
  // the XRC SRQ the message names lends its own).
  Execution(DeviceMemory& memory, QpRecord& qp, const SendWqe& request, const LocalBuffers& local,
            Completion& completion, QpRecord& target, uint32_t target_pd)
      : memory_(memory),
        qp_(qp),
        request_(request),
        local_(local),
        completion_(completion),
        target_(target),
        target_pd_(target_pd) {}

  SendOutcome write();
  SendOutcome read();
  SendOutcome atomic();
  SendOutcome atomic_write();

 private:
  bool reliable() const { return qp_.type == QpType::Rc; }
  SendOutcome fail(WcStatus status) {
    completion_.status = status;
    return SendOutcome::Completed;
  }
  // An error the target detects: on RC its NAK's status here, and its QP
  // fails too; on UC (no NAKs) the message is dropped, silently.
  SendOutcome refuse(WcStatus status) {
    if (!reliable()) return SendOutcome::Completed;
    fail_target(target_);
    return fail(status);
  }
  SendOutcome unreachable() { return no_answer(qp_, completion_); }
  // A copy that failed: the target's process died while the bytes moved
  // (nothing answers, as for a QP that is gone), or the range could not be
  // reached after all (an error the requester reports).
  SendOutcome copy_failed(int error) {
    if (target_gone(memory_, target_, error)) return unreachable();
    return refuse(WcStatus::RemoteAccessError);
  }
  // One-sided operations are checked against the target's registration and
  // the target QP's remote access rights.
  bool check_remote(uint32_t needed, uint64_t length, ResolvedRange& where) const {
    if ((target_.attributes.access_flags & needed) != needed) return false;
    // A zero-length RDMA READ or WRITE touches no memory, so no key is
    // checked (IBA C9-88): UCX flushes with one that names rkey 0.
    if (length == 0 && needed != access::kRemoteAtomic) return true;
    // An XRC_RECV QP's keys are checked in the PD of the SRQ a message names.
    return memory_.shared().mrs.check_remote(request_.rkey, target_pd_, target_.qpn, request_.remote_address, length,
                                             needed, &where) == KeyCheck::Ok &&
           reaches_memory_of(where.owner_pid, target_.owner_pid, target_.xrc);
  }
  void deliver_write_immediate(const ReceivePlacement& receive);

  DeviceMemory& memory_;
  QpRecord& qp_;
  const SendWqe& request_;
  const LocalBuffers& local_;
  Completion& completion_;
  QpRecord& target_;
  const uint32_t target_pd_;
};

void Execution::deliver_write_immediate(const ReceivePlacement& receive) {
  Completion received;
  received.wr_id = receive.wr_id;
  received.opcode = WcOpcode::ReceiveRdmaWithImm;
  received.byte_len = static_cast<uint32_t>(local_.length);
  received.imm_data = request_.imm_data;
  received.flags = wc_flag::kWithImm;
  received.qp_num = target_.qpn;
  received.src_qp = qp_.qpn;
  if (!deliver_completion(memory_, receive.completion_cq(target_), received, request_.flags & send_flag::kSolicited)) {
    set_state(target_, QpState::Error);  // overrun (see place_send)
    raise_overrun_fatal(target_);
    failed_target_qpn = target_.qpn;
  }
}

SendOutcome Execution::write() {
  ResolvedRange where;
  if (!check_remote(access::kRemoteWrite, local_.length, where)) return refuse(WcStatus::RemoteAccessError);
  const bool immediate = send_opcode_info(request_.opcode).is(wr_mask::kImmediate);
  ReceivePlacement receive;
  if (immediate && !take_target_receive(memory_, target_, request_, receive))
    return reliable() ? SendOutcome::ReceiverNotReady : SendOutcome::Completed;
  RemoteRange remote{where.address, local_.length, request_.rkey, access::kRemoteWrite};
  if (local_.length > 0)
    if (int error = copy_to_process(memory_, where.owner_pid, local_.vectors, std::span(&remote, 1)))
      return copy_failed(error);
  if (immediate) deliver_write_immediate(receive);
  return SendOutcome::Completed;
}

SendOutcome Execution::read() {
  ResolvedRange where;
  if (!check_remote(access::kRemoteRead, local_.length, where)) return refuse(WcStatus::RemoteAccessError);
  RemoteRange remote{where.address, local_.length, request_.rkey, access::kRemoteRead};
  if (local_.length > 0)
    if (int error = copy_from_process(memory_, where.owner_pid, local_.vectors, std::span(&remote, 1)))
      return copy_failed(error);
  return SendOutcome::Completed;
}

SendOutcome Execution::atomic() {
  if (local_.length != 8) return fail(WcStatus::LocalLengthError);
  if (request_.remote_address % 8 != 0) return refuse(WcStatus::RemoteInvalidRequestError);
  ResolvedRange where;
  if (!check_remote(access::kRemoteAtomic, 8, where)) return refuse(WcStatus::RemoteAccessError);
  SharedLock atomics(memory_.shared().atomics_lock);
  uint64_t original = 0;
  iovec value{&original, 8};
  RemoteRange remote{where.address, 8, request_.rkey, access::kRemoteAtomic};
  if (int error = copy_from_process(memory_, where.owner_pid, std::span(&value, 1), std::span(&remote, 1)))
    return copy_failed(error);
  uint64_t updated = original;
  if (request_.opcode == SendOpcode::AtomicFetchAdd)
    updated = original + request_.compare_add;
  else if (original == request_.compare_add)
    updated = request_.swap;
  if (updated != original) {
    iovec next{&updated, 8};
    if (int error = copy_to_process(memory_, where.owner_pid, std::span(&next, 1), std::span(&remote, 1)))
      return copy_failed(error);
  }
  copy_within_process(local_.vectors, std::span(&value, 1));
  return SendOutcome::Completed;
}

// The key is checked before the alignment, as rxe's responder does (a
// misaligned ATOMIC WRITE is an invalid request, IBV_WC_REM_INV_REQ_ERR).
// The store is one aligned 8-byte store where the target's memory is this
// process's, and under the device's atomics lock in every case, so device
// atomics never interleave with it.
SendOutcome Execution::atomic_write() {
  if (local_.length != 8) return fail(WcStatus::LocalLengthError);
  ResolvedRange where;
  if (!check_remote(access::kRemoteWrite, 8, where)) return refuse(WcStatus::RemoteAccessError);
  if (request_.remote_address % 8 != 0) return refuse(WcStatus::RemoteInvalidRequestError);
  uint64_t value = 0;
  iovec into{&value, 8};
  copy_within_process(std::span(&into, 1), local_.vectors);
  SharedLock atomics(memory_.shared().atomics_lock);
  if (where.owner_pid == current_pid() && where.address % 8 == 0) {
    __atomic_store_n(reinterpret_cast<uint64_t*>(where.address), value, __ATOMIC_RELEASE);
    return SendOutcome::Completed;
  }
  RemoteRange remote{where.address, 8, request_.rkey, access::kRemoteWrite};
  if (int error = copy_to_process(memory_, where.owner_pid, std::span(&into, 1), std::span(&remote, 1)))
    return copy_failed(error);
  return SendOutcome::Completed;
}

// A qkey with the high bit set means "use the QP's own qkey".
uint32_t effective_qkey(const QpRecord& qp, const SendWqe& request) {
  return (request.remote_qkey & 0x80000000u) ? qp.attributes.qkey : request.remote_qkey;
}

// A UD send to a multicast group: a copy to every QP attached to it, the
// sender's own included.
SendOutcome send_to_group(DeviceMemory& memory, QpRecord& qp, const SendWqe& request, const LocalBuffers& local,
                          Completion& completion) {
  if (local.length > ud_mtu_bytes(qp)) {
    completion.status = WcStatus::LocalLengthError;
    return SendOutcome::Completed;
  }
  for (uint32_t member : memory.shared().multicast.members(request.destination_gid)) {
    QpRecord* target = memory.qp_by_number(member);
    if (target == nullptr) continue;
    SharedLock target_lock(target->lock);
    if (!target->live || target->qpn != member || target->type != QpType::Ud || !receive_capable(target->state) ||
        target->attributes.qkey != effective_qkey(qp, request) || !memory.owner_alive(target->owner_process))
      continue;
    place_send(memory, qp, *target, request, local, completion);
  }
  return SendOutcome::Completed;
}

// Whether `target` (locked) takes packets from `qp`: live, of the same type,
// able to receive, its process alive (a QP whose process has died answers
// nothing, as one whose host died), and for RC and UC connected to `qp`.
// XRC_SEND QPs speak only to XRC_RECV QPs (the XRC service), others to none.
bool answers(DeviceMemory& memory, const QpRecord& qp, const QpRecord& target, uint32_t target_qpn) {
  if (!target.live || target.qpn != target_qpn || target.type != qp.type || !receive_capable(target.state))
    return false;
  if ((qp.xrc == XrcRole::Send) != (target.xrc == XrcRole::Recv) || target.xrc == XrcRole::Send) return false;
  if (!memory.owner_alive(target.owner_process)) return false;
  return qp.type == QpType::Ud || target.attributes.dest_qpn == qp.qpn;
}

// The QP number a send goes to; 0 where the device took a MAD to QP1 itself.
uint32_t target_of(DeviceMemory& memory, QpRecord& qp, const SendWqe& request, const LocalBuffers& local) {
  if (qp.type != QpType::Ud) return qp.attributes.dest_qpn;
  if (request.remote_qpn == kGsiQpn) return route_to_cm_agent(memory, qp, request, local);
  return request.remote_qpn;
}

SendOutcome execute_with_target(DeviceMemory& memory, QpRecord& qp, const SendWqe& request, Completion& completion,
                                HeldReceive* held) {
  MemoryReadLock memory_lock(memory);  // keeps every key valid while bytes move
  LocalBuffers local;
  completion.status = resolve_local(memory, qp, request, local);
  if (completion.status != WcStatus::Success) return SendOutcome::Completed;
  completion.byte_len = static_cast<uint32_t>(local.length);

  if (qp.type == QpType::Ud && request.remote_qpn == kMulticastQpn)
    return send_to_group(memory, qp, request, local, completion);
  const uint32_t target_qpn = target_of(memory, qp, request, local);
  if (target_qpn == 0) return SendOutcome::Completed;  // taken by the device, or dropped
  QpRecord* target = memory.qp_by_number(target_qpn);
  if (target == nullptr) return no_answer(qp, completion);
  SharedLock target_lock(target->lock);
  if (!answers(memory, qp, *target, target_qpn)) return no_answer(qp, completion);
  if (qp.type == QpType::Ud) {
    if (effective_qkey(qp, request) != target->attributes.qkey)
      return SendOutcome::Completed;  // dropped, as on the wire
    if (local.length > ud_mtu_bytes(qp)) {
      completion.status = WcStatus::LocalLengthError;
      return SendOutcome::Completed;
    }
  }
  uint32_t target_pd = target->pd_handle;
  if (target->xrc == XrcRole::Recv) {
    // Every XRC request names an XRC SRQ of the target's domain; one that
    // does not is an invalid request (class C: the responder fails too).
    const SrqRecord* srq = find_xrc_srq(memory, *target, request.remote_srqn);
    if (srq == nullptr) {
      debug_log("QP %#x: XRC SRQ %#x is no XRC SRQ of QP %#x's domain", qp.qpn, request.remote_srqn, target->qpn);
      fail_target(*target);
      completion.status = WcStatus::RemoteInvalidRequestError;
      return SendOutcome::Completed;
    }
    target_pd = srq->pd_handle;
  }
  Execution execution(memory, qp, request, local, completion, *target, target_pd);
  const SendOpcodeInfo& info = send_opcode_info(request.opcode);
  if (request.opcode == SendOpcode::AtomicWrite) return execution.atomic_write();
  if (info.is(wr_mask::kWrite)) return execution.write();
  if (info.is(wr_mask::kRead)) return execution.read();
  if (info.is(wr_mask::kAtomic)) return execution.atomic();
  const SendOutcome outcome = place_send(memory, qp, *target, request, local, completion, held);
  if (held != nullptr && held->held) held->pd_handle = target_pd;  // an XRC SRQ's PD, not the QP's
  return outcome;
}

// A SEND with invalidate whose receive succeeded: the window goes now, or
// the receive fails (IBA class J) and both sides see the error.
void invalidate_at_target(DeviceMemory& memory, const SendWqe& request, HeldReceive& held, Completion& completion) {
  Completion& received = held.receive;
  if (!invalidate_on_receive(memory, held.pd_handle, received.qp_num, request.invalidate_rkey)) {
    received.status = WcStatus::RemoteInvalidRequestError;
    received.byte_len = 0;
    completion.status = WcStatus::RemoteInvalidRequestError;
    if (QpRecord* target = memory.qp_by_number(received.qp_num)) {
      SharedLock lock(target->lock);
      if (target->live && target->qpn == received.qp_num) fail_target(*target);
    }
  }
  if (!deliver_completion(memory, held.recv_cq, received, request.flags & send_flag::kSolicited))
    move_to_error_after_overrun(memory, received.qp_num);
}

}  // namespace

SendOutcome execute_send(DeviceMemory& memory, QpRecord& qp, const SendWqe& request, Completion& completion) {
  completion = {};
  completion.wr_id = request.wr_id;
  completion.opcode = completion_opcode(request.opcode);
  completion.qp_num = qp.qpn;
  const SendOpcodeInfo& info = send_opcode_info(request.opcode);
  if (info.is(wr_mask::kLocal)) {
    completion.status = execute_local_operation(memory, qp.pd_handle, qp.qpn, request);
    return SendOutcome::Completed;
  }
  failed_target_qpn = 0;
  SendOutcome outcome;
  if (!info.is(wr_mask::kInvalidate)) {
    outcome = execute_with_target(memory, qp, request, completion, nullptr);
  } else {
    // The invalidation takes the table's lock as a writer: after the
    // placement has let go of it as a reader, and of the target's lock.
    HeldReceive held;
    outcome = execute_with_target(memory, qp, request, completion, &held);
    if (held.held) invalidate_at_target(memory, request, held, completion);
  }
  if (failed_target_qpn != 0) {
    if (QpRecord* target = memory.qp_by_number(failed_target_qpn)) flush_after_error(memory, *target, true);
    failed_target_qpn = 0;
  }
  return outcome;
}

}  // namespace softverbs
