// The exported librdmacm API (symbol versions in librdmacm.map): each call
// goes to the real librdmacm when delegating, else to the emulation.
#include <rdma/rdma_cma.h>

#include <cerrno>

#include "cm_engine.h"
#include "real_librdmacm.h"

namespace cm = softverbs::cm;

#define SV_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// RDMA_PS_* to the QP type an id starts with, as librdmacm maps them.
bool qp_type_for(rdma_port_space ps, ibv_qp_type& type) {
  switch (ps) {
    case RDMA_PS_TCP:
    case RDMA_PS_IB:
      type = IBV_QPT_RC;
      return true;
    case RDMA_PS_UDP:
    case RDMA_PS_IPOIB:
      type = IBV_QPT_UD;
      return true;
  }
  return false;
}

}  // namespace

SV_EXPORT rdma_event_channel* rdma_create_event_channel(void) {
  SOFTVERBS_FORWARD(rdma_create_event_channel, "RDMACM_1.0");
  return cm::create_event_channel();
}

SV_EXPORT void rdma_destroy_event_channel(rdma_event_channel* channel) {
  SOFTVERBS_FORWARD(rdma_destroy_event_channel, "RDMACM_1.0", channel);
  cm::destroy_event_channel(channel);
}

SV_EXPORT int rdma_create_id(rdma_event_channel* channel, rdma_cm_id** id, void* context, rdma_port_space ps) {
  SOFTVERBS_FORWARD(rdma_create_id, "RDMACM_1.0", channel, id, context, ps);
  ibv_qp_type type;
  if (!qp_type_for(ps, type)) {
    errno = EINVAL;
    return -1;
  }
  return cm::create_id(channel, id, context, ps, type);
}

SV_EXPORT int rdma_create_ep(rdma_cm_id** id, rdma_addrinfo* res, ibv_pd* pd, ibv_qp_init_attr* qp_init_attr) {
  SOFTVERBS_FORWARD(rdma_create_ep, "RDMACM_1.0", id, res, pd, qp_init_attr);
  return cm::create_ep(id, res, pd, qp_init_attr);
}

SV_EXPORT void rdma_destroy_ep(rdma_cm_id* id) {
  SOFTVERBS_FORWARD(rdma_destroy_ep, "RDMACM_1.0", id);
  cm::destroy_ep(id);
}

SV_EXPORT int rdma_destroy_id(rdma_cm_id* id) {
  SOFTVERBS_FORWARD(rdma_destroy_id, "RDMACM_1.0", id);
  return cm::destroy_id(id);
}

SV_EXPORT int rdma_bind_addr(rdma_cm_id* id, sockaddr* addr) {
  SOFTVERBS_FORWARD(rdma_bind_addr, "RDMACM_1.0", id, addr);
  return cm::bind_addr(id, addr);
}

SV_EXPORT int rdma_resolve_addr(rdma_cm_id* id, sockaddr* src_addr, sockaddr* dst_addr, int timeout_ms) {
  SOFTVERBS_FORWARD(rdma_resolve_addr, "RDMACM_1.0", id, src_addr, dst_addr, timeout_ms);
  return cm::resolve_addr(id, src_addr, dst_addr, timeout_ms);
}

SV_EXPORT int rdma_resolve_route(rdma_cm_id* id, int timeout_ms) {
  SOFTVERBS_FORWARD(rdma_resolve_route, "RDMACM_1.0", id, timeout_ms);
  return cm::resolve_route(id, timeout_ms);
}

SV_EXPORT int rdma_create_qp(rdma_cm_id* id, ibv_pd* pd, ibv_qp_init_attr* qp_init_attr) {
  SOFTVERBS_FORWARD(rdma_create_qp, "RDMACM_1.0", id, pd, qp_init_attr);
  return cm::create_qp(id, pd, qp_init_attr);
}

SV_EXPORT int rdma_create_qp_ex(rdma_cm_id* id, ibv_qp_init_attr_ex* qp_init_attr) {
  SOFTVERBS_FORWARD(rdma_create_qp_ex, "RDMACM_1.0", id, qp_init_attr);
  return cm::create_qp_ex(id, qp_init_attr);
}

SV_EXPORT void rdma_destroy_qp(rdma_cm_id* id) {
  SOFTVERBS_FORWARD(rdma_destroy_qp, "RDMACM_1.0", id);
  cm::destroy_qp(id);
}

