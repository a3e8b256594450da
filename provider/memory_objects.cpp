// Protection domains and memory regions.
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <memory>

#include "checker/registered_memory.h"
#include "checker/work_checks.h"
#include "device/device_limits.h"
#include "provider_context.h"
#include "shm/shared_regions.h"
#include "support/debug_log.h"
#include "udp/transport.h"
#include "verbs_objects.h"

namespace softverbs::provider {

namespace {

ibv_pd* alloc_pd(ibv_context* context) {
  if (device_removed(context)) return nullptr;
  auto pd = std::make_unique<ProviderPd>();
  pd->ibv.context = context;
  pd->ibv.handle = memory_of(context).allocate_pd_handle();
  return &pd.release()->ibv;
}

int dealloc_pd(ibv_pd* pd) {
  if (const int users = to_pd(pd)->users.load(std::memory_order_relaxed); users > 0) {
    if (check::enabled()) check::pd_deallocating(pd, users, __builtin_return_address(0));
    return EBUSY;
  }
  std::unique_ptr<ProviderPd> owner(to_pd(pd));
  if (owner->is_parent_domain()) release_parent_domain(*owner);
  return 0;
}

// Whether a region pins pages of the process (the checks of registered
// memory watch those): not an on-demand one, nor one of device memory.
bool pins_process_memory(const void* address, int access) {
  return address != nullptr && (access & IBV_ACCESS_ON_DEMAND) == 0;
}

// The IB access rights that make an HCA pin pages for writing.
constexpr int kWritableAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_MW_BIND;

// ---- memory regions -------------------------------------------------------

ibv_mr* reg_mr(ibv_pd* pd, void* addr, size_t length, uint64_t hca_va, int access_flags) {
  if (int error = validate_registration_access(static_cast<uint32_t>(access_flags))) {
    errno = error;
    return nullptr;
  }
  const bool on_demand = (access_flags & IBV_ACCESS_ON_DEMAND) != 0;
  // Implicit ODP: one key for the whole address space, as mlx5 makes it.
  const bool implicit = on_demand && addr == nullptr && length == SIZE_MAX;
  const uint64_t start = reinterpret_cast<uint64_t>(addr);
  if ((implicit && hca_va != 0) ||
      (!implicit && (length > limits::kMaxMrSize || (addr == nullptr && length != 0) || start + length < start))) {
    errno = EINVAL;
    return nullptr;
  }
  if (device_removed(pd->context)) return nullptr;
  // Pages an HCA could not pin with the access asked for are refused now,
  // not found out when a peer's WRITE lands on them. On-demand pages are
  // not pinned: they are resolved at each access (on_demand_paging.h).
  if (int error =
          on_demand ? 0 : check_registrable(reinterpret_cast<uint64_t>(addr), length, access_flags & kWritableAccess)) {
    errno = error;
    return nullptr;
  }
  DeviceMemory& memory = memory_of(pd->context);
  const int process = owner_process_slot(memory);
  if (process < 0) return nullptr;
  uint64_t iova = (access_flags & IBV_ACCESS_ZERO_BASED) ? 0 : hca_va;
  // Memory that other processes write or read (receive buffers, remote
  // access) becomes mappable by them, where it qualifies; on-demand memory
  // never, since the mapping would not follow the application's changes.
  SharedBacking backing;
  if (!on_demand && (access_flags & (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE |
                                     IBV_ACCESS_REMOTE_ATOMIC))) {
    const char* why = "";
    if (auto shared = share_pages(reinterpret_cast<uint64_t>(addr), length, &why))
      backing = *shared;
    else
      debug_log("MR at %p, %zu bytes: peers copy with system calls (%s)", addr, length, why);
  }
  std::optional<uint32_t> key;
  {
    ExclusiveLock lock(memory.shared().memory_lock);
    key = memory.shared().mrs.register_region(pd->handle, getpid(), reinterpret_cast<uint64_t>(addr), iova, length,
                                              static_cast<uint32_t>(access_flags), backing, process);
  }
  if (!key) {
    release_pages(backing);
    errno = ENOMEM;
    return nullptr;
  }
  auto mr = std::make_unique<abi::verbs_mr>();
  mr->ibv_mr.context = pd->context;
  mr->ibv_mr.pd = pd;
  mr->ibv_mr.addr = addr;
  mr->ibv_mr.length = length;
  mr->ibv_mr.handle = *key;
  mr->ibv_mr.lkey = *key;
  mr->ibv_mr.rkey = *key;
  mr->mr_type = abi::kMrTypeMr;
  mr->access = access_flags;
  use_pd(pd);
  if (check::enabled()) check::mr_registered(&mr->ibv_mr, iova, access_flags);
  if (check::enabled() && pins_process_memory(addr, access_flags)) check::region_registered(&mr->ibv_mr, addr, length);
  return &mr.release()->ibv_mr;
}

int rereg_mr(abi::verbs_mr* vmr, int flags, ibv_pd* pd, void* addr, size_t length, int access_flags) {
  ibv_mr& mr = vmr->ibv_mr;
  DeviceMemory& memory = memory_of(mr.context);
  int error = 0;
  // Neither an implicit on-demand region (the whole address space) nor one
  // of device memory (no address of the process) has a translation that a
  // re-registration could keep or change; nor does a region change between
  // pinned and on-demand, whose pages were checked (or not) for that.
  if ((mr.addr == nullptr && mr.length != 0) ||
      ((flags & IBV_REREG_MR_CHANGE_ACCESS) && ((access_flags ^ vmr->access) & IBV_ACCESS_ON_DEMAND))) {
    errno = EINVAL;
    return EINVAL;
  }
  if ((flags & IBV_REREG_MR_CHANGE_ACCESS) &&
      (error = validate_registration_access(static_cast<uint32_t>(access_flags))) != 0) {
    errno = error;
    return error;
  }
  if ((flags & IBV_REREG_MR_CHANGE_PD) && (pd == nullptr || pd->context != mr.context)) {
    errno = EINVAL;
    return EINVAL;
  }
  if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
    const int access = (flags & IBV_REREG_MR_CHANGE_ACCESS) ? access_flags : vmr->access;
    if (length > limits::kMaxMrSize || (addr == nullptr && length != 0)) error = EINVAL;
    if (error == 0 && !(access & IBV_ACCESS_ON_DEMAND))
      error = check_registrable(reinterpret_cast<uint64_t>(addr), length, access & kWritableAccess);
    if (error != 0) {
      errno = error;
      return error;
    }
  }
  SharedBacking dropped;
  bool found = false, busy = false;
  // The UDP engines of this process use the old range without the table's
  // lock: they are held off while it changes.
  UdpTransport::hold_data_paths(memory, [&] {
    ExclusiveLock lock(memory.shared().memory_lock);
    std::optional<MemoryRegion> region = memory.shared().mrs.find(mr.lkey);
    if (!region) return;
    found = true;
    // A region with windows bound to it keeps its translation, PD and
    // rights until they are gone.
    if (region->windows_bound > 0) {
      busy = true;
      return;
    }
    if (flags & IBV_REREG_MR_CHANGE_PD) region->pd_handle = pd->handle;
    if (flags & IBV_REREG_MR_CHANGE_ACCESS) region->access = static_cast<uint32_t>(access_flags);
    if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
      region->address = reinterpret_cast<uint64_t>(addr);
      region->length = length;
      // The new range is reached with system calls (not worth moving pages
      // under the table's lock).
      dropped = region->backing;
      region->backing = SharedBacking{};
    }
    if (flags & (IBV_REREG_MR_CHANGE_TRANSLATION | IBV_REREG_MR_CHANGE_ACCESS))
      region->iova = (region->access & IBV_ACCESS_ZERO_BASED) ? 0 : region->address;
    memory.shared().mrs.reregister(mr.lkey, *region);
  });
  if (!found || busy) {
    errno = busy ? EBUSY : EINVAL;
    return errno;
  }
  if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
    // libibverbs sets mr.addr and mr.length after this returns.
    if (check::enabled() && pins_process_memory(mr.addr, vmr->access)) check::region_deregistered(&mr);
    if (check::enabled() && pins_process_memory(addr, vmr->access)) check::region_registered(&mr, addr, length);
  }
  if (flags & IBV_REREG_MR_CHANGE_ACCESS) vmr->access = access_flags;
  if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
    mr.addr = addr;  // libibverbs sets these too, after this returns
    mr.length = length;
  }
  if (check::enabled())
    check::mr_registered(&mr, (vmr->access & IBV_ACCESS_ZERO_BASED) ? 0 : reinterpret_cast<uint64_t>(mr.addr),
                         vmr->access);
  if (flags & IBV_REREG_MR_CHANGE_PD) {
    unuse_pd(mr.pd);
    use_pd(pd);
  }
  release_pages(dropped);
  return 0;
}

