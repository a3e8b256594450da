#include "device/memory_region_table.h"

#include <atomic>
#include <cerrno>

#include "device/on_demand_paging.h"
#include "support/internal_mappings.h"
#include "support/process_id.h"
#include "support/random_bits.h"

namespace softverbs {

int validate_registration_access(uint32_t flags) {
  if (flags & ~access::kSupported) return EINVAL;
  if ((flags & (access::kRemoteWrite | access::kRemoteAtomic)) && !(flags & access::kLocalWrite)) return EINVAL;
  return 0;
}

const MemoryRegionTable::Slot* MemoryRegionTable::slot_of(uint32_t key) const {
  const Slot& slot = slots_[index_of(key)];
  if (!slot.live || slot.region.key != key) return nullptr;
  return &slot;
}

namespace {

// Reads of a slot that a writer holds odd, before the key is refused: far
// more than a preempted writer needs (each try past the first 64 yields).
constexpr uint64_t kUnlockedAttempts = 1u << 20;

template <typename T>
void store_relaxed(T& field, T value) {
  std::atomic_ref<T>(field).store(value, std::memory_order_relaxed);
}

// The classic sequence lock: odd while writing; a reader that sees the same
// even count before and after its reads has a consistent copy. A count left
// odd by a writer that died mid-change is made even by the next change.
void begin_change(uint32_t& sequence) {
  std::atomic_ref<uint32_t>(sequence).store((sequence + 2) | 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
}

void end_change(uint32_t& sequence) {
  std::atomic_ref<uint32_t>(sequence).store(sequence + 1, std::memory_order_release);
}

}  // namespace

void MemoryRegionTable::count(const Slot& slot, int change) {
  if (!slot.live) return;
  live_ += change;
  const int32_t owner = slot.region.owner_process;
  if (owner >= 0 && owner < kOwnerCapacity) owned_[owner] += change;
}

void MemoryRegionTable::write_slot(Slot& slot, const MemoryRegion& region, bool live) {
  count(slot, -1);
  begin_change(slot.sequence);
  store_relaxed(slot.region.key, region.key);
  store_relaxed(slot.region.pd_handle, region.pd_handle);
  store_relaxed(slot.region.access, region.access);
  store_relaxed(slot.region.owner_pid, region.owner_pid);
  store_relaxed(slot.region.owner_process, region.owner_process);  // listings read it unlocked
  store_relaxed(slot.region.address, region.address);
  store_relaxed(slot.region.iova, region.iova);
  store_relaxed(slot.region.length, region.length);
  slot.region.backing = region.backing;  // read under the lock only
  store_relaxed(slot.region.kind, region.kind);
  store_relaxed(slot.region.window_type, region.window_type);
  slot.region.parent_key = region.parent_key;  // read under the lock only
  store_relaxed(slot.region.bound_qpn, region.bound_qpn);
  slot.region.windows_bound = region.windows_bound;  // read under the lock only
  store_relaxed(slot.live, live);
  end_change(slot.sequence);
  count(slot, +1);
}

void MemoryRegionTable::set_live(Slot& slot, bool live) {
  count(slot, -1);
  begin_change(slot.sequence);
  store_relaxed(slot.live, live);
  end_change(slot.sequence);
  count(slot, +1);
}

MemoryRegionTable::Slot* MemoryRegionTable::take_free_slot(uint32_t& index) {
  for (uint32_t probe = 0; probe < kCapacity; ++probe) {
    index = (next_free_hint_ + probe) % kCapacity;
    Slot& slot = slots_[index];
    if (slot.live) continue;
    // The key's top byte differs from the slot's last one, so that no key of
    // the slot's last life (a window's low byte runs through all 256 values)
    // names this one. Key 0 is never handed out: a zeroed SGE must not name a
    // region.
    uint16_t tag;
    do tag = static_cast<uint16_t>(random_u64());
    while ((tag >> 8) == (slot.tag >> 8) || (index == 0 && (tag >> 8) == 0));
    slot.tag = tag;
    next_free_hint_ = (index + 1) % kCapacity;
    return &slot;
  }
  return nullptr;
}

std::optional<uint32_t> MemoryRegionTable::register_region(uint32_t pd_handle, int32_t owner_pid, uint64_t address,
                                                           uint64_t iova, uint64_t length, uint32_t access_flags,
                                                           const SharedBacking& backing, int32_t owner_process) {
  uint32_t index = 0;
  Slot* slot = take_free_slot(index);
  if (slot == nullptr) return std::nullopt;
  MemoryRegion region{
      key_of(index, slot->tag), pd_handle, access_flags, owner_pid, owner_process, 0, address, iova, length, backing};
  write_slot(*slot, region, true);
  return region.key;
}

bool MemoryRegionTable::deregister(uint32_t key) {
  const Slot* found = slot_of(key);
  if (found == nullptr || found->region.kind != KeyKind::Region) return false;
  set_live(slots_[index_of(key)], false);
  return true;
}

bool MemoryRegionTable::reregister(uint32_t key, const MemoryRegion& updated) {
  const Slot* found = slot_of(key);
  if (found == nullptr || found->region.kind != KeyKind::Region) return false;
  MemoryRegion region = updated;
  region.key = key;
  write_slot(slots_[index_of(key)], region, true);
  return true;
}

std::optional<MemoryRegion> MemoryRegionTable::find(uint32_t key) const {
  const Slot* slot = slot_of(key);
  if (slot == nullptr) return std::nullopt;
  return slot->region;
}

KeyCheck MemoryRegionTable::check_against(const Checked& region, uint32_t key, uint32_t pd_handle, Use use,
                                          uint64_t iova, uint64_t length, uint32_t needed_access,
                                          ResolvedRange* resolved) {
  if (!region.live || region.key != key) return KeyCheck::InvalidKey;
  if (region.kind == KeyKind::Window) {
    // A window has no lkey; unbound (or invalidated) it names nothing; a
    // type 2 window serves only the QP it was bound through.
    if (!use.remote || region.length == 0) return KeyCheck::InvalidKey;
    if (region.window_type == 2 && region.bound_qpn != use.qpn) return KeyCheck::InvalidKey;
  }
  if (region.pd_handle != pd_handle) return KeyCheck::WrongPd;
  // Overflow-safe containment of [iova, iova+length) in the region.
  if (iova < region.iova) return KeyCheck::OutOfBounds;
  uint64_t offset = iova - region.iova;
  if (offset > region.length || length > region.length - offset) return KeyCheck::OutOfBounds;
  if ((region.access & needed_access) != needed_access) return KeyCheck::AccessDenied;
  // An on-demand region's pages are resolved at access, by its owner (a
  // peer's copy into them goes through the kernel or the owner's agent).
  if ((region.access & access::kOnDemand) && region.owner_pid == current_pid() &&
      (overlaps_internal_mapping(region.address + offset, length) ||
       fault_in_pages(region.address + offset, length,
                      (needed_access & (access::kLocalWrite | access::kRemoteWrite | access::kRemoteAtomic)) != 0) !=
           0))
    return KeyCheck::PageFault;
  if (resolved != nullptr) *resolved = ResolvedRange{region.owner_pid, region.address + offset};
  return KeyCheck::Ok;
}

KeyCheck MemoryRegionTable::check(uint32_t key, uint32_t pd_handle, Use use, uint64_t iova, uint64_t length,
                                  uint32_t needed_access, ResolvedRange* resolved, Lock lock) const {
  const Slot& slot = slots_[index_of(key)];
  if (lock == Lock::Held) return check_against(read(slot), key, pd_handle, use, iova, length, needed_access, resolved);
  const std::optional<Checked> copy = read_consistent(slot);
  if (!copy) return KeyCheck::InvalidKey;
  return check_against(*copy, key, pd_handle, use, iova, length, needed_access, resolved);
}

MemoryRegionTable::Checked MemoryRegionTable::read(const Slot& slot) {
  const MemoryRegion& r = slot.region;
  return {slot.live, r.key,    r.pd_handle, r.access,      r.owner_pid, r.address,
          r.iova,    r.length, r.kind,      r.window_type, r.bound_qpn};
}

std::optional<MemoryRegionTable::Checked> MemoryRegionTable::read_consistent(const Slot& slot) {
  const MemoryRegion& r = slot.region;
  Checked copy;
  const bool whole = read_unlocked(slot, kUnlockedAttempts, [&] {
    copy.live = relaxed(slot.live);
    copy.key = relaxed(r.key);
    copy.pd_handle = relaxed(r.pd_handle);
    copy.access = relaxed(r.access);
    copy.owner_pid = relaxed(r.owner_pid);
    copy.address = relaxed(r.address);
    copy.iova = relaxed(r.iova);
    copy.length = relaxed(r.length);
    copy.kind = relaxed(r.kind);
    copy.window_type = relaxed(r.window_type);
    copy.bound_qpn = relaxed(r.bound_qpn);
  });
  if (!whole) return std::nullopt;
  return copy;
}

KeyCheck MemoryRegionTable::check_local(uint32_t lkey, uint32_t pd_handle, uint64_t iova, uint64_t length,
                                        uint32_t needed_access, ResolvedRange* resolved, Lock lock) const {
  // Local read is always granted; local write must be registered.
  return check(lkey, pd_handle, Use{false, 0}, iova, length, needed_access & access::kLocalWrite, resolved, lock);
}

KeyCheck MemoryRegionTable::check_remote(uint32_t rkey, uint32_t pd_handle, uint32_t qpn, uint64_t iova,
                                         uint64_t length, uint32_t needed_access, ResolvedRange* resolved,
                                         Lock lock) const {
  return check(rkey, pd_handle, Use{true, qpn}, iova, length, needed_access, resolved, lock);
}

}  // namespace softverbs
