#include "memory_region_table.h"

#include <cerrno>

namespace softverbs {

int validate_registration_access(uint32_t flags) {
  if (flags & ~access::kSupported) return EINVAL;
  if ((flags & (access::kRemoteWrite | access::kRemoteAtomic)) && !(flags & access::kLocalWrite)) return EINVAL;
  return 0;
}

MemoryRegionTable::MemoryRegionTable(uint32_t seed) {
  for (uint32_t i = 0; i < kCapacity; ++i) slots_[i].variant = static_cast<uint8_t>(seed + i * 37);
}

// A key is the slot index in the upper 24 bits and a variant byte in the low
// 8, as HCAs build them: the byte changes at each registration of the slot.
const MemoryRegionTable::Slot* MemoryRegionTable::slot_of(uint32_t key) const {
  uint32_t index = key >> 8;
  if (index >= kCapacity) return nullptr;
  const Slot& slot = slots_[index];
  if (!slot.live || slot.region.key != key) return nullptr;
  return &slot;
}

std::optional<uint32_t> MemoryRegionTable::register_region(uint32_t pd_handle, int32_t owner_pid, uint64_t address,
                                                           uint64_t iova, uint64_t length, uint32_t access_flags,
                                                           const SharedBacking& backing) {
  for (uint32_t probe = 0; probe < kCapacity; ++probe) {
    uint32_t index = (next_free_hint_ + probe) % kCapacity;
    Slot& slot = slots_[index];
    if (slot.live) continue;
    ++slot.variant;
    // Key 0 is never handed out: a zeroed SGE must not name a region.
    if (index == 0 && slot.variant == 0) ++slot.variant;
    slot.live = true;
    slot.region =
        MemoryRegion{(index << 8) | slot.variant, pd_handle, access_flags, owner_pid, address, iova, length, backing};
    next_free_hint_ = (index + 1) % kCapacity;
    ++live_;
    return slot.region.key;
  }
  return std::nullopt;
}

bool MemoryRegionTable::deregister(uint32_t key) {
  const Slot* found = slot_of(key);
  if (found == nullptr) return false;
  Slot& slot = slots_[key >> 8];
  slot.live = false;
  --live_;
  return true;
}

bool MemoryRegionTable::reregister(uint32_t key, const MemoryRegion& updated) {
  if (slot_of(key) == nullptr) return false;
  MemoryRegion& region = slots_[key >> 8].region;
  region = updated;
  region.key = key;
  return true;
}

std::optional<MemoryRegion> MemoryRegionTable::find(uint32_t key) const {
  const Slot* slot = slot_of(key);
  if (slot == nullptr) return std::nullopt;
  return slot->region;
}

KeyCheck MemoryRegionTable::check(uint32_t key, uint32_t pd_handle, uint64_t iova, uint64_t length,
                                  uint32_t needed_access, ResolvedRange* resolved) const {
  const Slot* slot = slot_of(key);
  if (slot == nullptr) return KeyCheck::InvalidKey;
  const MemoryRegion& region = slot->region;
  if (region.pd_handle != pd_handle) return KeyCheck::WrongPd;
  // Overflow-safe containment of [iova, iova+length) in the region.
  if (iova < region.iova) return KeyCheck::OutOfBounds;
  uint64_t offset = iova - region.iova;
  if (offset > region.length || length > region.length - offset) return KeyCheck::OutOfBounds;
  if ((region.access & needed_access) != needed_access) return KeyCheck::AccessDenied;
  if (resolved != nullptr) *resolved = ResolvedRange{region.owner_pid, region.address + offset};
  return KeyCheck::Ok;
}

KeyCheck MemoryRegionTable::check_local(uint32_t lkey, uint32_t pd_handle, uint64_t iova, uint64_t length,
                                        uint32_t needed_access, ResolvedRange* resolved) const {
  // Local read is always granted; local write must be registered.
  return check(lkey, pd_handle, iova, length, needed_access & access::kLocalWrite, resolved);
}

KeyCheck MemoryRegionTable::check_remote(uint32_t rkey, uint32_t pd_handle, uint64_t iova, uint64_t length,
                                         uint32_t needed_access, ResolvedRange* resolved) const {
  return check(rkey, pd_handle, iova, length, needed_access, resolved);
}

}  // namespace softverbs
