// Multicast: rdma_join_multicast and rdma_leave_multicast on a UD id. RoCE
// needs no SA: a join attaches the QP to the group's GID and is complete.
#include <cstring>

#include "cm_internal.h"
#include "device/multicast_table.h"
#include "host/gid.h"

namespace softverbs::cm {

int join_multicast(rdma_cm_id* public_id, const sockaddr* address, void* context, bool send_only) {
  if (public_id == nullptr || address == nullptr) return fail(EINVAL);
  if (address->sa_family != AF_INET && address->sa_family != AF_INET6) return fail(EAFNOSUPPORT);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.verbs == nullptr || !is_ud(id)) return fail(EINVAL);
  CmId::Membership membership{};
  copy_address(membership.address, address);
  // RoCE v2's group GID, as the kernel's rdma_cm builds it: the IPv4-mapped
  // address (::ffff:a.b.c.d), or the IPv6 address itself.
  membership.mgid = gid_of(membership.address);
  softverbs::Gid group;
  std::memcpy(group.raw.data(), membership.mgid.raw, 16);
  if (!group.is_multicast()) return fail(EINVAL);
  for (const auto& joined : id->multicast)
    if (std::memcmp(&joined.address, &membership.address, sizeof membership.address) == 0) return fail(EADDRINUSE);
  if (!send_only && id->id.qp != nullptr) {
    if (int error = ibv_attach_mcast(id->id.qp, &membership.mgid, 0)) return fail(error);
    membership.attached = true;
  }
  id->multicast.push_back(membership);
  auto event = std::make_unique<QueuedEvent>();
  rdma_ud_param& ud = event->event.param.ud;
  ud.private_data = context;  // librdmacm hands the join's context back here
  ud.ah_attr = path_to_peer(id);
  ud.ah_attr.grh.dgid = membership.mgid;
  ud.qp_num = kMulticastQpn;
  ud.qkey = RDMA_UDP_QKEY;
  if (id->own_channel) return 0;  // a synchronous join is complete
  deliver(id, RDMA_CM_EVENT_MULTICAST_JOIN, 0, std::move(event));
  return 0;
}

int leave_multicast(rdma_cm_id* public_id, const sockaddr* address) {
  if (public_id == nullptr || address == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  sockaddr_storage wanted;
  copy_address(wanted, address);
  for (auto it = id->multicast.begin(); it != id->multicast.end(); ++it) {
    if (std::memcmp(&it->address, &wanted, sizeof wanted) != 0) continue;
    if (it->attached && id->id.qp) ibv_detach_mcast(id->id.qp, &it->mgid, 0);
    id->multicast.erase(it);
    return 0;
  }
  return fail(EADDRNOTAVAIL);
}

}  // namespace softverbs::cm
