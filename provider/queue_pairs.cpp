// Queue pairs: creation, state changes and posts, translated for the
// emulator's DeviceQp, which does the device's part.

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>

#include "checker/access_rules.h"
#include "checker/registered_memory.h"
#include "checker/unacknowledged_events.h"
#include "checker/work_checks.h"
#include "device/device_limits.h"
#include "device/qp_state_machine.h"
#include "device/queues.h"
#include "device/receive_queue.h"
#include "handle_registry.h"
#include "provider_context.h"
#include "verbs/device_qp.h"
#include "verbs_objects.h"

namespace softverbs::provider {

namespace {

std::optional<QpType> emulator_qp_type(ibv_qp_type type) {
  switch (type) {
    case IBV_QPT_RC:
      return QpType::Rc;
    case IBV_QPT_UC:
      return QpType::Uc;
    case IBV_QPT_UD:
      return QpType::Ud;
    case IBV_QPT_XRC_SEND:
    case IBV_QPT_XRC_RECV:
      return QpType::Rc;  // RC's transport, one half of it (XrcRole)
    default:
      return std::nullopt;
  }
}

// Whether the QP asked for fits the device and the PD's context. An
// XRC_SEND QP has a send CQ only, and no receive side at all.
bool valid_qp_request(const ContextState& state, ibv_pd* pd, const ibv_qp_init_attr& attr, QpType type) {
  const ibv_qp_cap& cap = attr.cap;
  const auto within = [](uint32_t asked, int limit) { return asked <= static_cast<uint32_t>(limit); };
  if (attr.qp_type == IBV_QPT_XRC_SEND)
    return attr.send_cq != nullptr && attr.send_cq->context == pd->context && attr.srq == nullptr &&
           within(cap.max_send_wr, state.device.max_qp_wr) && within(cap.max_send_sge, state.device.max_sge) &&
           within(cap.max_inline_data, state.device.max_inline_data);
  if (attr.send_cq == nullptr || attr.recv_cq == nullptr || attr.send_cq->context != pd->context ||
      attr.recv_cq->context != pd->context)
    return false;
  if (!within(cap.max_send_wr, state.device.max_qp_wr) || !within(cap.max_recv_wr, state.device.max_qp_wr) ||
      !within(cap.max_send_sge, state.device.max_sge) || !within(cap.max_recv_sge, state.device.max_sge) ||
      !within(cap.max_inline_data, state.device.max_inline_data))
    return false;
  return attr.srq == nullptr || (attr.srq->context == pd->context && type != QpType::Ud);
}

}  // namespace

void init_ibv_qp(ibv_qp& ibv, ibv_context* context, ibv_pd* pd, const ibv_qp_init_attr& attr, const DeviceQp& device) {
  ibv.context = context;
  ibv.qp_context = attr.qp_context;
  ibv.pd = pd;
  ibv.send_cq = attr.send_cq;
  ibv.recv_cq = attr.recv_cq;
  ibv.srq = attr.srq;
  ibv.handle = static_cast<uint32_t>(device.index());
  ibv.qp_num = device.qpn();
  ibv.state = IBV_QPS_RESET;
  ibv.qp_type = attr.qp_type;
  pthread_mutex_init(&ibv.mutex, nullptr);
  pthread_cond_init(&ibv.cond, nullptr);
  ibv.events_completed = 0;
}

ibv_qp* create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) {
  ContextState& state = state_of(pd->context);
  auto type = emulator_qp_type(attr->qp_type);
  if (!type) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  if (attr->qp_type == IBV_QPT_XRC_RECV) {  // made in an XRC domain (ibv_create_qp_ex), not a PD
    errno = EINVAL;
    return nullptr;
  }
  const bool xrc_send = attr->qp_type == IBV_QPT_XRC_SEND;
  if (xrc_send) {
    attr->recv_cq = nullptr;
    attr->cap.max_recv_wr = attr->cap.max_recv_sge = 0;
  }
  if (!valid_qp_request(state, pd, *attr, *type)) {
    errno = EINVAL;
    return nullptr;
  }
  if (device_removed(pd->context)) return nullptr;
  ibv_qp_cap& cap = attr->cap;
  QpSetup setup{*type,
                pd->handle,
                attr->sq_sig_all != 0,
                to_cq(attr->send_cq)->index,
                attr->recv_cq ? to_cq(attr->recv_cq)->index : -1,
                attr->srq ? to_srq(attr->srq)->index : -1,
                {cap.max_send_wr, cap.max_recv_wr, cap.max_send_sge, cap.max_recv_sge, cap.max_inline_data},
                state.async_address};
  if (xrc_send) setup.xrc = XrcRole::Send;
  ProviderObject<ProviderQp> qp(new_provider_object<ProviderQp>(pd, DomainResource::Qp));
  if (!qp) return nullptr;
  qp->device = DeviceQp::create(state, setup);
  if (!qp->device) return nullptr;
  cap = {setup.caps.max_send_wr, setup.caps.max_recv_wr, setup.caps.max_send_sge, setup.caps.max_recv_sge,
         setup.caps.max_inline_data};
  qp->index = qp->device->index();
  qp->qpn = qp->device->qpn();
  qp->send_cq = to_cq(attr->send_cq);
  qp->recv_cq = attr->recv_cq ? to_cq(attr->recv_cq) : nullptr;
  qp->srq = attr->srq ? to_srq(attr->srq) : nullptr;
  init_ibv_qp(qp->verbs.qp, pd->context, pd, *attr, *qp->device);
  {
    std::lock_guard guard(state.qps_mutex);
    ++qp->send_cq->qp_references;
    if (qp->recv_cq) ++qp->recv_cq->qp_references;
    if (qp->srq) ++qp->srq->qp_references;
  }
  use_pd(pd);
  qp->device->set_owner_handle(reinterpret_cast<uint64_t>(&qp->verbs.qp));
  register_handle(HandleKind::Qp, &qp->verbs.qp);
  if (check::enabled()) check::qp_created(&qp->verbs.qp);
  return &qp.release()->verbs.qp;
}