int dereg_mr(abi::verbs_mr* vmr) {
  const bool checking = check::enabled();
  if (checking) {
    const void* call_site = __builtin_return_address(0);
    if (check::used_after_destroy(check::ObjectKind::Mr, &vmr->ibv_mr, "ibv_dereg_mr", call_site)) return EINVAL;
    check::mr_deregistering(
        &vmr->ibv_mr, [](ibv_qp* qp) { return to_qp(qp)->device ? to_qp(qp)->device->outstanding_sends() : size_t{0}; },
        call_site);
  }
  DeviceMemory& memory = memory_of(vmr->ibv_mr.context);
  SharedBacking backing;
  bool removed = false, busy = false;
  // A region a forked child inherited stays its maker's.
  const bool inherited = made_elsewhere(memory, vmr->ibv_mr.lkey);
  // The UDP engines of this process use registered ranges without the
  // table's lock: they are held off while one goes.
  if (!inherited)
    UdpTransport::hold_data_paths(memory, [&] {
      ExclusiveLock lock(memory.shared().memory_lock);
      auto region = memory.shared().mrs.find(vmr->ibv_mr.lkey);
      // A region with windows bound to it stays (EBUSY, as rxe).
      if (region && region->windows_bound > 0) {
        busy = true;
        return;
      }
      if (!region || !memory.shared().mrs.deregister(vmr->ibv_mr.lkey)) return;
      backing = region->backing;
      removed = true;
    });
  if (busy || (!removed && !inherited)) {
    // It stays: so does the checker's record of it.
    if (checking)
      check::mr_registered(&vmr->ibv_mr,
                           (vmr->access & IBV_ACCESS_ZERO_BASED) ? 0 : reinterpret_cast<uint64_t>(vmr->ibv_mr.addr),
                           vmr->access);
    return busy ? EBUSY : EINVAL;
  }
  if (checking && pins_process_memory(vmr->ibv_mr.addr, vmr->access)) check::region_deregistered(&vmr->ibv_mr);
  release_pages(backing);
  unuse_pd(vmr->ibv_mr.pd);
  if (checking)
    check::quarantine(vmr->ibv_mr.context, check::ObjectKind::Mr, &vmr->ibv_mr,
                      [vmr] { std::unique_ptr<abi::verbs_mr> owner(vmr); });
  else
    std::unique_ptr<abi::verbs_mr> owner(vmr);
  return 0;
}

}  // namespace

void add_memory_ops(abi::verbs_context_ops& ops) {
  ops.alloc_pd = alloc_pd;
  ops.dealloc_pd = dealloc_pd;
  ops.reg_mr = reg_mr;
  ops.dereg_mr = dereg_mr;
  ops.rereg_mr = rereg_mr;
}

}  // namespace softverbs::provider
