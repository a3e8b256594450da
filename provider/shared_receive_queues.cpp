// Shared receive queues.

#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>

#include "checker/registered_memory.h"
#include "checker/unacknowledged_events.h"
#include "checker/work_checks.h"
#include "device/queues.h"
#include "device/receive_queue.h"
#include "handle_registry.h"
#include "provider_context.h"
#include "support/process_id.h"
#include "verbs_objects.h"

namespace softverbs::provider {

ibv_srq* create_srq_in(ibv_pd* pd, ibv_srq_init_attr* init, ProviderXrcd* xrcd, ProviderCq* cq) {
  ContextState& state = state_of(pd->context);
  ibv_srq_attr& attr = init->attr;
  if (attr.max_wr == 0 || attr.max_wr > static_cast<uint32_t>(state.device.max_srq_wr) ||
      attr.max_sge > static_cast<uint32_t>(state.device.max_srq_sge) || attr.srq_limit > attr.max_wr) {
    errno = EINVAL;
    return nullptr;
  }
  if (device_removed(pd->context)) return nullptr;
  DeviceMemory& memory = *state.memory;
  int index = memory.allocate_srq();
  if (index < 0) {
    errno = ENOMEM;
    return nullptr;
  }
  SrqRecord& record = memory.shared().srqs[index];
  RecvQueue rq = allocate_receive_queue(memory, attr.max_wr, attr.max_sge);
  if (rq.ring_offset == 0) {
    SharedLock lock(record.lock);
    record.live = 0;
    errno = ENOMEM;
    return nullptr;
  }
  ProviderObject<ProviderSrq> srq(new_provider_object<ProviderSrq>(pd, DomainResource::Srq));
  if (!srq) {
    state.memory->release(rq.ring_offset, ring_bytes(rq));
    SharedLock lock(record.lock);
    record.live = 0;
    return nullptr;
  }
  srq->index = index;
  ibv_srq& ibv = srq->verbs.srq;
  ibv.context = pd->context;
  ibv.srq_context = init->srq_context;
  ibv.pd = pd;
  ibv.handle = static_cast<uint32_t>(index);
  pthread_mutex_init(&ibv.mutex, nullptr);
  pthread_cond_init(&ibv.cond, nullptr);
  srq->verbs.srq_type = xrcd ? IBV_SRQT_XRC : IBV_SRQT_BASIC;
  srq->verbs.xrcd = xrcd;
  srq->verbs.cq = cq ? &cq->verbs.cq : nullptr;
  srq->xrcd = xrcd;
  srq->cq = cq;
  attr.max_wr = rq.capacity;
  attr.max_sge = rq.max_sge;
  {
    SharedLock lock(record.lock);
    srq->verbs.srq_num = record.srqn;
    record.xrcd_id = xrcd ? xrcd->id : 0;
    record.cq = cq ? cq->index : -1;
    record.pd_handle = pd->handle;
    record.rq = rq;
    record.limit = attr.srq_limit;
    record.owner_handle = reinterpret_cast<uint64_t>(&ibv);
    record.owner_async = state.async_address;
  }
  use_pd(pd);
  if (xrcd) xrcd->users.fetch_add(1, std::memory_order_relaxed);
  if (cq) {
    std::lock_guard guard(state.qps_mutex);
    ++cq->qp_references;  // the CQ stays while an SRQ completes on it
  }
  register_handle(HandleKind::Srq, &ibv);
  return &srq.release()->verbs.srq;
}

namespace {

ibv_srq* create_srq(ibv_pd* pd, ibv_srq_init_attr* init) { return create_srq_in(pd, init, nullptr, nullptr); }

int modify_srq(ibv_srq* ibv, ibv_srq_attr* attr, int mask) {
  ProviderSrq* srq = to_srq(ibv);
  ContextState& state = state_of(ibv->context);
  SrqRecord& record = record_of(srq);
  if (mask & ~(IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT)) return EINVAL;
  uint64_t old_ring = 0, old_bytes = 0;
  {
    SharedLock lock(record.lock);
    uint32_t capacity = record.rq.capacity;
    if (mask & IBV_SRQ_MAX_WR) {
      uint64_t queued = record.rq.posted - record.rq.consumed;
      if (attr->max_wr == 0 || attr->max_wr > static_cast<uint32_t>(state.device.max_srq_wr) || attr->max_wr < queued)
        return EINVAL;
      capacity = attr->max_wr;
    }
    if ((mask & IBV_SRQ_LIMIT) && attr->srq_limit > capacity) return EINVAL;
    if ((mask & IBV_SRQ_MAX_WR) && capacity != record.rq.capacity) {
      // Resize: a new ring holding the queued WQEs in order.
      RecvQueue grown = allocate_receive_queue(*state.memory, capacity, record.rq.max_sge);
      if (grown.ring_offset == 0) return ENOMEM;
      for (uint64_t position = record.rq.consumed; position != record.rq.posted; ++position) {
        RecvWqe* moved = state.memory->recv_slot(grown, grown.posted);
        std::memcpy(moved, state.memory->recv_slot(record.rq, position), record.rq.slot_size);
        moved->sequence = wqe_sequence(grown.posted++);  // its place in the new ring
      }
      old_ring = record.rq.ring_offset;
      old_bytes = ring_bytes(record.rq);
      record.rq = grown;
    }
    if (mask & IBV_SRQ_LIMIT) record.limit = attr->srq_limit;
  }
  state.memory->release(old_ring, old_bytes);
  return 0;
}

int query_srq(ibv_srq* ibv, ibv_srq_attr* attr) {
  SrqRecord& record = record_of(to_srq(ibv));
  SharedLock lock(record.lock);
  attr->max_wr = record.rq.capacity;
  attr->max_sge = record.rq.max_sge;
  attr->srq_limit = record.limit;
  return 0;
}

int destroy_srq(ibv_srq* ibv) {
  ProviderSrq* srq = to_srq(ibv);
  ContextState& state = state_of(ibv->context);
  {
    std::lock_guard guard(state.qps_mutex);
    if (check::enabled()) check::srq_destroying(ibv, srq->qp_references, __builtin_return_address(0));
    if (srq->qp_references > 0) return EBUSY;
    if (srq->cq) --srq->cq->qp_references;
  }
  if (srq->xrcd) srq->xrcd->users.fetch_sub(1, std::memory_order_relaxed);
  check::unacknowledged_at_destroy(ibv, unregister_handle(HandleKind::Srq, ibv));
  SrqRecord& record = record_of(srq);
  uint64_t ring = 0, bytes = 0;
  {
    SharedLock lock(record.lock);
    if (record.live && record.srqn == srq->verbs.srq_num && made_by_this_process(record.owner_pid)) {
      record.live = 0;  // not for an SRQ a forked child inherited
      ring = record.rq.ring_offset;
      bytes = ring_bytes(record.rq);
    }
  }
  state.memory->release(ring, bytes);
  unuse_pd(ibv->pd);
  delete_provider_object(srq);
  return 0;
}

int post_srq_recv(ibv_srq* ibv, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  // XRC SRQs' receives complete for QPs of other processes: not followed.
  const bool checking = check::enabled() && to_srq(ibv)->xrcd == nullptr;
  // ibv_post_srq_recv is an inline of verbs.h: the return address is the application's.
  if (checking) [[unlikely]]
    check::receives_posting(nullptr, ibv, wr, __builtin_return_address(0));
  check::freed_regions_at_receive(nullptr, wr, __builtin_return_address(0));
  SrqRecord& record = record_of(to_srq(ibv));
  DeviceMemory& memory = memory_of(ibv->context);
  const int error = post_receive_chain(ibv->context, wr, bad_wr, [&](uint64_t wr_id, std::span<const Sge> sges) {
    return post_srq_receive(memory, record, wr_id, sges);
  });
  if (checking && error != 0) [[unlikely]]
    check::receives_not_posted(nullptr, ibv, *bad_wr);
  return error;
}

}  // namespace

void add_shared_receive_queue_ops(abi::verbs_context_ops& ops) {
  ops.create_srq = create_srq;
  ops.modify_srq = modify_srq;
  ops.query_srq = query_srq;
  ops.destroy_srq = destroy_srq;
  ops.post_srq_recv = post_srq_recv;
}

}  // namespace softverbs::provider
