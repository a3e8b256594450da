// Taking receive WQEs off a QP's receive queue or its SRQ, for whichever
// path delivers a SEND: the shared-memory requester (acting for the target)
// or the UDP responder (in the target's own process).
#pragma once

#include <sys/types.h>

#include <cstdint>

#include "device/device_limits.h"
#include "device/device_memory.h"
#include "shm/memory_copy.h"
#include "support/small_vector.h"

namespace softverbs {

// A receive WQE resolved to its owner's addresses.
struct ReceivePlacement {
  uint64_t wr_id = 0;
  pid_t owner = 0;
  SmallVector<RemoteRange, limits::kMaxSge> vectors;
  SmallVector<Sge, limits::kMaxSge> sges;  // as posted, one per entry of `vectors`
  uint64_t capacity = 0;
  bool protection_error = false;  // an SGE failed its lkey check
  int cq = -1;                    // an XRC SRQ's CQ, which the receive completes on; -1: the QP's recv_cq

  int completion_cq(const QpRecord& target) const { return cq >= 0 ? cq : target.recv_cq; }
};

// A receive queue with a ring of `capacity` WQEs of `max_sge` SGEs (at least
// one of each) in device memory; its ring_offset is 0 if the heap is full.
RecvQueue allocate_receive_queue(DeviceMemory& memory, uint32_t capacity, uint32_t max_sge);
// The bytes of its ring, for DeviceMemory::release.
inline uint64_t ring_bytes(const RecvQueue& rq) { return uint64_t{rq.capacity} * rq.slot_size; }

// The entry at the head of `rq` if its poster has finished writing it, else
// null; for a caller holding the queue's lock. consume_head() then takes it.
RecvWqe* posted_head(DeviceMemory& memory, RecvQueue& rq);
void consume_head(RecvQueue& rq);

// The WQE sequence number of position `position` (RecvWqe::sequence).
inline uint32_t wqe_sequence(uint64_t position) { return static_cast<uint32_t>(position + 1); }

// The next receive WQE for `target` (whose lock the caller holds): from its
// SRQ if it has one, raising the SRQ's limit event when the queue drops below
// the armed limit. False if none is posted.
bool take_receive(DeviceMemory& memory, QpRecord& target, ReceivePlacement& out);

// The XRC SRQ `srqn` if an XRC_RECV QP `target` may deliver into it: a live
// XRC SRQ of the QP's domain. Else null, which the IB spec answers with an
// Invalid Request NAK. (Its PD, CQ and domain are fixed while it lives.)
const SrqRecord* find_xrc_srq(DeviceMemory& memory, const QpRecord& target, uint32_t srqn);
// take_receive for an XRC_RECV QP: the next WQE of the XRC SRQ the message
// names (found with find_xrc_srq first); `out.cq` is the SRQ's CQ.
bool take_xrc_receive(DeviceMemory& memory, const QpRecord& target, uint32_t srqn, ReceivePlacement& out);

}  // namespace softverbs
