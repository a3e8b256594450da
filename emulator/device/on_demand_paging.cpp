#include "device/on_demand_paging.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <optional>
#include <vector>

#include "device/device_memory.h"
#include "shm/shared_regions.h"
#include "support/process_id.h"

namespace softverbs {

namespace {

uint64_t page_size() {
  static const uint64_t size = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return size;
}

// MADV_POPULATE_* (Linux 5.14) faults pages in as a device's page fault
// does, permissions included; before it, the mappings are read instead.
bool populate_supported() {
  static const bool supported = [] {
    static char probe;
    const uint64_t start = reinterpret_cast<uint64_t>(&probe) & ~(page_size() - 1);
    return madvise(reinterpret_cast<void*>(start), page_size(), MADV_POPULATE_READ) == 0 || errno != EINVAL;
  }();
  return supported;
}

// Where [iova, iova + length) of `region` is in its owner's memory, if the
// region holds all of it.
std::optional<uint64_t> address_in(const MemoryRegion& region, uint64_t iova, uint64_t length) {
  if (iova < region.iova) return std::nullopt;
  const uint64_t offset = iova - region.iova;
  if (offset > region.length || length > region.length - offset) return std::nullopt;
  return region.address + offset;
}

}  // namespace

int fault_in_pages(uint64_t address, uint64_t length, bool write) {
  if (length == 0) return 0;
  const uint64_t page = page_size();
  if (address + length < address || address + length > UINT64_MAX - page + 1) return EFAULT;
  const uint64_t start = address & ~(page - 1);
  const uint64_t end = (address + length + page - 1) & ~(page - 1);
  for (;;) {
    if (madvise(reinterpret_cast<void*>(start), end - start, write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) == 0)
      return 0;
    if (errno == EINTR) continue;
    if (errno == EINVAL && !populate_supported()) return check_registrable(address, length, write);
    return EFAULT;
  }
}

int advise_prefetch(DeviceMemory& memory, uint32_t pd_handle, uint32_t advice, uint32_t flags,
                    std::span<const Sge> sges) {
  if (advice > static_cast<uint32_t>(PrefetchAdvice::PrefetchNoFault)) return EOPNOTSUPP;
  if ((flags & ~kAdviseFlush) != 0 || sges.empty()) return EINVAL;
  const bool synchronous = (flags & kAdviseFlush) != 0;
  const auto kind = static_cast<PrefetchAdvice>(advice);
  MemoryReadLock lock(memory);  // the regions stay what they are while their pages are faulted in
  std::vector<std::optional<MemoryRegion>> regions;
  regions.reserve(sges.size());
  // Every key is checked before any page is touched.
  for (const Sge& sge : sges) {
    std::optional<MemoryRegion> region = memory.shared().mrs.find(sge.lkey);
    const bool usable = region && region->pd_handle == pd_handle && region->owner_pid == current_pid() &&
                        (region->access & access::kOnDemand) &&
                        (kind != PrefetchAdvice::PrefetchWrite || (region->access & access::kLocalWrite));
    if (!usable) return synchronous ? ENOENT : EINVAL;
    regions.push_back(region);
  }
  for (size_t i = 0; i < sges.size(); ++i) {
    const std::optional<uint64_t> address = address_in(*regions[i], sges[i].address, sges[i].length);
    if (!address) {
      if (synchronous) return EFAULT;
      continue;
    }
    // Without faulting, the pages already present are what a device would map.
    if (kind == PrefetchAdvice::PrefetchNoFault) continue;
    const int error = fault_in_pages(*address, sges[i].length, kind == PrefetchAdvice::PrefetchWrite);
    if (error != 0 && synchronous) return error;
  }
  return 0;
}

}  // namespace softverbs
