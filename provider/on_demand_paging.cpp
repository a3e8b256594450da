// On-demand paging: ibv_advise_mr. Registration (IBV_ACCESS_ON_DEMAND, and
// the implicit region) is in memory_objects.cpp; the pages are resolved in
// the emulator's key checks (device/on_demand_paging.h).
#include "device/on_demand_paging.h"

#include <cerrno>
#include <span>

#include "verbs_objects.h"

namespace softverbs::provider {

static_assert(IBV_ODP_SUPPORT == odp::kSupport && IBV_ODP_SUPPORT_IMPLICIT == odp::kSupportImplicit);
static_assert(IBV_ODP_SUPPORT_SEND == odp::kSend && IBV_ODP_SUPPORT_RECV == odp::kReceive &&
              IBV_ODP_SUPPORT_WRITE == odp::kWrite && IBV_ODP_SUPPORT_READ == odp::kRead &&
              IBV_ODP_SUPPORT_ATOMIC == odp::kAtomic && IBV_ODP_SUPPORT_SRQ_RECV == odp::kSrqReceive);
static_assert(IBV_ADVISE_MR_ADVICE_PREFETCH == static_cast<int>(PrefetchAdvice::Prefetch) &&
              IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE == static_cast<int>(PrefetchAdvice::PrefetchWrite) &&
              IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT == static_cast<int>(PrefetchAdvice::PrefetchNoFault) &&
              IB_UVERBS_ADVISE_MR_FLAG_FLUSH == kAdviseFlush);
static_assert(sizeof(ibv_sge) == sizeof(Sge) && offsetof(ibv_sge, lkey) == offsetof(Sge, lkey));

namespace {

// Returns the errno value, as ibv_advise_mr does.
int advise_mr(ibv_pd* pd, ibv_advise_mr_advice advice, uint32_t flags, ibv_sge* sg_list, uint32_t num_sge) {
  if (sg_list == nullptr && num_sge != 0) return errno = EINVAL;
  const int error = advise_prefetch(memory_of(pd->context), pd->handle, static_cast<uint32_t>(advice), flags,
                                    std::span(reinterpret_cast<const Sge*>(sg_list), sg_list == nullptr ? 0 : num_sge));
  if (error != 0) errno = error;
  return error;
}

}  // namespace

void add_on_demand_paging_ops(abi::verbs_context_ops& ops) { ops.advise_mr = advise_mr; }

}  // namespace softverbs::provider
