#include "udp/socket_util.h"

#include <netinet/udp.h>
#include <sys/un.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <vector>

#include "support/process_id.h"
#include "udp/parameters.h"

namespace softverbs::udp {

namespace {

void set_buffer(int fd, int option, int force_option, int bytes) {
  // Root may exceed net.core.[rw]mem_max; others get what the limit allows.
  if (setsockopt(fd, SOL_SOCKET, force_option, &bytes, sizeof bytes) != 0)
    setsockopt(fd, SOL_SOCKET, option, &bytes, sizeof bytes);
}

sockaddr_un abstract_address(const std::string& name, socklen_t& length) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  size_t size = std::min(name.size(), sizeof address.sun_path - 1);
  std::memcpy(address.sun_path + 1, name.data(), size);  // sun_path[0] = 0: abstract
  length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + size);
  return address;
}

std::string hex(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}

std::string address_claim_prefix(const wire::IpAddress& address) {
  return "softverbs-roce-addr/" + wire::format_address(address) + "/";
}

// Abstract socket names in this network namespace that start with `prefix`.
std::vector<std::string> abstract_names_with_prefix(const std::string& prefix) {
  std::vector<std::string> names;
  std::ifstream table("/proc/net/unix");
  std::string line;
  std::getline(table, line);  // header
  while (std::getline(table, line)) {
    size_t at = line.find(" @");
    if (at == std::string::npos) continue;
    std::string name = line.substr(at + 2);
    if (name.compare(0, prefix.size(), prefix) == 0) names.push_back(name);
  }
  return names;
}

}  // namespace

int bind_udp(const wire::IpAddress& address, uint16_t port, uint32_t scope_id) {
  const bool v4 = wire::is_ipv4_mapped(address);
  int fd = ::socket(v4 ? AF_INET : AF_INET6, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
  // An IPv6 address still in duplicate address detection cannot be bound
  // otherwise; the device's addresses are ours to use.
  setsockopt(fd, SOL_IP, IP_FREEBIND, &one, sizeof one);
  if (v4) {
    int pmtu = IP_PMTUDISC_DO;  // DF set, identification 0 (see roce_packet.h)
    setsockopt(fd, IPPROTO_IP, IP_MTU_DISCOVER, &pmtu, sizeof pmtu);
  } else {
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    // rxe sends RoCE v2 over IPv6 with a UDP checksum of zero (the ICRC
    // covers the packet); the kernel drops those unless allowed.
    setsockopt(fd, SOL_UDP, UDP_NO_CHECK6_RX, &one, sizeof one);
    int pmtu = IPV6_PMTUDISC_DO;
    setsockopt(fd, IPPROTO_IPV6, IPV6_MTU_DISCOVER, &pmtu, sizeof pmtu);
  }
  // Multicast leaves with the hop limit unicast has (64, the kernel's
  // default and what rdma_cm puts in a RoCE v2 group's address handle),
  // not the socket default of 1.
  int hops = 64;
  if (v4)
    setsockopt(fd, IPPROTO_IP, IP_MULTICAST_TTL, &hops, sizeof hops);
  else
    setsockopt(fd, IPPROTO_IPV6, IPV6_MULTICAST_HOPS, &hops, sizeof hops);
  set_buffer(fd, SO_RCVBUF, SO_RCVBUFFORCE, parameters::kSocketBuffer);
  set_buffer(fd, SO_SNDBUF, SO_SNDBUFFORCE, parameters::kSocketBuffer);
  // Datagrams of one flow may arrive together (see PortEngine::drain).
  setsockopt(fd, SOL_UDP, UDP_GRO, &one, sizeof one);
  SocketAddressStorage where = to_sockaddr(address, port, is_link_local(address) ? scope_id : 0);
  if (::bind(fd, where.get(), where.length) != 0) {
    int saved = errno;
    ::close(fd);
    errno = saved;
    return -1;
  }
  return fd;
}

std::string claim_of_another_device(const wire::IpAddress& address, uint64_t instance) {
  const std::string prefix = address_claim_prefix(address);
  for (const std::string& name : abstract_names_with_prefix(prefix)) {
    if (name.compare(prefix.size(), 16, hex(instance)) == 0) continue;
    return name;
  }
  return "";
}

Fd claim_address(const wire::IpAddress& address, uint64_t instance) {
  socklen_t length;
  sockaddr_un claim =
      abstract_address(address_claim_prefix(address) + hex(instance) + "/" + std::to_string(current_pid()), length);
  Fd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (fd.get() >= 0 && ::bind(fd.get(), reinterpret_cast<sockaddr*>(&claim), length) == 0) return fd;
  return Fd();
}

}  // namespace softverbs::udp
