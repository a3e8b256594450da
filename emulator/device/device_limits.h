// Every limit the emulated device advertises, in one place (as rxe_param.h is
// for the kernel's rxe). The provider reports these through ibv_query_device
// and ibv_query_port; the data path enforces the same numbers.
#pragma once

#include <cstdint>

namespace softverbs::limits {

inline constexpr uint32_t kVendorId = 0xffffff;    // no IEEE OUI: an emulated device
inline constexpr uint32_t kVendorPartId = 0x5356;  // "SV"
inline constexpr uint32_t kHardwareVersion = 1;
inline constexpr const char* kFirmwareVersion = "0.1.0";
inline constexpr const char* kBoardId = "softverbs";

inline constexpr uint64_t kMaxMrSize = uint64_t{1} << 40;
inline constexpr uint64_t kPageSizeCap = 0xfffff000;  // 4 KiB and up
inline constexpr int kMaxQp = 16384;
inline constexpr int kMaxQpWr = 16384;
inline constexpr int kMaxSge = 32;
inline constexpr int kMaxSgeRd = 32;
inline constexpr int kMaxCq = 16384;
// As mlx5: libfabric's ofi_rxm sizes its CQ as universe size (256) times
// queue depth. A ring's pages are committed only as completions reach them.
inline constexpr int kMaxCqe = (1 << 22) - 1;
inline constexpr int kMaxMr = 65536;
inline constexpr int kMaxPd = 16384;
inline constexpr int kMaxQpRdAtomic = 128;
inline constexpr int kMaxQpInitRdAtomic = 128;
inline constexpr int kMaxResRdAtomic = kMaxQp * kMaxQpRdAtomic;
inline constexpr int kMaxAh = 65536;
inline constexpr int kMaxMw = 65536;
inline constexpr int kMaxSrq = 4096;
inline constexpr int kMaxSrqWr = 16384;
inline constexpr int kMaxSrqSge = 32;
inline constexpr int kMaxMcastGroups = 8192;
inline constexpr int kMaxMcastQpAttach = 56;
inline constexpr int kMaxInlineData = 256;
inline constexpr uint16_t kMaxPkeys = 1;
inline constexpr uint8_t kLocalCaAckDelay = 15;
inline constexpr uint8_t kPhysPortCount = 1;

// One port, RoCE: no LIDs, a GID table instead.
inline constexpr int kGidTableLength = 32;
inline constexpr uint16_t kPkeyTableLength = 1;
inline constexpr uint16_t kDefaultPkey = 0xffff;
inline constexpr uint32_t kMaxMessageSize = uint32_t{1} << 30;  // 1 GiB
inline constexpr uint8_t kMaxVlNum = 1;

// ABI version the provider accepts in <uverbs>/abi_version, and the value the
// sysfs tree writes there.
inline constexpr uint32_t kUverbsAbiVersion = 1;
// Index of the first uverbs character device we name; real devices usually
// take the low numbers.
inline constexpr int kFirstUverbsIndex = 64;
inline constexpr int kMaxDevices = 64;

}  // namespace softverbs::limits
