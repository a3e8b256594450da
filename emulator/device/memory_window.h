// What the memory-window work requests do, on either transport: the
// requester's local operations (BIND_MW, LOCAL_INV) and the responder's
// invalidation of a SEND with invalidate. The window itself lives in the
// region table (memory_region_table.h).
#pragma once

#include <cstdint>

#include "device/completion_ring.h"
#include "device/work_request.h"

namespace softverbs {

class DeviceMemory;

// Executes a BIND_MW or LOCAL_INV posted on QP `qpn` of PD `pd_handle`;
// returns the status it completes with (IBV_WC_MW_BIND_ERR for a refused
// bind, IBV_WC_LOC_QP_OP_ERR for a refused invalidation, as rxe).
WcStatus execute_local_operation(DeviceMemory& memory, uint32_t pd_handle, uint32_t qpn, const SendWqe& request);

// A SEND with invalidate that reached QP `qpn`: invalidates the window of
// `rkey`; false if it cannot (IBA class J: the receive completes with
// IBV_WC_REM_INV_REQ_ERR and the QP goes to ERR).
bool invalidate_on_receive(DeviceMemory& memory, uint32_t pd_handle, uint32_t qpn, uint32_t rkey);

}  // namespace softverbs
