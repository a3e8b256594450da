// A 128-bit GID and the ways RoCE derives one from a netdev's addresses.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace softverbs {

enum class GidType : uint8_t { RoceV1, RoceV2 };

struct Gid {
  std::array<uint8_t, 16> raw{};

  bool is_zero() const;
  // A multicast group: ff00::/8, or an IPv4-mapped 224.0.0.0/4 address, the
  // form RoCE v2 gives an IPv4 group (the kernel's rdma_cm joins ::ffff:G).
  bool is_multicast() const;
  bool operator==(const Gid&) const = default;

  // IPv4-mapped IPv6 address ::ffff:a.b.c.d, as RoCE uses for IPv4 GIDs.
  static Gid from_ipv4(std::span<const uint8_t, 4> address);
  static Gid from_ipv6(std::span<const uint8_t, 16> address);
  // fe80::/64 with a modified EUI-64 interface id built from the MAC, as the
  // kernel's default GID for a RoCE port.
  static Gid link_local_from_mac(std::span<const uint8_t, 6> mac);

  // "fe80:0000:0000:0000:0200:00ff:fe00:0000": the sysfs form (8 groups).
  std::string to_sysfs_string() const;
  // Parses the sysfs form; nullopt on anything else.
  static std::optional<Gid> from_sysfs_string(std::string_view text);
};

const char* gid_type_sysfs_name(GidType type);

}  // namespace softverbs