SV_EXPORT int rdma_create_srq(rdma_cm_id* id, ibv_pd* pd, ibv_srq_init_attr* attr) {
  SOFTVERBS_FORWARD(rdma_create_srq, "RDMACM_1.0", id, pd, attr);
  return cm::create_srq(id, pd, attr);
}

SV_EXPORT int rdma_create_srq_ex(rdma_cm_id* id, ibv_srq_init_attr_ex* attr) {
  SOFTVERBS_FORWARD(rdma_create_srq_ex, "RDMACM_1.0", id, attr);
  return cm::create_srq_ex(id, attr);
}

SV_EXPORT void rdma_destroy_srq(rdma_cm_id* id) {
  SOFTVERBS_FORWARD(rdma_destroy_srq, "RDMACM_1.0", id);
  cm::destroy_srq(id);
}

SV_EXPORT int rdma_connect(rdma_cm_id* id, rdma_conn_param* conn_param) {
  SOFTVERBS_FORWARD(rdma_connect, "RDMACM_1.0", id, conn_param);
  return cm::connect(id, conn_param);
}

SV_EXPORT int rdma_establish(rdma_cm_id* id) {
  SOFTVERBS_FORWARD(rdma_establish, "RDMACM_1.2", id);
  return cm::establish(id);
}

SV_EXPORT int rdma_listen(rdma_cm_id* id, int backlog) {
  SOFTVERBS_FORWARD(rdma_listen, "RDMACM_1.0", id, backlog);
  return cm::listen(id, backlog);
}

SV_EXPORT int rdma_get_request(rdma_cm_id* listen, rdma_cm_id** id) {
  SOFTVERBS_FORWARD(rdma_get_request, "RDMACM_1.0", listen, id);
  return cm::get_request(listen, id);
}

SV_EXPORT int rdma_accept(rdma_cm_id* id, rdma_conn_param* conn_param) {
  SOFTVERBS_FORWARD(rdma_accept, "RDMACM_1.0", id, conn_param);
  return cm::accept(id, conn_param);
}

SV_EXPORT int rdma_reject(rdma_cm_id* id, const void* private_data, uint8_t private_data_len) {
  SOFTVERBS_FORWARD(rdma_reject, "RDMACM_1.0", id, private_data, private_data_len);
  return cm::reject(id, private_data, private_data_len, cm::kRejectConsumer);
}

SV_EXPORT int rdma_reject_ece(rdma_cm_id* id, const void* private_data, uint8_t private_data_len) {
  SOFTVERBS_FORWARD(rdma_reject_ece, "RDMACM_1.3", id, private_data, private_data_len);
  constexpr uint16_t kRejectVendorOptionNotSupported = 35;
  return cm::reject(id, private_data, private_data_len, kRejectVendorOptionNotSupported);
}

SV_EXPORT int rdma_notify(rdma_cm_id* id, ibv_event_type event) {
  SOFTVERBS_FORWARD(rdma_notify, "RDMACM_1.0", id, event);
  return id == nullptr ? (errno = EINVAL, -1) : 0;
}

SV_EXPORT int rdma_disconnect(rdma_cm_id* id) {
  SOFTVERBS_FORWARD(rdma_disconnect, "RDMACM_1.0", id);
  return cm::disconnect(id);
}

SV_EXPORT int rdma_join_multicast(rdma_cm_id* id, sockaddr* addr, void* context) {
  SOFTVERBS_FORWARD(rdma_join_multicast, "RDMACM_1.0", id, addr, context);
  return cm::join_multicast(id, addr, context, false);
}

SV_EXPORT int rdma_leave_multicast(rdma_cm_id* id, sockaddr* addr) {
  SOFTVERBS_FORWARD(rdma_leave_multicast, "RDMACM_1.0", id, addr);
  return cm::leave_multicast(id, addr);
}

SV_EXPORT int rdma_join_multicast_ex(rdma_cm_id* id, rdma_cm_join_mc_attr_ex* attr, void* context) {
  SOFTVERBS_FORWARD(rdma_join_multicast_ex, "RDMACM_1.1", id, attr, context);
  if (attr == nullptr || !(attr->comp_mask & RDMA_CM_JOIN_MC_ATTR_ADDRESS) ||
      (attr->comp_mask & ~(RDMA_CM_JOIN_MC_ATTR_ADDRESS | RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS))) {
    errno = EINVAL;
    return -1;
  }
  uint32_t flags = (attr->comp_mask & RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS)
                       ? attr->join_flags
                       : static_cast<uint32_t>(RDMA_MC_JOIN_FLAG_FULLMEMBER);
  if (flags != RDMA_MC_JOIN_FLAG_FULLMEMBER && flags != RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER) {
    errno = EINVAL;
    return -1;
  }
  return cm::join_multicast(id, attr->addr, context, flags == RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER);
}

