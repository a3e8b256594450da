// Device memory: ibv_alloc_dm, ibv_free_dm, ibv_memcpy_to/from_dm and
// ibv_reg_dm_mr. The device counts what is allocated
// (device/device_memory_allocation.h); the bytes are a memfd mapping of this
// process (shm/shared_regions.h), which peers map as an MR's backing.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "device/device_memory_allocation.h"
#include "shm/shared_regions.h"
#include "support/process_id.h"
#include "verbs_objects.h"

namespace softverbs::provider {

namespace {

struct ProviderDm {
  ibv_dm ibv{};         // first: libibverbs hands it back
  uint64_t length = 0;  // as allocated: copies and registrations stay within it
  uint32_t allocation = 0;
  SharedBacking backing;
  std::mutex keys_mutex;
  std::vector<uint32_t> keys;   // of the MRs registered on it (some may be gone)
  pid_t maker = current_pid();  // a forked child's free leaves its parent's allocation
};

ProviderDm* to_dm(ibv_dm* dm) { return reinterpret_cast<ProviderDm*>(dm); }

uint8_t* bytes_of(ProviderDm* dm) { return reinterpret_cast<uint8_t*>(dm->backing.base); }

int memcpy_to_dm(ibv_dm* dm, uint64_t dm_offset, const void* host_addr, size_t length) {
  ProviderDm* mine = to_dm(dm);
  if (int error = validate_device_memory_copy(mine->length, dm_offset, length)) return error;
  if (length != 0) std::memcpy(bytes_of(mine) + dm_offset, host_addr, length);
  return 0;
}

int memcpy_from_dm(void* host_addr, ibv_dm* dm, uint64_t dm_offset, size_t length) {
  ProviderDm* mine = to_dm(dm);
  if (int error = validate_device_memory_copy(mine->length, dm_offset, length)) return error;
  if (length != 0) std::memcpy(host_addr, bytes_of(mine) + dm_offset, length);
  return 0;
}

ibv_dm* alloc_dm(ibv_context* context, ibv_alloc_dm_attr* attr) {
  if (attr == nullptr) {
    errno = EINVAL;
    return nullptr;
  }
  if (int error = validate_device_memory_request(attr->length, attr->log_align_req, attr->comp_mask)) {
    errno = error;
    return nullptr;
  }
  if (device_removed(context)) return nullptr;
  DeviceMemory& memory = memory_of(context);
  const int process = owner_process_slot(memory);
  if (process < 0) return nullptr;
  std::optional<uint32_t> allocation;
  {
    SharedLock lock(memory.shared().objects_lock);
    allocation = memory.shared().device_memory.allocate(attr->length, process);
  }
  if (!allocation) {
    errno = ENOMEM;
    return nullptr;
  }
  std::optional<SharedBacking> backing = map_device_memory(attr->length);
  if (!backing) {
    SharedLock lock(memory.shared().objects_lock);
    memory.shared().device_memory.release(*allocation);
    errno = ENOMEM;
    return nullptr;
  }
  auto dm = std::make_unique<ProviderDm>();
  dm->ibv.context = context;
  dm->ibv.memcpy_to_dm = memcpy_to_dm;
  dm->ibv.memcpy_from_dm = memcpy_from_dm;
  dm->ibv.handle = *allocation;
  dm->length = attr->length;
  dm->allocation = *allocation;
  dm->backing = *backing;
  return &dm.release()->ibv;
}

int free_dm(ibv_dm* dm) {
  ProviderDm* mine = to_dm(dm);
  DeviceMemory& memory = memory_of(dm->context);
  {
    // An HCA refuses to free device memory that MRs still name.
    std::lock_guard guard(mine->keys_mutex);
    MemoryReadLock lock(memory);
    for (uint32_t key : mine->keys) {
      std::optional<MemoryRegion> region = memory.shared().mrs.find(key);
      if (region && region->backing.id == mine->backing.id) return EBUSY;
    }
  }
  std::unique_ptr<ProviderDm> owner(mine);
  unmap_device_memory(mine->backing);
  if (!made_by_this_process(mine->maker)) return 0;
  SharedLock lock(memory.shared().objects_lock);
  memory.shared().device_memory.release(mine->allocation);
  return 0;
}

ibv_mr* reg_dm_mr(ibv_pd* pd, ibv_dm* dm, uint64_t dm_offset, size_t length, unsigned int access_flags) {
  if (dm == nullptr || dm->context != pd->context) {
    errno = EINVAL;
    return nullptr;
  }
  ProviderDm* mine = to_dm(dm);
  if (int error = validate_device_memory_registration(mine->length, dm_offset, length, access_flags)) {
    errno = error;
    return nullptr;
  }
  if (device_removed(pd->context)) return nullptr;
  DeviceMemory& memory = memory_of(pd->context);
  const int process = owner_process_slot(memory);
  if (process < 0) return nullptr;
  std::optional<uint32_t> key;
  {
    // Held across the registration: a concurrent ibv_free_dm sees the key.
    std::lock_guard guard(mine->keys_mutex);
    {
      // Zero based: the MR's iova 0 is dm_offset in the device memory.
      ExclusiveLock lock(memory.shared().memory_lock);
      std::erase_if(mine->keys, [&](uint32_t old) {  // those deregistered since
        std::optional<MemoryRegion> region = memory.shared().mrs.find(old);
        return !region || region->backing.id != mine->backing.id;
      });
      key = memory.shared().mrs.register_region(pd->handle, getpid(), mine->backing.base + dm_offset, 0, length,
                                                access_flags, mine->backing, process);
    }
    if (key) mine->keys.push_back(*key);
  }
  if (!key) {
    errno = ENOMEM;
    return nullptr;
  }
  auto mr = std::make_unique<abi::verbs_mr>();
  mr->ibv_mr.context = pd->context;
  mr->ibv_mr.pd = pd;
  mr->ibv_mr.addr = nullptr;  // the device memory has no address of the application's
  mr->ibv_mr.length = length;
  mr->ibv_mr.handle = *key;
  mr->ibv_mr.lkey = *key;
  mr->ibv_mr.rkey = *key;
  mr->mr_type = abi::kMrTypeMr;
  mr->access = static_cast<int>(access_flags);
  use_pd(pd);
  return &mr.release()->ibv_mr;
}

}  // namespace

void add_device_memory_ops(abi::verbs_context_ops& ops) {
  ops.alloc_dm = alloc_dm;
  ops.free_dm = free_dm;
  ops.reg_dm_mr = reg_dm_mr;
}

}  // namespace softverbs::provider
