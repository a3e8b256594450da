// The persistent description of one emulated device, as `softverbs up` decides
// it. Everything the provider reports is a function of this record, so the
// sysfs tree written at `up` and what ibv_query_port says later agree.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

namespace softverbs {

enum class TransportChoice : uint8_t { Auto, SharedMemory, Udp };

std::string_view transport_name(TransportChoice transport);
std::optional<TransportChoice> parse_transport(std::string_view text);

// Whether a device of this choice on a netdev carries UDP (binds its RoCEv2
// port): `auto` does on any netdev but loopback, where shared memory reaches
// every peer. The provider, `up` and the CM watcher decide alike.
constexpr bool carries_udp(TransportChoice choice, bool netdev_is_loopback) {
  return choice == TransportChoice::Udp || (choice == TransportChoice::Auto && !netdev_is_loopback);
}

struct DeviceConfig {
  std::string name = "softverbs0";
  std::string netdev = "lo";
  int uverbs_index = -1;
  uint64_t node_guid = 0;  // host byte order, as sysfs shows it
  uint32_t netdev_mtu = 0;
  TransportChoice transport = TransportChoice::Auto;
  std::string faults = "none";  // the UDP transport's fault injection, FaultSettings::parse form
  std::filesystem::path runtime_dir;

  std::string uverbs_name() const { return "uverbs" + std::to_string(uverbs_index); }

  // key=value lines; the format `softverbs.conf` holds in the registry and in
  // the device's sysfs directory.
  std::string serialize() const;
  // Returns the config or a message naming the first bad line.
  static std::optional<DeviceConfig> parse(std::string_view text, std::string* error);
};

// Device names follow the kernel's rules for an ib_device name (and must be a
// plain path component): 1..63 characters of [A-Za-z0-9_.-], not "." or "..".
bool is_valid_device_name(std::string_view name);

// A node GUID that is stable for (host, device name) and looks like an EUI-64
// with the locally-administered bit set, so it never collides with a vendor's.
uint64_t derive_node_guid(std::string_view host_identity, std::string_view device_name);

// "0002:c9ff:fe00:1234": the sysfs form of a GUID.
std::string format_guid(uint64_t guid);

}  // namespace softverbs
