// The verbs checker's work request checks (docs/checking.md): buffers the
// application touches while the device owns them, resources destroyed under
// outstanding work, unsignaled sends never reaped, handles used after their
// destroy. The provider's verbs call these only when check::enabled(); each
// is a narrow hook at the point where the verb knows what happened.
#pragma once

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <functional>

#include "checker/report.h"

namespace softverbs::provider::check {

// ---- posts and polls

// One QP's outstanding work requests (work_checks.cpp); the provider's QP
// points at it once the QP's first work request is posted.
struct QpTracker;

// A send work request about to be handed to the device, followed from
// before its post so that no completion comes first; if the device
// refuses it, send_not_posted drops it again.
void send_posting(ibv_qp* qp, const ibv_send_wr& wr, bool signaled, const void* call_site);
void send_not_posted(ibv_qp* qp);
// A chain of receives about to be posted to a QP's own receive queue (srq
// null) or to an SRQ (qp null): followed from before the post, so that no
// completion comes first. Those from `first_refused` on were not posted.
void receives_posting(ibv_qp* qp, ibv_srq* srq, const ibv_recv_wr* chain, const void* call_site);
void receives_not_posted(ibv_qp* qp, ibv_srq* srq, const ibv_recv_wr* first_refused);
// Whether a post on `qp` must fail because it, or an address handle of the
// chain, was destroyed (reported).
bool refuses_post(ibv_qp* qp, const ibv_send_wr* chain, const void* call_site);
// Completions the application polled from `cq`.
void completions_polled(ibv_cq* cq, const ibv_wc* completions, int count);

// ---- registrations and destroys; each reports misuse and lets the verb go on

void mr_registered(const ibv_mr* mr, uint64_t iova, int access_flags);
// `outstanding_sends(qp)` asks the device how many of the QP's send WRs it
// has not completed yet.
void mr_deregistering(const ibv_mr* mr, const std::function<size_t(ibv_qp*)>& outstanding_sends, const void* call_site);
// `outstanding_sends()` asks the device; sends that only wait for their
// acknowledgment get a moment to complete before they are reported.
// A QP was made (its SRQ, if any, is remembered for its receives).
void qp_created(ibv_qp* qp);
void qp_destroying(ibv_qp* qp, const std::function<size_t()>& outstanding_sends, const void* call_site);
void cq_destroying(ibv_cq* cq, int qp_references, const void* call_site);
void srq_destroying(ibv_srq* srq, int qp_references, const void* call_site);
void pd_deallocating(ibv_pd* pd, int users, const void* call_site);

// ---- handles used after their destroy (check mode keeps them allocated)

enum class ObjectKind : uint8_t { Qp, Cq, Mr, Ah, Srq };
// Keeps a destroyed object's memory until its context closes (`release`
// frees it then), so that a later use reaches the provider.
void quarantine(ibv_context* context, ObjectKind kind, const void* handle, std::function<void()> release);
// Whether `handle` was destroyed; if so, reports the use by `verb`.
bool used_after_destroy(ObjectKind kind, const void* handle, const char* verb, const void* call_site);
// Frees what the context's destroyed objects kept (at context close).
void release_quarantine(ibv_context* context);

}  // namespace softverbs::provider::check
