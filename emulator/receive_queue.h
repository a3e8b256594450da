// Taking receive WQEs off a QP's receive queue or its SRQ, for whichever
// path delivers a SEND: the shared-memory requester (acting for the target)
// or the UDP responder (in the target's own process).
#pragma once

#include <sys/types.h>

#include <cstdint>

#include "device_limits.h"
#include "device_memory.h"
#include "memory_copy.h"
#include "small_vector.h"

namespace softverbs {

// A receive WQE resolved to its owner's addresses.
struct ReceivePlacement {
  uint64_t wr_id = 0;
  pid_t owner = 0;
  SmallVector<RemoteRange, limits::kMaxSge> vectors;
  SmallVector<Sge, limits::kMaxSge> sges;  // as posted, one per entry of `vectors`
  uint64_t capacity = 0;
  bool protection_error = false;  // an SGE failed its lkey check
};

// The next receive WQE for `target` (whose lock the caller holds): from its
// SRQ if it has one, raising the SRQ's limit event when the queue drops below
// the armed limit. False if none is posted.
bool take_receive(DeviceMemory& memory, QpRecord& target, ReceivePlacement& out);

}  // namespace softverbs
