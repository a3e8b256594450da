#include "device/device_memory_allocation.h"

#include <cerrno>

#include "device/memory_region_table.h"

namespace softverbs {

int validate_device_memory_request(uint64_t length, uint32_t log_align_req, uint32_t comp_mask) {
  if (comp_mask != 0 || length == 0 || length > device_memory::kMaxBytes ||
      log_align_req > device_memory::kMaxLogAlignment)
    return EINVAL;
  return 0;
}

int validate_device_memory_copy(uint64_t size, uint64_t offset, uint64_t length) {
  if (offset > size || length > size - offset) return EFAULT;
  if (offset % 4 != 0 || length % 4 != 0) return EINVAL;
  return 0;
}

int validate_device_memory_registration(uint64_t size, uint64_t offset, uint64_t length, uint32_t access_flags) {
  constexpr uint32_t kAllowed =
      access::kLocalWrite | access::kRemoteWrite | access::kRemoteRead | access::kRemoteAtomic | access::kZeroBased;
  if (!(access_flags & access::kZeroBased) || (access_flags & ~kAllowed) != 0) return EINVAL;
  if (int error = validate_registration_access(access_flags)) return error;
  if (offset > size || length > size - offset) return EINVAL;
  return 0;
}

std::optional<uint32_t> DeviceMemoryAllocations::allocate(uint64_t length, int32_t owner_process) {
  const uint64_t bytes = (length + device_memory::kGranule - 1) / device_memory::kGranule * device_memory::kGranule;
  if (bytes > device_memory::kMaxBytes - in_use_) return std::nullopt;
  for (uint32_t index = 0; index < kCapacity; ++index) {
    Allocation& allocation = allocations_[index];
    if (allocation.live) continue;
    allocation = Allocation{1, owner_process, bytes};
    in_use_ += bytes;
    return index;
  }
  return std::nullopt;
}

bool DeviceMemoryAllocations::release(uint32_t index) {
  if (index >= kCapacity || !allocations_[index].live) return false;
  in_use_ -= allocations_[index].bytes;
  allocations_[index] = Allocation{};
  return true;
}

}  // namespace softverbs
