// Check: events handed to the application and not acknowledged when their
// object is destroyed or the device closed. libibverbs on an HCA waits in
// ibv_destroy_cq/qp/srq until every event the kernel reported is
// acknowledged, so such a program hangs there; softverbs waits up to a
// second for another thread's acknowledgement, and reports what is missing.
#pragma once

#include <infiniband/verbs.h>

#include "handle_registry.h"

namespace softverbs::provider::check {

void unacknowledged_at_destroy(const ibv_cq* cq, DeliveredEvents delivered);
void unacknowledged_at_destroy(const ibv_qp* qp, DeliveredEvents delivered);
void unacknowledged_at_destroy(const ibv_srq* srq, DeliveredEvents delivered);
// The CQs, QPs and SRQs `context` still has, each with events unacknowledged.
void unacknowledged_at_close(const ibv_context* context);

}  // namespace softverbs::provider::check
