// On-demand paging (IBV_ACCESS_ON_DEMAND): a region whose pages are not
// pinned at registration but resolved when the device touches them, as an
// HCA's page-fault handler resolves them. A page that cannot be resolved
// then (not mapped, or without the access asked for) fails that access: a
// local SGE with IBV_WC_LOC_PROT_ERR, a remote one with a remote access
// error. Also ibv_advise_mr's prefetch, and the ODP capabilities reported.
#pragma once

#include <cstdint>
#include <span>

#include "device/work_request.h"

namespace softverbs {

class DeviceMemory;

// Faults in this process's pages of [address, address + length) for reading
// or writing, as an HCA's page fault would: 0, or EFAULT if a page is not
// mapped or does not allow the access.
int fault_in_pages(uint64_t address, uint64_t length, bool write);

// The ODP capability bits (values as the verbs ABI's ibv_odp_* enums).
namespace odp {
inline constexpr uint64_t kSupport = 1u << 0;
inline constexpr uint64_t kSupportImplicit = 1u << 1;
inline constexpr uint32_t kSend = 1u << 0;
inline constexpr uint32_t kReceive = 1u << 1;
inline constexpr uint32_t kWrite = 1u << 2;
inline constexpr uint32_t kRead = 1u << 3;
inline constexpr uint32_t kAtomic = 1u << 4;
inline constexpr uint32_t kSrqReceive = 1u << 5;
}  // namespace odp

// What a device does with on-demand regions, per transport: every
// operation the transport has, since every data path resolves pages the
// same way.
struct OdpCapabilities {
  uint64_t general = odp::kSupport | odp::kSupportImplicit;
  uint32_t rc = odp::kSend | odp::kReceive | odp::kWrite | odp::kRead | odp::kAtomic | odp::kSrqReceive;
  uint32_t uc = odp::kSend | odp::kReceive | odp::kWrite | odp::kSrqReceive;
  uint32_t ud = odp::kSend | odp::kReceive | odp::kSrqReceive;
  uint32_t xrc = odp::kSend | odp::kReceive | odp::kWrite | odp::kRead | odp::kAtomic | odp::kSrqReceive;
};

// ibv_advise_mr (values as the verbs ABI's).
enum class PrefetchAdvice : uint32_t { Prefetch = 0, PrefetchWrite = 1, PrefetchNoFault = 2 };
inline constexpr uint32_t kAdviseFlush = 1u << 0;  // IBV_ADVISE_MR_FLAG_FLUSH: synchronous

// Prefetches the SGEs' ranges of this process's on-demand regions in the
// PD `pd_handle`, as mlx5 does: 0; EOPNOTSUPP for an unknown advice; EINVAL
// for unknown flags or no SGE. Synchronously (kAdviseFlush): ENOENT for a
// key that names no on-demand region of the PD (or one without write
// access, for PrefetchWrite), EFAULT for a range outside its region or not
// mapped. Otherwise best effort: EINVAL for a bad key, range faults ignored.
int advise_prefetch(DeviceMemory& memory, uint32_t pd_handle, uint32_t advice, uint32_t flags,
                    std::span<const Sge> sges);

}  // namespace softverbs