namespace {

int destroy_qp(ibv_qp* ibv) {
  ProviderQp* qp = to_qp(ibv);
  ContextState& state = state_of(ibv->context);
  const bool checking = check::enabled();
  if (checking) {
    const void* call_site = __builtin_return_address(0);
    if (check::used_after_destroy(check::ObjectKind::Qp, ibv, "ibv_destroy_qp", call_site)) return EINVAL;
    check::qp_destroying(
        ibv, [qp] { return qp->device ? qp->device->outstanding_sends() : size_t{0}; }, call_site);
  }
  check::unacknowledged_at_destroy(ibv, unregister_handle(HandleKind::Qp, ibv));
  if (ibv->qp_type == IBV_QPT_XRC_RECV) release_xrc_recv_handle(qp);
  qp->device.reset();
  {
    std::lock_guard guard(state.qps_mutex);
    if (qp->send_cq) --qp->send_cq->qp_references;
    if (qp->recv_cq) --qp->recv_cq->qp_references;
    if (qp->srq) --qp->srq->qp_references;
  }
  if (ibv->pd) unuse_pd(ibv->pd);
  if (checking && qp->storage.domain == nullptr)
    check::quarantine(ibv->context, check::ObjectKind::Qp, ibv, [qp] { delete_provider_object(qp); });
  else
    delete_provider_object(qp);
  return 0;
}

bool valid_attribute_values(const ContextState& state, const ibv_qp_attr& attr, int mask) {
  if ((mask & IBV_QP_PORT) && attr.port_num != 1) return false;
  if ((mask & IBV_QP_PKEY_INDEX) && attr.pkey_index >= limits::kPkeyTableLength) return false;
  // IBV_ACCESS_ON_DEMAND is a region's matter: HCAs take it in a QP's
  // flags and ignore it there (pyverbs' ODP tests set it). So are the FLUSH
  // rights (rdma-core 45+; 1 << 8 and 1 << 9), which rdma-core 56's pyverbs
  // sets on every extended RC QP, and which HCAs without FLUSH take too.
  constexpr int kFlushGlobal = 1 << 8, kFlushPersistent = 1 << 9;
  if ((mask & IBV_QP_ACCESS_FLAGS) &&
      (attr.qp_access_flags &
       ~(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |
         IBV_ACCESS_MW_BIND | IBV_ACCESS_ON_DEMAND | kFlushGlobal | kFlushPersistent)))
    return false;
  if ((mask & IBV_QP_PATH_MTU) && (attr.path_mtu < IBV_MTU_256 || attr.path_mtu > IBV_MTU_4096)) return false;
  if ((mask & IBV_QP_MAX_QP_RD_ATOMIC) && attr.max_rd_atomic > state.device.max_qp_init_rd_atomic) return false;
  if ((mask & IBV_QP_MAX_DEST_RD_ATOMIC) && attr.max_dest_rd_atomic > state.device.max_qp_rd_atomic) return false;
  if ((mask & IBV_QP_TIMEOUT) && attr.timeout > 31) return false;
  if ((mask & IBV_QP_RETRY_CNT) && attr.retry_cnt > 7) return false;
  if ((mask & IBV_QP_RNR_RETRY) && attr.rnr_retry > 7) return false;
  if ((mask & IBV_QP_MIN_RNR_TIMER) && attr.min_rnr_timer > 31) return false;
  if ((mask & IBV_QP_DEST_QPN) && attr.dest_qp_num > 0xffffff) return false;
  if ((mask & (IBV_QP_RQ_PSN | IBV_QP_SQ_PSN)) &&
      (((mask & IBV_QP_RQ_PSN) && attr.rq_psn > 0xffffff) || ((mask & IBV_QP_SQ_PSN) && attr.sq_psn > 0xffffff)))
    return false;
  if ((mask & IBV_QP_AV) &&
      (attr.ah_attr.port_num > 1 || (attr.ah_attr.is_global && attr.ah_attr.grh.sgid_index >= limits::kGidTableLength)))
    return false;
  return true;
}

void apply_attributes(QpAttributes& a, const ibv_qp_attr& attr, int mask) {
  if (mask & IBV_QP_QKEY) a.qkey = attr.qkey;
  if (mask & IBV_QP_RQ_PSN) a.rq_psn = attr.rq_psn;
  if (mask & IBV_QP_SQ_PSN) a.sq_psn = attr.sq_psn;
  if (mask & IBV_QP_DEST_QPN) a.dest_qpn = attr.dest_qp_num;
  if (mask & IBV_QP_ACCESS_FLAGS) a.access_flags = static_cast<uint32_t>(attr.qp_access_flags);
  if (mask & IBV_QP_PKEY_INDEX) a.pkey_index = attr.pkey_index;
  if (mask & IBV_QP_PORT) a.port = attr.port_num;
  if (mask & IBV_QP_PATH_MTU) a.path_mtu = static_cast<uint8_t>(attr.path_mtu);
  if (mask & IBV_QP_TIMEOUT) a.timeout = attr.timeout;
  if (mask & IBV_QP_RETRY_CNT) a.retry_count = attr.retry_cnt;
  if (mask & IBV_QP_RNR_RETRY) a.rnr_retry = attr.rnr_retry;
  if (mask & IBV_QP_MIN_RNR_TIMER) a.min_rnr_timer = attr.min_rnr_timer;
  if (mask & IBV_QP_MAX_QP_RD_ATOMIC) a.max_rd_atomic = attr.max_rd_atomic;
  if (mask & IBV_QP_MAX_DEST_RD_ATOMIC) a.max_dest_rd_atomic = attr.max_dest_rd_atomic;
  if (mask & IBV_QP_AV) {
    const ibv_ah_attr& ah = attr.ah_attr;
    a.dlid = ah.dlid;
    a.service_level = ah.sl;
    a.is_global = ah.is_global;
    a.sgid_index = ah.grh.sgid_index;
    a.hop_limit = ah.grh.hop_limit;
    a.traffic_class = ah.grh.traffic_class;
    a.flow_label = ah.grh.flow_label;
    std::memcpy(a.dgid, ah.grh.dgid.raw, 16);
  }
}

int modify_qp(ibv_qp* ibv, ibv_qp_attr* attr, int mask) {
  if (check::enabled() &&
      check::used_after_destroy(check::ObjectKind::Qp, ibv, "ibv_modify_qp", __builtin_return_address(0)))
    return EINVAL;
  ProviderQp* qp = to_qp(ibv);
  ContextState& state = state_of(ibv->context);
  QpRecord& record = record_of(qp);
  // An XRC_RECV QP opened in another process: its state changes belong to
  // the process that made it, whose transport carries it.
  if (!qp->device) return EOPNOTSUPP;
  std::lock_guard guard(qp->device->mutex());
  mask &= ~static_cast<int>(ignored_attributes(record.xrc));
  QpState current, target;
  QpAttributes next;
  {
    SharedLock lock(record.lock);
    current = record.state;
    if ((mask & IBV_QP_CUR_STATE) && static_cast<int>(attr->cur_qp_state) != static_cast<int>(current)) return EINVAL;
    target = (mask & IBV_QP_STATE) ? static_cast<QpState>(attr->qp_state) : current;
    if ((mask & IBV_QP_STATE) && attr->qp_state > IBV_QPS_ERR) return EINVAL;
    const auto verdict = record.xrc != XrcRole::None
                             ? check_transition(current, target, record.xrc, static_cast<uint32_t>(mask))
                             : check_transition(current, target, record.type, static_cast<uint32_t>(mask));
    if (verdict != TransitionVerdict::Allowed) return EINVAL;
    if (!valid_attribute_values(state, *attr, mask)) return EINVAL;
    next = record.attributes;
    apply_attributes(next, *attr, mask);
  }
  return qp->device->change_state(current, target, next);
}

int query_qp(ibv_qp* ibv, ibv_qp_attr* attr, int, ibv_qp_init_attr* init_attr) {
  if (check::enabled() &&
      check::used_after_destroy(check::ObjectKind::Qp, ibv, "ibv_query_qp", __builtin_return_address(0)))
    return EINVAL;
  ProviderQp* qp = to_qp(ibv);
  QpRecord& record = record_of(qp);
  SharedLock lock(record.lock);
  if (!record.live || record.qpn != qp->qpn) return EINVAL;  // an opened XRC_RECV QP its creator destroyed
  const QpAttributes& a = record.attributes;
  *attr = {};
  attr->qp_state = static_cast<ibv_qp_state>(record.state);
  attr->cur_qp_state = attr->qp_state;
  attr->path_mtu = static_cast<ibv_mtu>(a.path_mtu);
  attr->qkey = a.qkey;
  attr->rq_psn = a.rq_psn;
  attr->sq_psn = a.sq_psn;
  attr->dest_qp_num = a.dest_qpn;
  attr->qp_access_flags = static_cast<int>(a.access_flags);
  attr->cap = {record.caps.max_send_wr, record.caps.max_recv_wr, record.caps.max_send_sge, record.caps.max_recv_sge,
               record.caps.max_inline_data};
  attr->ah_attr.dlid = a.dlid;
  attr->ah_attr.sl = a.service_level;
  attr->ah_attr.is_global = a.is_global;
  attr->ah_attr.port_num = a.port;
  attr->ah_attr.grh.sgid_index = a.sgid_index;
  attr->ah_attr.grh.hop_limit = a.hop_limit;
  attr->ah_attr.grh.traffic_class = a.traffic_class;
  attr->ah_attr.grh.flow_label = a.flow_label;
  std::memcpy(attr->ah_attr.grh.dgid.raw, a.dgid, 16);
  attr->pkey_index = a.pkey_index;
  attr->sq_draining = 0;
  attr->max_rd_atomic = a.max_rd_atomic;
  attr->max_dest_rd_atomic = a.max_dest_rd_atomic;
  attr->min_rnr_timer = a.min_rnr_timer;
  attr->port_num = a.port;
  attr->timeout = a.timeout;
  attr->retry_cnt = a.retry_count;
  attr->rnr_retry = a.rnr_retry;
  *init_attr = {};
  init_attr->qp_context = ibv->qp_context;
  init_attr->send_cq = ibv->send_cq;
  init_attr->recv_cq = ibv->recv_cq;
  init_attr->srq = ibv->srq;
  init_attr->cap = attr->cap;
  init_attr->qp_type = ibv->qp_type;
  init_attr->sq_sig_all = record.signal_all;
  return 0;
}

int post_recv(ibv_qp* ibv, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  if (ibv->qp_type == IBV_QPT_XRC_SEND || ibv->qp_type == IBV_QPT_XRC_RECV) {
    // No receive queue: an XRC message takes its receive from an XRC SRQ.
    *bad_wr = wr;
    return EINVAL;
  }
  const bool checking = check::enabled();
  if (checking) [[unlikely]] {
    // ibv_post_recv is an inline of verbs.h: the return address is the application's.
    if (check::used_after_destroy(check::ObjectKind::Qp, ibv, "ibv_post_recv", __builtin_return_address(0))) {
      *bad_wr = wr;
      return EINVAL;
    }
    check::receives_posting(ibv, nullptr, wr, __builtin_return_address(0));
    check::freed_regions_at_receive(ibv, wr, __builtin_return_address(0));
  }
  QpRecord& record = record_of(to_qp(ibv));
  DeviceMemory& memory = memory_of(ibv->context);
  const int error = post_receive_chain(ibv->context, wr, bad_wr, [&](uint64_t wr_id, std::span<const Sge> sges) {
    return post_receive(memory, record, wr_id, sges);
  });
  if (checking && error != 0) [[unlikely]]
    check::receives_not_posted(ibv, nullptr, *bad_wr);
  return error;
}
static_assert(sizeof(Sge) == sizeof(ibv_sge) && offsetof(Sge, lkey) == offsetof(ibv_sge, lkey));

// Fills the QP's scratch WQE from the caller's work request (its SGE list is
// copied; an inline send's bytes are read where they are, at post time).
// A BIND_MW: type 1 windows only through ibv_bind_mw, type 2 only through
// a work request (IBA 10.6.7.2); a window of another context is no window.
int translate_bind(const ibv_context* context, const ibv_send_wr* wr, SendVerb verb, SendWqe& r) {
  const ibv_mw* mw = wr->bind_mw.mw;
  const ibv_mw_bind_info& info = wr->bind_mw.bind_info;
  if (mw == nullptr || mw->context != context) return EINVAL;
  if ((mw->type == IBV_MW_TYPE_1) != (verb == SendVerb::BindMw)) return EINVAL;
  if (info.mr == nullptr && info.length != 0) return EINVAL;
  r.bind = WindowBind{mw->handle,
                      wr->bind_mw.rkey,
                      info.mr != nullptr ? info.mr->lkey : 0,
                      static_cast<uint32_t>(info.mw_access_flags),
                      info.addr,
                      info.length,
                      verb == SendVerb::BindMw};
  return 0;
}

int translate_send(const ibv_qp* qp, const QpRecord& record, const ibv_send_wr* wr, SendWqe& r, SendVerb verb) {
  const SendOpcodeInfo& info = send_opcode_info(wr->opcode);
  if (record.xrc == XrcRole::Recv) return EINVAL;  // no send queue
  if (record.xrc == XrcRole::Send) r.remote_srqn = wr->qp_type.xrc.remote_srqn;
  if (!info.valid_for(record.type) || wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > record.caps.max_send_sge)
    return EINVAL;
  r.wr_id = wr->wr_id;
  r.opcode = static_cast<SendOpcode>(wr->opcode);
  r.flags = wr->send_flags;
  r.imm_data = wr->imm_data;
  r.signaled = (wr->send_flags & IBV_SEND_SIGNALED) || record.signal_all;
  if (info.is(wr_mask::kInvalidate) || r.opcode == SendOpcode::LocalInvalidate) r.invalidate_rkey = wr->invalidate_rkey;
  // Local operations move no data: their SGE list means nothing.
  if (r.opcode == SendOpcode::LocalInvalidate) return 0;
  if (r.opcode == SendOpcode::BindMemoryWindow) return translate_bind(qp->context, wr, verb, r);
  const auto* sges = reinterpret_cast<const Sge*>(wr->sg_list);
  r.sges.assign(sges, sges + wr->num_sge);
  for (const Sge& sge : r.sges) r.length += sge.length;
  // An ATOMIC WRITE carries exactly 8 bytes; inline, the device keeps them
  // in the WQE (as rxe does) whatever max_inline_data says.
  const bool atomic_write = r.opcode == SendOpcode::AtomicWrite;
  if (atomic_write && r.length != 8) return EINVAL;
  if ((wr->send_flags & IBV_SEND_INLINE) &&
      (info.is(wr_mask::kIntoLocal) || (r.length > record.caps.max_inline_data && !atomic_write)))
    return EINVAL;
  if (info.is(wr_mask::kAtomic)) {
    r.remote_address = wr->wr.atomic.remote_addr;
    r.rkey = wr->wr.atomic.rkey;
    r.compare_add = wr->wr.atomic.compare_add;
    r.swap = wr->wr.atomic.swap;
  } else if (info.is(wr_mask::kRemoteRange)) {
    r.remote_address = wr->wr.rdma.remote_addr;
    r.rkey = wr->wr.rdma.rkey;
  }
  if (record.type == QpType::Ud) {
    if (wr->wr.ud.ah == nullptr) return EINVAL;
    auto* ah = reinterpret_cast<ProviderAh*>(wr->wr.ud.ah);
    r.remote_qpn = wr->wr.ud.remote_qpn;
    r.remote_qkey = wr->wr.ud.remote_qkey;
    r.has_grh = ah->attr.is_global;
    r.sgid_index = ah->attr.grh.sgid_index;
    const ContextState& state = state_of(ah->ibv.context);
    r.roce_v2 = !ah->attr.is_global || ah->attr.grh.sgid_index >= state.gids.size() ||
                state.gids[ah->attr.grh.sgid_index].type == GidType::RoceV2;
    std::memcpy(r.source_gid.data(), ah->source_gid.raw, 16);
    std::memcpy(r.destination_gid.data(), ah->attr.grh.dgid.raw, 16);
    r.hop_limit = ah->attr.grh.hop_limit;
    r.traffic_class = ah->attr.grh.traffic_class;
    r.flow_label = ah->attr.grh.flow_label;
  }
  return 0;
}

}  // namespace

