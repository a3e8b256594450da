// Endpoints and address info: rdma_create_ep (an id, its address, route
// and QP in one call) and rdma_getaddrinfo over the host's resolver.
#include <netdb.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cm_internal.h"

namespace softverbs::cm {

int create_ep(rdma_cm_id** out, rdma_addrinfo* info, ibv_pd* pd, ibv_qp_init_attr* attr) {
  if (out == nullptr || info == nullptr) return fail(EINVAL);
  rdma_cm_id* public_id = nullptr;
  ibv_qp_type type = info->ai_qp_type ? static_cast<ibv_qp_type>(info->ai_qp_type) : IBV_QPT_RC;
  if (create_id(nullptr, &public_id, nullptr, static_cast<rdma_port_space>(info->ai_port_space), type) != 0) return -1;
  CmId* id = priv(public_id);
  int result = 0;
  if (attr) attr->qp_type = type;  // as librdmacm: the address info decides the QP type
  if (info->ai_flags & RAI_PASSIVE) {
    result = bind_addr(public_id, info->ai_src_addr);
    if (result == 0 && attr) {
      // Each id that rdma_get_request hands out gets a QP like this.
      id->endpoint_qp_attr = *attr;
      id->endpoint_pd = pd;
    }
  } else {
    result = resolve_addr(public_id, info->ai_src_addr, info->ai_dst_addr, 2000);
    if (result == 0) result = resolve_route(public_id, 2000);
    if (result == 0 && attr) result = create_qp(public_id, pd, attr);
  }
  if (result != 0) {
    int error = errno;
    destroy_id(public_id);
    return fail(error);
  }
  *out = public_id;
  return 0;
}

void destroy_ep(rdma_cm_id* id) {
  if (id == nullptr) return;
  destroy_qp(id);
  destroy_srq(id);
  destroy_id(id);
}

namespace {

// A sockaddr_storage-sized copy of `from` (nullptr for nullptr), for
// freeaddrinfo to free.
sockaddr* copy_sockaddr(const sockaddr* from, socklen_t length) {
  if (from == nullptr) return nullptr;
  auto* to = static_cast<sockaddr*>(std::calloc(1, sizeof(sockaddr_storage)));
  if (to) std::memcpy(to, from, std::min<size_t>(length ? length : sockaddr_length(from), sizeof(sockaddr_storage)));
  return to;
}

// With neither node nor service, the answer comes from the hints' addresses
// alone, as librdmacm allows.
int addrinfo_from_hints(const rdma_addrinfo* hints, rdma_addrinfo** result) {
  if (hints->ai_src_addr == nullptr && hints->ai_dst_addr == nullptr) return fail(EINVAL);
  auto* info = static_cast<rdma_addrinfo*>(std::calloc(1, sizeof(rdma_addrinfo)));
  if (info == nullptr) return fail(ENOMEM);
  *info = *hints;
  info->ai_next = nullptr;
  info->ai_src_canonname = info->ai_dst_canonname = nullptr;
  info->ai_route = info->ai_connect = nullptr;
  info->ai_route_len = info->ai_connect_len = 0;
  info->ai_qp_type = hints->ai_qp_type ? hints->ai_qp_type : IBV_QPT_RC;
  info->ai_port_space = hints->ai_port_space ? hints->ai_port_space : RDMA_PS_TCP;
  info->ai_src_addr = copy_sockaddr(hints->ai_src_addr, hints->ai_src_len);
  info->ai_dst_addr = copy_sockaddr(hints->ai_dst_addr, hints->ai_dst_len);
  const sockaddr* any = info->ai_src_addr ? info->ai_src_addr : info->ai_dst_addr;
  info->ai_family = any ? any->sa_family : AF_INET;
  *result = info;
  return 0;
}

// Prefer IPv4, as the loopback-only examples expect.
const addrinfo* preferred(const addrinfo* found) {
  for (const addrinfo* a = found; a; a = a->ai_next)
    if (a->ai_family == AF_INET) return a;
  return found;
}

// The one rdma_addrinfo for the address `pick` resolved to (nullptr where
// memory runs out).
rdma_addrinfo* addrinfo_for(const addrinfo* pick, int flags, const rdma_addrinfo* hints) {
  auto* info = static_cast<rdma_addrinfo*>(std::calloc(1, sizeof(rdma_addrinfo)));
  auto* address = static_cast<sockaddr*>(std::calloc(1, sizeof(sockaddr_storage)));
  if (info == nullptr || address == nullptr) {
    std::free(info);
    std::free(address);
    return nullptr;
  }
  std::memcpy(address, pick->ai_addr, pick->ai_addrlen);
  info->ai_flags = flags;
  info->ai_family = pick->ai_family;
  // What the hints leave open follows from the socket type and protocol
  // getaddrinfo found, as in librdmacm: datagrams are UD on RDMA_PS_UDP.
  info->ai_qp_type = hints && hints->ai_qp_type        ? hints->ai_qp_type
                     : pick->ai_socktype == SOCK_DGRAM ? IBV_QPT_UD
                                                       : IBV_QPT_RC;
  info->ai_port_space = hints && hints->ai_port_space      ? hints->ai_port_space
                        : pick->ai_protocol == IPPROTO_UDP ? RDMA_PS_UDP
                                                           : RDMA_PS_TCP;
  if (flags & RAI_PASSIVE) {
    info->ai_src_addr = address;
    info->ai_src_len = pick->ai_addrlen;
    return info;
  }
  info->ai_dst_addr = address;
  info->ai_dst_len = pick->ai_addrlen;
  if (hints && hints->ai_src_addr) {
    auto* source = static_cast<sockaddr*>(std::calloc(1, sizeof(sockaddr_storage)));
    if (source) {
      std::memcpy(source, hints->ai_src_addr, hints->ai_src_len);
      info->ai_src_addr = source;
      info->ai_src_len = hints->ai_src_len;
    }
  }
  return info;
}

}  // namespace

int getaddrinfo(const char* node, const char* service, const rdma_addrinfo* hints, rdma_addrinfo** result) {
  if (result == nullptr || (node == nullptr && service == nullptr && hints == nullptr)) return fail(EINVAL);
  if (node == nullptr && service == nullptr) return addrinfo_from_hints(hints, result);
  int flags = hints ? hints->ai_flags : 0;
  addrinfo ask{};
  ask.ai_family = hints && hints->ai_family ? hints->ai_family : AF_UNSPEC;
  // The socket type and protocol that the QP type and port space stand
  // for, as librdmacm asks; with neither, a stream (getaddrinfo's first).
  const uint32_t qp_type = hints ? hints->ai_qp_type : 0;
  const int port_space = hints ? hints->ai_port_space : 0;
  ask.ai_socktype = qp_type == IBV_QPT_UD ? SOCK_DGRAM : qp_type != 0 ? SOCK_STREAM : 0;
  if (port_space == RDMA_PS_TCP || (port_space == RDMA_PS_IB && ask.ai_socktype == SOCK_STREAM))
    ask.ai_protocol = IPPROTO_TCP;
  else if (port_space == RDMA_PS_UDP || port_space == RDMA_PS_IPOIB ||
           (port_space == RDMA_PS_IB && ask.ai_socktype == SOCK_DGRAM))
    ask.ai_protocol = IPPROTO_UDP;
  if (ask.ai_socktype == 0 && ask.ai_protocol == 0) ask.ai_socktype = SOCK_STREAM;
  if (flags & RAI_PASSIVE) ask.ai_flags |= AI_PASSIVE;
  if (flags & RAI_NUMERICHOST) ask.ai_flags |= AI_NUMERICHOST;
  addrinfo* found = nullptr;
  // getaddrinfo's own code, as librdmacm returns it: the tools print it
  // with gai_strerror ("Name or service not known", not -1's "Bad value for
  // ai_flags").
  if (int error = ::getaddrinfo(node, service, &ask, &found); error != 0) return error;
  rdma_addrinfo* info = addrinfo_for(preferred(found), flags, hints);
  ::freeaddrinfo(found);
  if (info == nullptr) return fail(ENOMEM);
  *result = info;
  return 0;
}

void freeaddrinfo(rdma_addrinfo* info) {
  while (info) {
    rdma_addrinfo* next = info->ai_next;
    std::free(info->ai_src_addr);
    std::free(info->ai_dst_addr);
    std::free(info->ai_src_canonname);
    std::free(info->ai_dst_canonname);
    std::free(info->ai_route);
    std::free(info->ai_connect);
    std::free(info);
    info = next;
  }
}

}  // namespace softverbs::cm
