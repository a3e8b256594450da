// UD multicast groups: which QPs are attached to which multicast GID. Fixed
// capacity and no pointers, so the table lives in device memory; callers
// hold the device's memory lock.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "device/device_limits.h"

namespace softverbs {

// The QPN a UD send uses to address a multicast group (IB spec 10.5.2.3).
inline constexpr uint32_t kMulticastQpn = 0xffffff;

class MulticastTable {
 public:
  using Gid = std::array<uint8_t, 16>;

  // 0; EINVAL for a GID that is not multicast (Gid::is_multicast); ENOMEM when
  // the group or the table is full. Attaching twice is not an error.
  int attach(const Gid& gid, uint32_t qpn);
  // 0, or EINVAL if `qpn` is not attached to `gid`.
  int detach(const Gid& gid, uint32_t qpn);
  void detach_everywhere(uint32_t qpn);
  std::vector<uint32_t> members(const Gid& gid) const;

 private:
  struct Group {
    Gid gid{};
    uint32_t count = 0;
    uint32_t qpns[limits::kMaxMcastQpAttach] = {};
  };
  Group* find(const Gid& gid);
  const Group* find(const Gid& gid) const;

  Group groups_[limits::kMaxMcastGroups];
};

}  // namespace softverbs
