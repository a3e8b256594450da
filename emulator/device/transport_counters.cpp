#include "device/transport_counters.h"

#include "support/process_id.h"

namespace softverbs {

CounterSlot& TransportCounters::claim(int32_t pid) {
  for (CounterSlot& slot : slots)
    if (slot.owner_pid.load(std::memory_order_relaxed) == pid) return slot;
  for (size_t i = 0; i + 1 < kSlots; ++i) {
    int32_t owner = slots[i].owner_pid.load(std::memory_order_relaxed);
    // Two processes may both find this owner gone: the exchange lets one in.
    if (!process_alive(owner) && slots[i].owner_pid.compare_exchange_strong(owner, pid)) return slots[i];
  }
  return slots[kSlots - 1];
}

}  // namespace softverbs
