// Tracing the calls that libibverbs makes inline, through function pointers
// of the context, of an extended CQ or of an extended QP: the wrappers
// replace those pointers in the program's objects and call the originals.
#pragma once

#include <infiniband/verbs.h>

namespace softverbs::trace {

// After ibv_open_device: post_send, post_recv, post_srq_recv, poll_cq,
// req_notify_cq, and the extended creations (create_cq_ex, create_qp_ex,
// create_srq_ex) of the context.
void wrap_context(ibv_context* context);
// Before ibv_close_device frees it.
void unwrap_context(ibv_context* context);

// The extended CQ's start_poll and next_poll; `wc_flags` are those the
// program asked for (the tracer reads only those, and the QP number).
void wrap_extended_cq(ibv_cq_ex* cq, uint64_t wc_flags);
// The ibv_qp_ex work-request builders of a QP made with send_ops_flags.
void wrap_extended_qp(ibv_qp* qp);
// Before a CQ or QP is destroyed (caller holds the recorder's mutex).
void forget_extended(const void* object);

// The text of the program's creation attributes, shared with the
// exported-function wrappers.
std::string cq_text(int cqe, const ibv_comp_channel* channel);
std::string qp_text(const ibv_qp_init_attr& attr);

}  // namespace softverbs::trace
