#include "device/receive_queue.h"

#include <algorithm>
#include <atomic>

#include "device/event_socket.h"
#include "support/debug_log.h"

namespace softverbs {

namespace {

// Takes the next WQE of a receive queue (its lock held by the caller),
// resolving its SGEs against the registrations of `owner` in `pd_handle`.
bool take_from_queue(DeviceMemory& memory, RecvQueue& rq, uint32_t pd_handle, pid_t owner, ReceivePlacement& out) {
  RecvWqe* wqe = posted_head(memory, rq);
  if (wqe == nullptr) return false;
  out.wr_id = wqe->wr_id;
  out.owner = owner;
  const Sge* sges = DeviceMemory::sges_of(wqe);
  for (uint32_t i = 0; i < wqe->num_sge && i < rq.max_sge; ++i) {
    ResolvedRange where;
    KeyCheck verdict = memory.shared().mrs.check_local(sges[i].lkey, pd_handle, sges[i].address, sges[i].length,
                                                       access::kLocalWrite, &where);
    if (verdict != KeyCheck::Ok || where.owner_pid != owner) {
      debug_log("receive WQE wr_id %#llx: SGE lkey %#x addr %#llx len %u refused (check %d, owner %d, QP owner %d)",
                static_cast<unsigned long long>(out.wr_id), sges[i].lkey,
                static_cast<unsigned long long>(sges[i].address), sges[i].length, static_cast<int>(verdict),
                where.owner_pid, owner);
      out.protection_error = true;
      continue;
    }
    if (sges[i].length == 0) continue;
    out.vectors.push_back({where.address, sges[i].length, sges[i].lkey, access::kLocalWrite});
    out.sges.push_back(sges[i]);
    out.capacity += sges[i].length;
  }
  consume_head(rq);  // after the last read of the entry: the poster may write the slot from then on
  return true;
}

}  // namespace

RecvQueue allocate_receive_queue(DeviceMemory& memory, uint32_t capacity, uint32_t max_sge) {
  RecvQueue rq;
  rq.capacity = std::max<uint32_t>(capacity, 1);
  rq.max_sge = std::max<uint32_t>(max_sge, 1);
  rq.slot_size = static_cast<uint32_t>(sizeof(RecvWqe) + rq.max_sge * sizeof(Sge));
  rq.ring_offset = memory.allocate(ring_bytes(rq));
  return rq;
}

RecvWqe* posted_head(DeviceMemory& memory, RecvQueue& rq) {
  if (rq.capacity == 0) return nullptr;  // a QP with an SRQ has no ring of its own
  RecvWqe* wqe = memory.recv_slot(rq, rq.consumed);
  // Acquire: the entry's fields, written before its sequence, are whole.
  if (std::atomic_ref<uint32_t>(wqe->sequence).load(std::memory_order_acquire) != wqe_sequence(rq.consumed))
    return nullptr;
  return wqe;
}

void consume_head(RecvQueue& rq) {
  std::atomic_ref<uint64_t>(rq.consumed).store(rq.consumed + 1, std::memory_order_release);
}

namespace {

// The next WQE of `srq` (still the SRQ `srqn`, if given), raising its
// limit event when the queue drops below the armed limit.
bool take_from_srq(DeviceMemory& memory, SrqRecord& srq, ReceivePlacement& out, uint32_t srqn = 0) {
  SharedLock lock(srq.lock);
  if (!srq.live || (srqn != 0 && srq.srqn != srqn) ||
      !take_from_queue(memory, srq.rq, srq.pd_handle, srq.owner_pid, out))
    return false;
  if (srq.limit != 0 && srq.rq.posted - srq.rq.consumed < srq.limit) {
    srq.limit = 0;  // one event per arming, as ibv_modify_srq(IBV_SRQ_LIMIT) documents
    send_async_event(srq.owner_async, srq.owner_handle, AsyncEventType::SrqLimitReached);
  }
  return true;
}

}  // namespace

bool take_receive(DeviceMemory& memory, QpRecord& target, ReceivePlacement& out) {
  if (target.srq < 0) return take_from_queue(memory, target.rq, target.pd_handle, target.owner_pid, out);
  return take_from_srq(memory, memory.shared().srqs[target.srq], out);
}

const SrqRecord* find_xrc_srq(DeviceMemory& memory, const QpRecord& target, uint32_t srqn) {
  const SrqRecord* srq = memory.srq_by_number(srqn);
  if (srq == nullptr || target.xrc != XrcRole::Recv || srq->xrcd_id == 0 || srq->xrcd_id != target.xrcd_id)
    return nullptr;
  return srq;
}

bool take_xrc_receive(DeviceMemory& memory, const QpRecord& target, uint32_t srqn, ReceivePlacement& out) {
  const SrqRecord* found = find_xrc_srq(memory, target, srqn);
  if (found == nullptr) return false;
  SrqRecord& srq = const_cast<SrqRecord&>(*found);
  if (!take_from_srq(memory, srq, out, srqn)) return false;
  out.cq = srq.cq;
  return true;
}

}  // namespace softverbs
