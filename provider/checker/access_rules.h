// Check: work that softverbs carries out although an HCA would not, because
// of a rule softverbs does not enforce (docs/checking.md lists the
// rules softverbs does enforce as HCAs do, and these it relaxes).
#pragma once

#include <infiniband/verbs.h>

namespace softverbs::provider::check {

// At ibv_post_send, for each WR of the chain: READs and atomics on a QP
// without the RDMA READ / atomic resources an HCA needs on either side.
// `call_site`: the application's return address.
void access_rules_at_post(ibv_qp* qp, const ibv_send_wr* wr, const void* call_site);

}  // namespace softverbs::provider::check
