// Address handles, for UD sends.

#include <cerrno>
#include <chrono>
#include <memory>

#include "checker/work_checks.h"
#include "device/device_limits.h"
#include "provider_context.h"
#include "udp/transport.h"
#include "verbs_objects.h"

namespace softverbs::provider {

namespace {

ibv_ah* create_ah(ibv_pd* pd, ibv_ah_attr* attr) {
  if (attr == nullptr || attr->port_num != 1 || (attr->is_global && attr->grh.sgid_index >= limits::kGidTableLength)) {
    errno = EINVAL;
    return nullptr;
  }
  // On an Ethernet (RoCE) port the destination is a GID: HCAs refuse an
  // address handle without a GRH.
  if (!attr->is_global && state_of(pd->context).port.link_layer_ethernet) {
    errno = EINVAL;
    return nullptr;
  }
  if (device_removed(pd->context)) return nullptr;
  auto ah = std::make_unique<ProviderAh>();
  ah->ibv.context = pd->context;
  ah->ibv.pd = pd;
  ah->attr = *attr;
  if (attr->is_global && ibv_query_gid(pd->context, 1, attr->grh.sgid_index, &ah->source_gid) != 0) {
    errno = EINVAL;
    return nullptr;
  }
  // Where UD datagrams go over UDP, an address handle that they could not
  // leave by (a source GID that is not an address of the netdev) fails
  // here, as a QP's move to RTR does, rather than every send with it.
  ContextState& state = state_of(pd->context);
  if (attr->is_global && state.ud_over_udp()) {
    std::string error;
    if (UdpTransport* udp = state.udp_transport();
        udp != nullptr && !udp->usable_source_gid(attr->grh.sgid_index, &error)) {
      std::fprintf(stderr, "softverbs: address handle: %s\n", error.c_str());
      errno = EINVAL;
      return nullptr;
    }
  }
  use_pd(pd);
  return &ah.release()->ibv;
}

int destroy_ah(ibv_ah* ah) {
  const bool checking = check::enabled();
  if (checking && check::used_after_destroy(check::ObjectKind::Ah, ah, "ibv_destroy_ah", __builtin_return_address(0)))
    return EINVAL;
  unuse_pd(ah->pd);
  auto* provider_ah = reinterpret_cast<ProviderAh*>(ah);
  if (checking)
    check::quarantine(ah->context, check::ObjectKind::Ah, ah,
                      [provider_ah] { std::unique_ptr<ProviderAh> owner(provider_ah); });
  else
    std::unique_ptr<ProviderAh> owner(provider_ah);
  return 0;
}

}  // namespace

void add_address_handle_ops(abi::verbs_context_ops& ops) {
  ops.create_ah = create_ah;
  ops.destroy_ah = destroy_ah;
}

}  // namespace softverbs::provider
