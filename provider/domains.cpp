// Thread domains and parent domains (ibv_alloc_td, ibv_alloc_parent_domain).
// A parent domain stands for its protection domain wherever a PD is taken;
// its thread domain is a promise of single-threaded use that the emulator's
// locking does not need, and its allocator gives the memory of the QPs, CQs
// and SRQs made in it (verbs_objects.h: new_provider_object).
#include <cerrno>
#include <memory>

#include "provider_context.h"
#include "verbs_objects.h"

namespace softverbs::provider {

namespace {

ibv_td* alloc_td(ibv_context* context, ibv_td_init_attr* attr) {
  if (attr == nullptr || attr->comp_mask != 0) {
    errno = EINVAL;
    return nullptr;
  }
  if (device_removed(context)) return nullptr;
  auto td = std::make_unique<ProviderTd>();
  td->ibv.context = context;
  return &td.release()->ibv;
}

int dealloc_td(ibv_td* ibv) {
  if (to_td(ibv)->users.load(std::memory_order_relaxed) > 0) return EBUSY;
  std::unique_ptr<ProviderTd> owner(to_td(ibv));
  return 0;
}

ibv_pd* alloc_parent_domain(ibv_context* context, ibv_parent_domain_init_attr* attr) {
  constexpr uint32_t kKnownMask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS | IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT;
  if (attr == nullptr || (attr->comp_mask & ~kKnownMask) || attr->pd == nullptr || attr->pd->context != context ||
      to_pd(attr->pd)->is_parent_domain() || (attr->td != nullptr && attr->td->context != context)) {
    errno = EINVAL;
    return nullptr;
  }
  // An allocator without its free (or the reverse) could not give back
  // what it gave.
  const bool allocators = (attr->comp_mask & IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS) != 0;
  if (allocators && (attr->alloc == nullptr) != (attr->free == nullptr)) {
    errno = EINVAL;
    return nullptr;
  }
  if (device_removed(context)) return nullptr;
  auto domain = std::make_unique<ProviderPd>();
  domain->ibv.context = context;
  domain->ibv.handle = attr->pd->handle;
  domain->protection_domain = attr->pd;
  if (allocators) {
    domain->alloc = attr->alloc;
    domain->free = attr->free;
  }
  if (attr->comp_mask & IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT) domain->pd_context = attr->pd_context;
  if (attr->td != nullptr) {
    domain->td = to_td(attr->td);
    domain->td->users.fetch_add(1, std::memory_order_relaxed);
  }
  use_pd(attr->pd);  // the PD cannot go while a parent domain stands for it
  return &domain.release()->ibv;
}

}  // namespace

void release_parent_domain(ProviderPd& domain) {
  unuse_pd(domain.protection_domain);
  if (domain.td != nullptr) domain.td->users.fetch_sub(1, std::memory_order_relaxed);
}

void add_domain_ops(abi::verbs_context_ops& ops) {
  ops.alloc_td = alloc_td;
  ops.dealloc_td = dealloc_td;
  ops.alloc_parent_domain = alloc_parent_domain;
}

}  // namespace softverbs::provider
