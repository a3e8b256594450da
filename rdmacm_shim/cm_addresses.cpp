// Addresses and routes: sockaddrs as GIDs and as the CM's wire form, which
// device carries an address, and which local address a destination is
// routed from.
#include <arpa/inet.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>

#include "cm_internal.h"
#include "listener_directory.h"
#include "support/file_util.h"

namespace softverbs::cm {

socklen_t sockaddr_length(const sockaddr* address) {
  return address->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

void copy_address(sockaddr_storage& out, const sockaddr* in) {
  out = {};
  std::memcpy(&out, in, sockaddr_length(in));
}

WireAddress to_wire(const sockaddr_storage& address) {
  WireAddress wire;
  wire.family = address.ss_family;
  if (address.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(address);
    wire.port = in.sin_port;
    std::memcpy(wire.address, &in.sin_addr, 4);
  } else {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(address);
    wire.port = in6.sin6_port;
    std::memcpy(wire.address, &in6.sin6_addr, 16);
  }
  return wire;
}

sockaddr_storage from_wire(const WireAddress& wire) {
  sockaddr_storage address{};
  address.ss_family = wire.family == AF_INET6 ? AF_INET6 : AF_INET;
  if (address.ss_family == AF_INET) {
    auto& in = reinterpret_cast<sockaddr_in&>(address);
    in.sin_port = wire.port;
    std::memcpy(&in.sin_addr, wire.address, 4);
  } else {
    auto& in6 = reinterpret_cast<sockaddr_in6&>(address);
    in6.sin6_port = wire.port;
    std::memcpy(&in6.sin6_addr, wire.address, 16);
  }
  return address;
}

WireAddress wire_address(const std::array<uint8_t, 16>& gid, uint8_t ip_version, uint16_t port) {
  WireAddress out;
  out.family = ip_version == 6 ? AF_INET6 : AF_INET;
  out.port = htons(port);
  if (ip_version == 6)
    std::memcpy(out.address, gid.data(), 16);
  else
    std::memcpy(out.address, gid.data() + 12, 4);
  return out;
}

ibv_gid gid_of(const sockaddr_storage& address) {
  ibv_gid gid{};
  if (address.ss_family == AF_INET) {
    gid.raw[10] = gid.raw[11] = 0xff;
    std::memcpy(gid.raw + 12, &reinterpret_cast<const sockaddr_in&>(address).sin_addr, 4);
  } else {
    std::memcpy(gid.raw, &reinterpret_cast<const sockaddr_in6&>(address).sin6_addr, 16);
  }
  return gid;
}

std::array<uint8_t, 16> gid_bytes(const sockaddr_storage& address) {
  std::array<uint8_t, 16> out;
  const ibv_gid gid = gid_of(address);
  std::memcpy(out.data(), gid.raw, 16);
  return out;
}

CmListenOn listen_on(const sockaddr_storage& local, std::optional<bool> afonly) {
  CmListenOn on;
  if (local.ss_family == AF_INET) {
    on.ip_version = 4;
  } else {
    static const bool bindv6only = read_first_line("/proc/sys/net/ipv6/bindv6only").value_or("0") == "1";
    on.ip_version = afonly.value_or(bindv6only) || !is_wildcard(local) ? 6 : 0;
  }
  if (!is_wildcard(local)) on.address = gid_bytes(local);
  return on;
}

// ---- devices -----------------------------------------------------------------

namespace {

bool has_gid(ibv_context* context, const ibv_gid& wanted) {
  Gid16 gid;
  std::memcpy(gid.data(), wanted.raw, 16);
  return find_roce_v2_gid(context, gid).has_value();
}

}  // namespace

// The device whose GID table holds `local` (as RoCE resolves an address to
// the netdev that has it), else a device on the loopback netdev, which
// stands for every address of this host (a device on another netdev
// carries only that netdev's addresses, as an HCA's port does).
ibv_context* Devices::context_for(const sockaddr_storage& local) {
  open_all();
  for (ibv_context* context : contexts_)
    if (has_gid(context, gid_of(local))) return context;
  sockaddr_in loopback{};
  loopback.sin_family = AF_INET;
  loopback.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sockaddr_storage any_loopback{};
  std::memcpy(&any_loopback, &loopback, sizeof loopback);
  for (ibv_context* context : contexts_)
    if (has_gid(context, gid_of(any_loopback))) return context;
  return nullptr;
}

ibv_pd* Devices::pd_for(ibv_context* context) {
  auto it = pds_.find(context);
  if (it != pds_.end()) return it->second;
  ibv_pd* pd = ibv_alloc_pd(context);
  pds_[context] = pd;
  return pd;
}

ibv_xrcd* Devices::xrcd_for(ibv_context* context) {
  auto it = xrcds_.find(context);
  if (it != xrcds_.end()) return it->second;
  ibv_xrcd_init_attr attr{};
  attr.comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS;
  attr.fd = -1;  // a domain of this process's own
  attr.oflags = O_CREAT;
  ibv_xrcd* xrcd = ibv_open_xrcd(context, &attr);
  if (xrcd) xrcds_[context] = xrcd;
  return xrcd;
}

const std::vector<ibv_context*>& Devices::all() {
  open_all();
  return contexts_;
}

void Devices::open_all() {
  if (opened_) return;
  opened_ = true;
  int count = 0;
  ibv_device** list = ibv_get_device_list(&count);
  for (int i = 0; list && i < count; ++i)
    if (ibv_context* context = ibv_open_device(list[i])) contexts_.push_back(context);
  if (list) ibv_free_device_list(list);
}

bool attach_device(CmId* id, Devices& devices, const sockaddr_storage& local) {
  ibv_context* context = devices.context_for(local);
  if (context == nullptr) return false;
  id->id.verbs = context;
  id->id.pd = devices.pd_for(context);
  id->id.port_num = 1;
  return true;
}

// ---- routes ------------------------------------------------------------------

bool is_local_address(const sockaddr_storage& address) {
  int fd = socket(address.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_storage probe = address;
  if (probe.ss_family == AF_INET)
    reinterpret_cast<sockaddr_in&>(probe).sin_port = 0;
  else
    reinterpret_cast<sockaddr_in6&>(probe).sin6_port = 0;
  bool local = bind(fd, reinterpret_cast<sockaddr*>(&probe), sockaddr_length(reinterpret_cast<sockaddr*>(&probe))) == 0;
  close(fd);
  return local;
}

int route_source(const sockaddr_storage& destination, sockaddr_storage& source) {
  int fd = socket(destination.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno;
  sockaddr_storage target = destination;
  if (port_of(target) == 0) {
    if (target.ss_family == AF_INET)
      reinterpret_cast<sockaddr_in&>(target).sin_port = htons(9);
    else
      reinterpret_cast<sockaddr_in6&>(target).sin6_port = htons(9);
  }
  int error = 0;
  socklen_t length = sizeof source;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&target), sockaddr_length(reinterpret_cast<sockaddr*>(&target))) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&source), &length) != 0)
    error = errno;
  close(fd);
  return error;
}

// The bound address's GID where the device has it, else the address the
// kernel routes from, else the device's first (an application may bind an
// address of the host that the device does not carry, such as 127.0.0.1
// when the device is on a veth).
std::array<uint8_t, 16> source_gid(CmAgent* agent, const sockaddr_storage& bound, const sockaddr_storage& destination) {
  const auto gid = gid_bytes(bound);
  if (agent->has_gid(gid)) return gid;
  sockaddr_storage routed{};
  if (route_source(destination, routed) == 0 && agent->has_gid(gid_bytes(routed))) return gid_bytes(routed);
  return agent->first_gid().value_or(gid);
}

}  // namespace softverbs::cm