SV_EXPORT int rdma_get_cm_event(rdma_event_channel* channel, rdma_cm_event** event) {
  SOFTVERBS_FORWARD(rdma_get_cm_event, "RDMACM_1.0", channel, event);
  return cm::get_cm_event(channel, event);
}

SV_EXPORT int rdma_ack_cm_event(rdma_cm_event* event) {
  SOFTVERBS_FORWARD(rdma_ack_cm_event, "RDMACM_1.0", event);
  return cm::ack_cm_event(event);
}

SV_EXPORT __be16 rdma_get_src_port(rdma_cm_id* id) {
  SOFTVERBS_FORWARD(rdma_get_src_port, "RDMACM_1.0", id);
  const sockaddr* address = &id->route.addr.src_addr;
  return address->sa_family == AF_INET6 ? id->route.addr.src_sin6.sin6_port : id->route.addr.src_sin.sin_port;
}

SV_EXPORT __be16 rdma_get_dst_port(rdma_cm_id* id) {
  SOFTVERBS_FORWARD(rdma_get_dst_port, "RDMACM_1.0", id);
  const sockaddr* address = &id->route.addr.dst_addr;
  return address->sa_family == AF_INET6 ? id->route.addr.dst_sin6.sin6_port : id->route.addr.dst_sin.sin_port;
}

SV_EXPORT ibv_context** rdma_get_devices(int* num_devices) {
  SOFTVERBS_FORWARD(rdma_get_devices, "RDMACM_1.0", num_devices);
  return cm::get_devices(num_devices);
}

SV_EXPORT void rdma_free_devices(ibv_context** list) {
  SOFTVERBS_FORWARD(rdma_free_devices, "RDMACM_1.0", list);
  cm::free_devices(list);
}

SV_EXPORT const char* rdma_event_str(rdma_cm_event_type event) {
  SOFTVERBS_FORWARD(rdma_event_str, "RDMACM_1.0", event);
  return cm::event_str(event);
}

SV_EXPORT int rdma_set_option(rdma_cm_id* id, int level, int optname, void* optval, size_t optlen) {
  SOFTVERBS_FORWARD(rdma_set_option, "RDMACM_1.0", id, level, optname, optval, optlen);
  return cm::set_option(id, level, optname, optval, optlen);
}

SV_EXPORT int rdma_migrate_id(rdma_cm_id* id, rdma_event_channel* channel) {
  SOFTVERBS_FORWARD(rdma_migrate_id, "RDMACM_1.0", id, channel);
  return cm::migrate_id(id, channel);
}

SV_EXPORT int rdma_getaddrinfo(const char* node, const char* service, const rdma_addrinfo* hints, rdma_addrinfo** res) {
  SOFTVERBS_FORWARD(rdma_getaddrinfo, "RDMACM_1.0", node, service, hints, res);
  return cm::getaddrinfo(node, service, hints, res);
}

SV_EXPORT void rdma_freeaddrinfo(rdma_addrinfo* res) {
  SOFTVERBS_FORWARD(rdma_freeaddrinfo, "RDMACM_1.0", res);
  cm::freeaddrinfo(res);
}

SV_EXPORT int rdma_init_qp_attr(rdma_cm_id* id, ibv_qp_attr* qp_attr, int* qp_attr_mask) {
  SOFTVERBS_FORWARD(rdma_init_qp_attr, "RDMACM_1.2", id, qp_attr, qp_attr_mask);
  return cm::init_qp_attr(id, qp_attr, qp_attr_mask);
}

SV_EXPORT int rdma_set_local_ece(rdma_cm_id* id, ibv_ece* ece) {
  SOFTVERBS_FORWARD(rdma_set_local_ece, "RDMACM_1.3", id, ece);
  return cm::set_local_ece(id, ece);
}

SV_EXPORT int rdma_get_remote_ece(rdma_cm_id* id, ibv_ece* ece) {
  SOFTVERBS_FORWARD(rdma_get_remote_ece, "RDMACM_1.3", id, ece);
  return cm::get_remote_ece(id, ece);
}
