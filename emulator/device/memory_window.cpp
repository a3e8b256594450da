// Memory windows (IBA 10.6.7), as rxe_mw.c has them: type 1 windows bound
// with ibv_bind_mw, type 2B windows bound with a BIND_MW work request and
// tied to the QP that bound them. A window is a key of the region table:
// bound, it carries its region's owner, translation and backing for its own
// range and rights, so every remote-access check treats it as a region.
#include "device/memory_window.h"

#include "device/device_memory.h"
#include "device/memory_region_table.h"
#include "support/debug_log.h"

namespace softverbs {

namespace {

// What a bind may grant: remote rights (local write is accepted and means
// nothing for a window, as rxe takes it), and zero-based addressing.
constexpr uint32_t kWindowAccess =
    access::kLocalWrite | access::kRemoteWrite | access::kRemoteRead | access::kRemoteAtomic | access::kZeroBased;

// Whether [address, address + length) lies in the region (overflow-safe).
bool within(const MemoryRegion& region, uint64_t address, uint64_t length) {
  return address >= region.iova && address - region.iova <= region.length &&
         length <= region.length - (address - region.iova);
}

}  // namespace

MemoryRegionTable::Slot* MemoryRegionTable::window_slot(uint32_t window_key) {
  Slot& slot = slots_[index_of(window_key)];
  if (!slot.live || slot.region.kind != KeyKind::Window || (slot.region.key | 0xffu) != (window_key | 0xffu))
    return nullptr;
  return &slot;
}

const MemoryRegionTable::Slot* MemoryRegionTable::window_slot(uint32_t window_key) const {
  return const_cast<MemoryRegionTable*>(this)->window_slot(window_key);
}

std::optional<uint32_t> MemoryRegionTable::allocate_window(uint32_t pd_handle, int32_t owner_pid, int32_t owner_process,
                                                           uint8_t type) {
  uint32_t index = 0;
  Slot* slot = take_free_slot(index);
  if (slot == nullptr) return std::nullopt;
  MemoryRegion window;
  window.key = key_of(index, slot->tag);
  window.pd_handle = pd_handle;
  window.owner_pid = owner_pid;
  window.owner_process = owner_process;
  window.kind = KeyKind::Window;
  window.window_type = type;
  write_slot(*slot, window, true);
  return window.key;
}

std::optional<uint32_t> MemoryRegionTable::window_rkey(uint32_t window_key) const {
  const Slot* slot = window_slot(window_key);
  if (slot == nullptr) return std::nullopt;
  return slot->region.key;
}

bool MemoryRegionTable::deallocate_window(uint32_t window_key) {
  Slot* slot = window_slot(window_key);
  if (slot == nullptr) return false;
  if (slot->region.length != 0) {
    if (Slot* parent = const_cast<Slot*>(slot_of(slot->region.parent_key))) {
      MemoryRegion region = parent->region;
      --region.windows_bound;
      write_slot(*parent, region, true);
    }
  }
  set_live(*slot, false);
  return true;
}

bool MemoryRegionTable::bind_window(const WindowBind& bind, uint32_t qp_pd, uint32_t qpn) {
  Slot* slot = window_slot(bind.window_key);
  if (slot == nullptr) return false;
  MemoryRegion window = slot->region;
  const bool zero_based = (bind.access & access::kZeroBased) != 0;
  if (bind.access & ~kWindowAccess) return false;
  if (window.window_type == 1) {
    // Bound only by ibv_bind_mw, and never zero-based (o10-36.2.2).
    if (!bind.by_bind_verb || zero_based) return false;
  } else {
    // Bound only by a work request, when free (o10-37.2.30), through a QP of
    // its PD (C10-72), to a range (o10-37.2.40: invalidation is LOCAL_INV's).
    if (bind.by_bind_verb || window.length != 0 || qp_pd != window.pd_handle || bind.length == 0) return false;
  }
  Slot* parent = nullptr;
  if (bind.length != 0) {
    parent = const_cast<Slot*>(slot_of(bind.mr_lkey));
    if (parent == nullptr) return false;
    const MemoryRegion& mr = parent->region;
    if (mr.kind != KeyKind::Region || mr.pd_handle != window.pd_handle) return false;
    if (mr.access & access::kZeroBased) return false;
    if (!(mr.access & access::kMwBind)) return false;  // C10-73
    if ((bind.access & (access::kRemoteWrite | access::kRemoteAtomic)) && !(mr.access & access::kLocalWrite))
      return false;                                            // C10-74
    if (!within(mr, bind.address, bind.length)) return false;  // C10-75
  }
  // A type 1 window bound again lets go of its region first.
  if (window.length != 0) {
    if (Slot* previous = const_cast<Slot*>(slot_of(window.parent_key))) {
      MemoryRegion region = previous->region;
      --region.windows_bound;
      write_slot(*previous, region, true);
    }
  }
  window.key = (window.key & ~0xffu) | (bind.new_rkey & 0xffu);
  window.access = bind.length != 0 ? bind.access & ~access::kLocalWrite : 0;
  window.length = bind.length;
  window.iova = zero_based ? 0 : bind.address;
  window.parent_key = 0;
  window.bound_qpn = 0;
  window.address = 0;
  window.backing = SharedBacking{};
  if (parent != nullptr) {
    MemoryRegion region = parent->region;
    ++region.windows_bound;
    write_slot(*parent, region, true);
    window.parent_key = region.key;
    window.owner_pid = region.owner_pid;
    window.address = region.address + (bind.address - region.iova);
    window.backing = region.backing;
    // A window over on-demand pages resolves them at each access, as its region does.
    window.access |= region.access & access::kOnDemand;
    if (window.window_type == 2) window.bound_qpn = qpn;
  }
  write_slot(*slot, window, true);
  return true;
}

size_t MemoryRegionTable::unbind_windows_of_qp(uint32_t qpn) {
  size_t unbound = 0;
  for (Slot& slot : slots_) {
    const MemoryRegion& window = slot.region;
    if (slot.live && window.kind == KeyKind::Window && window.window_type == 2 && window.length != 0 &&
        window.bound_qpn == qpn && invalidate_window(window.key, window.pd_handle, qpn))
      ++unbound;
  }
  return unbound;
}

bool MemoryRegionTable::invalidate_window(uint32_t rkey, uint32_t qp_pd, uint32_t qpn) {
  Slot* slot = const_cast<Slot*>(slot_of(rkey));
  if (slot == nullptr) return false;
  MemoryRegion window = slot->region;
  // Only a bound type 2 window, through its own QP (o10-37.2.26: type 1
  // windows are not invalidated by work requests).
  if (window.kind != KeyKind::Window || window.window_type != 2 || window.length == 0 || window.pd_handle != qp_pd ||
      window.bound_qpn != qpn)
    return false;
  if (Slot* parent = const_cast<Slot*>(slot_of(window.parent_key))) {
    MemoryRegion region = parent->region;
    --region.windows_bound;
    write_slot(*parent, region, true);
  }
  window.access = 0;
  window.length = 0;
  window.iova = 0;
  window.address = 0;
  window.parent_key = 0;
  window.bound_qpn = 0;
  window.backing = SharedBacking{};
  write_slot(*slot, window, true);
  return true;
}

WcStatus execute_local_operation(DeviceMemory& memory, uint32_t pd_handle, uint32_t qpn, const SendWqe& request) {
  ExclusiveLock lock(memory.shared().memory_lock);
  MemoryRegionTable& table = memory.shared().mrs;
  if (request.opcode == SendOpcode::BindMemoryWindow) {
    if (table.bind_window(request.bind, pd_handle, qpn)) return WcStatus::Success;
    debug_log("QP %#x wr_id %#llx: bind of window %#x to lkey %#x [%#llx, +%llu) access %#x refused", qpn,
              static_cast<unsigned long long>(request.wr_id), request.bind.window_key, request.bind.mr_lkey,
              static_cast<unsigned long long>(request.bind.address),
              static_cast<unsigned long long>(request.bind.length), request.bind.access);
    return WcStatus::MemoryWindowBindError;
  }
  if (table.invalidate_window(request.invalidate_rkey, pd_handle, qpn)) return WcStatus::Success;
  debug_log("QP %#x wr_id %#llx: LOCAL_INV of rkey %#x refused", qpn, static_cast<unsigned long long>(request.wr_id),
            request.invalidate_rkey);
  return WcStatus::LocalQpOperationError;
}

bool invalidate_on_receive(DeviceMemory& memory, uint32_t pd_handle, uint32_t qpn, uint32_t rkey) {
  ExclusiveLock lock(memory.shared().memory_lock);
  const bool done = memory.shared().mrs.invalidate_window(rkey, pd_handle, qpn);
  if (!done) debug_log("QP %#x: SEND with invalidate of rkey %#x refused", qpn, rkey);
  return done;
}

}  // namespace softverbs
