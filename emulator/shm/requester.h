// The shared-memory transport's requester. The initiating process plays the
// HCA for both ends: it validates and executes a send work request, places
// the data in the target process and completes there, so a WRITE, READ or
// atomic needs nothing from the target application, and a SEND only a
// posted receive.
#pragma once

#include <cstdint>

#include "device/device_memory.h"
#include "device/work_request.h"

namespace softverbs {

enum class SendOutcome : uint8_t {
  Completed,         // `completion` holds the requester's result
  ReceiverNotReady,  // RC: no receive posted at the target (RNR); nothing moved
};

// Executes `request` on `qp` (a QP of this process). On an error status the
// caller moves an RC QP to ERR (the IB spec's requester behaviour).
SendOutcome execute_send(DeviceMemory& memory, QpRecord& qp, const SendWqe& request, Completion& completion);

}  // namespace softverbs
