#include "host/netdev.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

namespace softverbs {
namespace {

struct IfaddrsDeleter {
  void operator()(ifaddrs* list) const { freeifaddrs(list); }
};
using IfaddrsList = std::unique_ptr<ifaddrs, IfaddrsDeleter>;

IfaddrsList read_ifaddrs() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return nullptr;
  return IfaddrsList(list);
}

uint32_t read_mtu(const std::string& name) {
  int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  ifreq request{};
  std::strncpy(request.ifr_name, name.c_str(), IFNAMSIZ - 1);
  uint32_t mtu = 0;
  if (ioctl(fd, SIOCGIFMTU, &request) == 0) mtu = static_cast<uint32_t>(request.ifr_mtu);
  close(fd);
  return mtu;
}

}  // namespace

std::optional<NetdevInfo> query_netdev(const std::string& name) {
  if (name.empty() || name.size() >= IFNAMSIZ) {
    errno = ENODEV;
    return std::nullopt;
  }
  NetdevInfo info;
  info.name = name;
  info.ifindex = if_nametoindex(name.c_str());
  if (info.ifindex == 0) {
    errno = ENODEV;
    return std::nullopt;
  }
  info.mtu = read_mtu(name);
  IfaddrsList list = read_ifaddrs();
  for (ifaddrs* entry = list.get(); entry != nullptr; entry = entry->ifa_next) {
    if (entry->ifa_name == nullptr || name != entry->ifa_name || entry->ifa_addr == nullptr) continue;
    info.is_up = info.is_up || (entry->ifa_flags & IFF_UP) != 0;
    info.is_loopback = info.is_loopback || (entry->ifa_flags & IFF_LOOPBACK) != 0;
    switch (entry->ifa_addr->sa_family) {
      case AF_INET: {
        auto* in = reinterpret_cast<const sockaddr_in*>(entry->ifa_addr);
        std::array<uint8_t, 4> address;
        std::memcpy(address.data(), &in->sin_addr, 4);
        info.ipv4_addresses.push_back(address);
        break;
      }
      case AF_INET6: {
        auto* in6 = reinterpret_cast<const sockaddr_in6*>(entry->ifa_addr);
        std::array<uint8_t, 16> address;
        std::memcpy(address.data(), &in6->sin6_addr, 16);
        info.ipv6_addresses.push_back(address);
        break;
      }
      case AF_PACKET: {
        auto* link = reinterpret_cast<const sockaddr_ll*>(entry->ifa_addr);
        if (link->sll_halen == 6) std::memcpy(info.mac.data(), link->sll_addr, 6);
        break;
      }
      default:
        break;
    }
  }
  return info;
}

std::vector<std::string> list_netdevs() {
  std::vector<std::string> names;
  if (struct if_nameindex* index = if_nameindex()) {
    for (struct if_nameindex* entry = index; entry->if_index != 0; ++entry) names.emplace_back(entry->if_name);
    if_freenameindex(index);
  }
  return names;
}

}  // namespace softverbs
