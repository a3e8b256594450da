// Ids: the rdma_* calls that make and destroy them, give them addresses
// and a route, and set their options; and the device list.
#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "cm_internal.h"

namespace softverbs::cm {

int create_id(rdma_event_channel* channel, rdma_cm_id** out, void* context, rdma_port_space ps, ibv_qp_type qp_type) {
  if (out == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  std::lock_guard guard(engine.mutex);
  CmId* id = new_id(channel ? priv(channel) : nullptr, context, ps, qp_type);
  if (id == nullptr) return fail(ENOMEM);
  *out = &id->id;
  return 0;
}

namespace {

// As librdmacm: events the application has not taken for the id are
// dropped (those it has taken must be acked first).
void drop_untaken_events(CmId* id) {
  for (EventChannel* channel : {id->channel, id->listener ? id->listener->channel : nullptr}) {
    if (channel == nullptr || id->own_channel) continue;
    for (auto it = channel->queue.begin(); it != channel->queue.end();) {
      if ((*it)->event.id == &id->id) {
        it = channel->queue.erase(it);
        take_signal_byte(*channel);
      } else {
        ++it;
      }
    }
  }
}

}  // namespace

void end_connection(Engine& engine, CmId* id) {
  if (id->agent != nullptr && !is_ud(id) && id->state == IdState::Connected) {
    Message dreq;
    dreq.type = MessageType::Dreq;
    send_to_peer(id, dreq);
  } else if (id->agent != nullptr && !is_ud(id) &&
             (id->state == IdState::RequestReceived || id->state == IdState::ReplySent ||
              id->state == IdState::ResponseReceived)) {
    // As the kernel's IB CM: a REJ (consumer), so that the peer does not
    // wait out its retries.
    Message rej;
    rej.type = MessageType::Rej;
    rej.rej.reason = mad::reject::kConsumer;
    send_to_peer(id, rej);
  }
  if (id->awaiting_answer && id->agent != nullptr && carries_dreq(id->awaiting_answer->mad))
    engine.lingering.push_back(
        {id->agent, id->local_comm_id, id->local_gid, id->peer_gid, id->tos, *id->awaiting_answer});
  stop_resending(id);
  set_state(id, IdState::Disconnected);  // no longer the device's to announce
  engine.schedule_resends();             // for a lingering DREQ: the id has left the engine's set
}

int destroy_id(rdma_cm_id* public_id) {
  if (public_id == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  std::unique_ptr<CmId> id;
  {
    std::unique_lock guard(engine.mutex);
    CmId* raw = priv(public_id);
    if (!engine.ids.count(raw)) return fail(EINVAL);
    drop_untaken_events(raw);
    engine.events_acked.wait(guard, [raw] { return raw->events_acked >= raw->events_taken; });
    engine.ids.erase(raw);
    id.reset(raw);
    end_connection(engine, id.get());
    const uint64_t service_id = mad::service_id(port_space_of(id.get()), port_of(id->id.route.addr.src_storage));
    for (const auto& [agent, on] : id->listening) agent->remove_listener(service_id, on);
    if (id->listed) engine.directory->release(id->id.route.addr.src_storage);
    for (CmId* other : engine.ids)
      if (other->listener == id.get()) other->listener = nullptr;
  }
  if (id->own_channel) {
    close(id->own_channel->channel.fd);
    close(id->own_channel->signal_write);
  }
  return 0;
}

namespace {

void set_port(sockaddr_storage& address, uint16_t network_order_port) {
  if (address.ss_family == AF_INET)
    reinterpret_cast<sockaddr_in&>(address).sin_port = network_order_port;
  else
    reinterpret_cast<sockaddr_in6&>(address).sin6_port = network_order_port;
}

}  // namespace

int bind_addr(rdma_cm_id* public_id, const sockaddr* address) {
  if (public_id == nullptr || address == nullptr) return fail(EINVAL);
  if (address->sa_family != AF_INET && address->sa_family != AF_INET6) return fail(EAFNOSUPPORT);
  Engine& engine = Engine::instance();
  std::lock_guard guard(engine.mutex);
  CmId* id = priv(public_id);
  if (id->state != IdState::Idle) return fail(EINVAL);
  sockaddr_storage local;
  copy_address(local, address);
  if (!is_wildcard(local) && !is_local_address(local)) return fail(EADDRNOTAVAIL);
  if (port_of(local) == 0) set_port(local, htons(engine.directory->free_port()));
  id->id.route.addr.src_storage = local;
  // A wildcard bind has no device yet, as with the kernel's rdma_cm.
  if (!is_wildcard(local)) {
    if (!attach_device(id, engine.devices, local)) return fail(ENODEV);
    id->id.route.addr.addr.ibaddr.sgid = gid_of(local);
  }
  set_state(id, IdState::Bound);
  return 0;
}

int resolve_addr(rdma_cm_id* public_id, const sockaddr* source, const sockaddr* destination, int) {
  if (public_id == nullptr || destination == nullptr) return fail(EINVAL);
  if (destination->sa_family != AF_INET && destination->sa_family != AF_INET6) return fail(EAFNOSUPPORT);
  Engine& engine = Engine::instance();
  CmId* id = priv(public_id);
  std::lock_guard guard(engine.mutex);
  if (id->state != IdState::Idle && id->state != IdState::Bound) return fail(EINVAL);
  if (source != nullptr && id->state == IdState::Idle && bind_addr(public_id, source) != 0) return -1;
  sockaddr_storage remote;
  copy_address(remote, destination);
  sockaddr_storage local = id->id.route.addr.src_storage;
  int error = 0;
  if (id->state == IdState::Idle || is_wildcard(local)) {
    uint16_t port = id->state == IdState::Idle ? htons(engine.directory->free_port()) : htons(port_of(local));
    error = route_source(remote, local);
    set_port(local, port);
  }
  id->id.route.addr.dst_storage = remote;
  if (error != 0 || !attach_device(id, engine.devices, local)) {
    if (id->own_channel) return fail(error ? error : ENODEV);
    deliver(id, RDMA_CM_EVENT_ADDR_ERROR, -(error ? error : ENODEV));
    return 0;
  }
  id->id.route.addr.src_storage = local;
  id->id.route.addr.addr.ibaddr.sgid = gid_of(local);
  id->id.route.addr.addr.ibaddr.dgid = gid_of(remote);
  set_state(id, IdState::AddressResolved);
  if (!id->own_channel) deliver(id, RDMA_CM_EVENT_ADDR_RESOLVED, 0);
  return 0;
}

int resolve_route(rdma_cm_id* public_id, int) {
  if (public_id == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->state != IdState::AddressResolved) return fail(EINVAL);
  // One path record, as an IB SA or RoCE resolution reports it.
  ibv_sa_path_rec& path = id->path;
  path = {};
  path.dgid = id->id.route.addr.addr.ibaddr.dgid;
  path.sgid = id->id.route.addr.addr.ibaddr.sgid;
  path.pkey = htons(0xffff);
  path.hop_limit = kHopLimit;
  path.traffic_class = id->tos;
  path.reversible = 1;
  path.numb_path = 1;
  // RoCE's path MTU is what the port's netdev carries.
  ibv_port_attr port{};
  path.mtu = id->id.verbs && ibv_query_port(id->id.verbs, 1, &port) == 0 ? port.active_mtu : IBV_MTU_1024;
  path.mtu_selector = 2;
  path.rate_selector = 2;
  path.rate = 3;
  path.packet_life_time_selector = 2;
  path.packet_life_time = 14;
  id->id.route.path_rec = &path;
  id->id.route.num_paths = 1;
  set_state(id, IdState::RouteResolved);
  if (!id->own_channel) deliver(id, RDMA_CM_EVENT_ROUTE_RESOLVED, 0);
  return 0;
}

int set_option(rdma_cm_id* public_id, int level, int name, const void* value, size_t length) {
  if (public_id == nullptr || value == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (level == RDMA_OPTION_ID) {
    switch (name) {
      case RDMA_OPTION_ID_TOS:
        if (length != sizeof(uint8_t)) return fail(EINVAL);
        id->tos = *static_cast<const uint8_t*>(value);
        return 0;
      case RDMA_OPTION_ID_REUSEADDR:
        return length == sizeof(int) ? 0 : fail(EINVAL);
      case RDMA_OPTION_ID_AFONLY:
        if (length != sizeof(int)) return fail(EINVAL);
        id->afonly = *static_cast<const int*>(value) != 0;
        return 0;
      case RDMA_OPTION_ID_ACK_TIMEOUT:
        if (length != sizeof(uint8_t) || *static_cast<const uint8_t*>(value) > 31) return fail(EINVAL);
        id->ack_timeout = *static_cast<const uint8_t*>(value);
        return 0;
      default:
        return fail(ENOSYS);
    }
  }
  if (level == RDMA_OPTION_IB && name == RDMA_OPTION_IB_PATH) return 0;  // RoCE resolves its own path
  return fail(ENOSYS);
}

int set_local_ece(rdma_cm_id* public_id, const ibv_ece* ece) {
  if (public_id == nullptr || ece == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  priv(public_id)->local_ece = *ece;
  return 0;
}

int get_remote_ece(rdma_cm_id* public_id, ibv_ece* ece) {
  if (public_id == nullptr || ece == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  *ece = priv(public_id)->remote_ece;
  return 0;
}

ibv_context** get_devices(int* count) {
  std::lock_guard guard(Engine::instance().mutex);
  const auto& contexts = Engine::instance().devices.all();
  auto* list = static_cast<ibv_context**>(std::calloc(contexts.size() + 1, sizeof(ibv_context*)));
  if (list == nullptr) {
    errno = ENOMEM;
    return nullptr;
  }
  std::copy(contexts.begin(), contexts.end(), list);
  if (count) *count = static_cast<int>(contexts.size());
  return list;
}

void free_devices(ibv_context** list) { std::free(list); }

}  // namespace softverbs::cm
