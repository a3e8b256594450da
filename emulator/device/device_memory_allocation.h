// Device memory (ibv_alloc_dm): the device's on-chip memory, of which every
// process of the device takes allocations, as from an HCA's MEMIC. The
// table here is what the device holds (in its shared state, under
// objects_lock); the bytes of an allocation live in a memfd mapping of its
// owner (shared_regions.h: map_device_memory), which peers on the
// shared-memory transport map as they map shared MR pages.
#pragma once

#include <cstdint>
#include <optional>

namespace softverbs {

namespace device_memory {
// As much as a ConnectX-5 reports (max_dm_size), for the whole device.
inline constexpr uint64_t kMaxBytes = uint64_t{128} << 10;
// Allocations are counted in these, as mlx5's MEMIC rounds them.
inline constexpr uint64_t kGranule = 64;
// Alignments up to a page are what every allocation has (its mapping's).
inline constexpr uint32_t kMaxLogAlignment = 12;
}  // namespace device_memory

// ibv_alloc_dm's checks, as mlx5's: 0, or EINVAL for a comp_mask, a length
// of 0 or beyond max_dm_size, or an alignment the device cannot give.
int validate_device_memory_request(uint64_t length, uint32_t log_align_req, uint32_t comp_mask);

// ibv_memcpy_to_dm / ibv_memcpy_from_dm's, as mlx5's: 0; EFAULT if
// [offset, offset + length) leaves the allocation of `size` bytes; EINVAL if
// offset or length is not a multiple of 4 (the device copies 4-byte words).
int validate_device_memory_copy(uint64_t size, uint64_t offset, uint64_t length);

// ibv_reg_dm_mr's: 0, or EINVAL for a registration that is not zero based,
// asks for other rights than local and remote access, or leaves the
// allocation.
int validate_device_memory_registration(uint64_t size, uint64_t offset, uint64_t length, uint32_t access_flags);

class DeviceMemoryAllocations {
 public:
  static constexpr uint32_t kCapacity = 1024;

  // Takes `length` bytes (rounded up to the granule) for `owner_process`
  // (its ProcessTable record): the allocation's index, or nullopt when the
  // device has not that much left (ENOMEM).
  std::optional<uint32_t> allocate(uint64_t length, int32_t owner_process);
  // Gives an allocation back; false if `index` names none.
  bool release(uint32_t index);
  uint64_t bytes_in_use() const { return in_use_; }

  // Gives back every allocation whose owner `is_gone`; returns how many.
  template <typename Predicate>
  size_t release_owned_if(Predicate is_gone) {
    size_t released = 0;
    for (uint32_t index = 0; index < kCapacity; ++index)
      if (allocations_[index].live && is_gone(allocations_[index].owner_process)) released += release(index);
    return released;
  }

 private:
  struct Allocation {
    uint32_t live = 0;
    int32_t owner_process = -1;
    uint64_t bytes = 0;
  };
  Allocation allocations_[kCapacity];
  uint64_t in_use_ = 0;
};

}  // namespace softverbs