// ibv_post_send is an inline of verbs.h: the return address is the
// application's call site.
int post_send(ibv_qp* ibv, ibv_send_wr* wr, ibv_send_wr** bad_wr) {
  if (check::enabled()) [[unlikely]] {
    check::access_rules_at_post(ibv, wr, __builtin_return_address(0));
    check::freed_regions_at_send(ibv, wr, __builtin_return_address(0));
  }
  return post_send_requests(ibv, wr, bad_wr, SendVerb::PostSend, __builtin_return_address(0));
}

int post_send_requests(ibv_qp* ibv, ibv_send_wr* wr, ibv_send_wr** bad_wr, SendVerb verb, const void* call_site,
                       const BuiltRequest* built) {
  const bool checking = check::enabled();
  if (checking && check::refuses_post(ibv, wr, call_site)) [[unlikely]] {
    *bad_wr = wr;
    return EINVAL;
  }
  ProviderQp* qp = to_qp(ibv);
  if (!qp->device) {  // an opened XRC_RECV QP: no send queue anywhere
    *bad_wr = wr;
    return EINVAL;
  }
  QpRecord& record = record_of(qp);
  DeviceQp::PostBatch batch(*qp->device);
  for (size_t i = 0; wr != nullptr; wr = wr->next, ++i) {
    SendWqe& wqe = batch.blank_wqe();
    int error = translate_send(ibv, record, wr, wqe, verb);
    if (error == 0) {
      // Followed before the device has it: on shared memory the send may
      // run inside the post and be polled by another thread at once.
      if (checking) [[unlikely]]
        check::send_posting(ibv, *wr, wqe.signaled, built ? built[i].call_site : call_site);
      error = batch.post(wqe);
      if (checking && error != 0) [[unlikely]]
        check::send_not_posted(ibv);
    }
    if (error != 0) {
      *bad_wr = wr;
      return error;
    }
  }
  return 0;
}

namespace {

// ---- multicast ----------------------------------------------------------------

Gid to_gid(const ibv_gid* gid) {
  Gid out;
  std::memcpy(out.raw.data(), gid->raw, 16);
  return out;
}

int attach_mcast(ibv_qp* ibv, const ibv_gid* gid, uint16_t) {
  if (gid == nullptr || ibv->qp_type != IBV_QPT_UD) return EINVAL;
  return state_of(ibv->context).attach_multicast(to_gid(gid), ibv->qp_num);
}

int detach_mcast(ibv_qp* ibv, const ibv_gid* gid, uint16_t) {
  if (gid == nullptr) return EINVAL;
  return state_of(ibv->context).detach_multicast(to_gid(gid), ibv->qp_num);
}

}  // namespace

void add_queue_pair_ops(abi::verbs_context_ops& ops) {
  ops.create_qp = create_qp;
  ops.create_qp_ex = create_qp_ex;
  ops.modify_qp = modify_qp;
  ops.query_qp = query_qp;
  ops.destroy_qp = destroy_qp;
  ops.post_send = post_send;
  ops.post_recv = post_recv;
  ops.attach_mcast = attach_mcast;
  ops.detach_mcast = detach_mcast;
}

}  // namespace softverbs::provider
