// What the emulator needs to know of the network device a softverbs port sits
// on: its addresses (the GID table is built from them), MAC and MTU.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace softverbs {

struct NetdevInfo {
  std::string name;
  unsigned ifindex = 0;
  std::array<uint8_t, 6> mac{};
  uint32_t mtu = 0;
  bool is_up = false;
  bool is_loopback = false;
  std::vector<std::array<uint8_t, 4>> ipv4_addresses;
  std::vector<std::array<uint8_t, 16>> ipv6_addresses;
};

// Reads the live state of netdev `name`; nullopt (errno set) if it does not exist.
std::optional<NetdevInfo> query_netdev(const std::string& name);

// Names of every netdev in this network namespace, for error messages.
std::vector<std::string> list_netdevs();

}  // namespace softverbs
