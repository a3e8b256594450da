// Queue pairs: the attributes of each transition as the connection sets
// them (rdma_init_qp_attr's answer), and the rdma_* calls that make QPs,
// their CQs and SRQs for an id.
#include <algorithm>
#include <cstring>
#include <optional>

#include "cm_internal.h"

namespace softverbs::cm {

namespace {

// What the kernel's IB CM gives an RC QP at RTR, and so what rdma_cm
// applications get on hardware: 0, the longest RNR NAK delay (655.36 ms).
// A receive posted a little late then costs one long wait, not an
// IBV_WC_RNR_RETRY_EXC_ERR after a few short ones.
constexpr uint8_t kMinRnrTimer = 0;

}  // namespace

void move_qp_to_error(CmId* id) {
  if (id->id.qp == nullptr) return;
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  ibv_modify_qp(id->id.qp, &attr, IBV_QP_STATE);
}

ibv_ah_attr path_to_peer(CmId* id) {
  ibv_ah_attr ah{};
  ah.is_global = 1;
  ah.port_num = 1;
  ah.grh.hop_limit = kHopLimit;
  ah.grh.traffic_class = id->tos;
  // The GIDs the connection's MADs travelled between (as the kernel takes
  // the path from the REQ), else those of the addresses.
  constexpr std::array<uint8_t, 16> kNone{};
  ah.grh.dgid = gid_of(id->id.route.addr.dst_storage);
  if (id->peer_gid != kNone) std::memcpy(ah.grh.dgid.raw, id->peer_gid.data(), 16);
  // The source GID's index: the RoCE v2 entry of our address.
  ibv_gid wanted = gid_of(id->id.route.addr.src_storage);
  if (id->local_gid != kNone) std::memcpy(wanted.raw, id->local_gid.data(), 16);
  Gid16 source;
  std::memcpy(source.data(), wanted.raw, 16);
  if (const auto found = find_roce_v2_gid(id->id.verbs, source)) ah.grh.sgid_index = found->index;
  return ah;
}

namespace {

void init_attributes(CmId* id, ibv_qp_attr& attr, int& mask) {
  attr.pkey_index = 0;
  attr.port_num = 1;
  mask |= IBV_QP_PKEY_INDEX | IBV_QP_PORT;
  if (is_ud(id)) {
    attr.qkey = RDMA_UDP_QKEY;
    mask |= IBV_QP_QKEY;
  } else {
    attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    if (id->responder_resources) attr.qp_access_flags |= IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    mask |= IBV_QP_ACCESS_FLAGS;
  }
}

// The starting PSN a REQ or REP carries is the one its sender expects to
// receive first, so the peer's is where our sends start (as the kernel's IB
// CM has it: ib_send_cm_req keeps its own as rq_psn, the passive side takes
// it as sq_psn).
std::optional<uint32_t> peer_start_psn(const CmId* id) {
  if (id->request) return id->request->start_psn;
  if (id->reply) return id->reply->start_psn;
  return std::nullopt;
}

int rtr_attributes(CmId* id, ibv_qp_attr& attr, int& mask) {
  if (is_ud(id)) return 0;
  uint32_t peer_qpn = 0;
  if (id->request) {
    peer_qpn = id->request->qp_num;
  } else if (id->reply) {
    peer_qpn = id->reply->qp_num;
  } else {
    return EINVAL;  // nothing from the peer yet
  }
  ibv_port_attr port{};
  ibv_query_port(id->id.verbs, 1, &port);
  attr.path_mtu = port.active_mtu;
  attr.dest_qp_num = peer_qpn;
  attr.rq_psn = id->local_psn;
  attr.ah_attr = path_to_peer(id);
  mask |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
  // A responder's part: RC, and XRC's receiving half (its sending half has none).
  if (id->id.qp_type == IBV_QPT_RC || id->id.qp_type == IBV_QPT_XRC_RECV) {
    attr.max_dest_rd_atomic = id->responder_resources;
    attr.min_rnr_timer = kMinRnrTimer;
    mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  }
  return 0;
}

void rts_attributes(CmId* id, ibv_qp_attr& attr, int& mask) {
  attr.sq_psn = is_ud(id) ? 0 : peer_start_psn(id).value_or(0);
  mask |= IBV_QP_SQ_PSN;
  if (id->id.qp_type == IBV_QPT_RC || id->id.qp_type == IBV_QPT_XRC_SEND) {
    attr.timeout = id->ack_timeout;
    attr.retry_cnt = id->retry_count;
    attr.rnr_retry = id->rnr_retry_count;
    attr.max_rd_atomic = id->initiator_depth;
    mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  } else if (id->id.qp_type == IBV_QPT_XRC_RECV) {
    attr.timeout = id->ack_timeout;  // what the verbs require of it: it sends no requests
    mask |= IBV_QP_TIMEOUT;
  }
}

}  // namespace

int qp_attributes(CmId* id, ibv_qp_state state, ibv_qp_attr& attr, int& mask) {
  std::memset(&attr, 0, sizeof attr);
  attr.qp_state = state;
  mask = IBV_QP_STATE;
  switch (state) {
    case IBV_QPS_INIT:
      init_attributes(id, attr, mask);
      return 0;
    case IBV_QPS_RTR:
      return rtr_attributes(id, attr, mask);
    case IBV_QPS_RTS:
      rts_attributes(id, attr, mask);
      return 0;
    default:
      return EINVAL;
  }
}

int modify(CmId* id, ibv_qp_state state) {
  ibv_qp_attr attr;
  int mask;
  if (int error = qp_attributes(id, state, attr, mask)) return error;
  return ibv_modify_qp(id->id.qp, &attr, mask);
}

void clamp_depths(CmId* id) {
  ibv_device_attr attr{};
  if (id->id.verbs && ibv_query_device(id->id.verbs, &attr) == 0) {
    id->responder_resources = static_cast<uint8_t>(std::min<int>(id->responder_resources, attr.max_qp_rd_atom));
    id->initiator_depth = static_cast<uint8_t>(std::min<int>(id->initiator_depth, attr.max_qp_init_rd_atom));
  }
}

int init_qp_attr(rdma_cm_id* public_id, ibv_qp_attr* attr, int* mask) {
  if (public_id == nullptr || attr == nullptr || mask == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.verbs == nullptr) return fail(EINVAL);
  if (int error = qp_attributes(id, attr->qp_state, *attr, *mask)) return fail(error);
  return 0;
}

// ---- queue pairs ---------------------------------------------------------------

namespace {

// Completion channels and CQs the application did not provide, with the id as
// cq_context, as librdmacm creates them for the rdma_post_*/get_*_comp inlines.
// XRC's sending half has no receive CQ; its receiving half completes through
// its SRQ's CQ, the receive CQ made here, and sends nothing.
int create_missing_cqs(CmId* id, ibv_qp_type type, ibv_cq*& send_cq, ibv_cq*& recv_cq, uint32_t send_depth,
                       uint32_t recv_depth) {
  if (recv_cq == nullptr && type != IBV_QPT_XRC_SEND) {
    id->id.recv_cq_channel = ibv_create_comp_channel(id->id.verbs);
    id->id.recv_cq = ibv_create_cq(id->id.verbs, std::max<uint32_t>(recv_depth, 1), &id->id, id->id.recv_cq_channel, 0);
    if (id->id.recv_cq == nullptr) return errno ? errno : ENOMEM;
    recv_cq = id->id.recv_cq;
    id->owns_cqs = true;
  }
  if (send_cq == nullptr && type != IBV_QPT_XRC_RECV) {
    id->id.send_cq_channel = ibv_create_comp_channel(id->id.verbs);
    id->id.send_cq = ibv_create_cq(id->id.verbs, std::max<uint32_t>(send_depth, 1), &id->id, id->id.send_cq_channel, 0);
    if (id->id.send_cq == nullptr) return errno ? errno : ENOMEM;
    send_cq = id->id.send_cq;
    id->owns_cqs = true;
  }
  return 0;
}

void destroy_owned_cqs(CmId* id) {
  if (!id->owns_cqs) return;
  if (id->id.send_cq) ibv_destroy_cq(id->id.send_cq);
  if (id->id.recv_cq) ibv_destroy_cq(id->id.recv_cq);
  if (id->id.send_cq_channel) ibv_destroy_comp_channel(id->id.send_cq_channel);
  if (id->id.recv_cq_channel) ibv_destroy_comp_channel(id->id.recv_cq_channel);
  id->id.send_cq = id->id.recv_cq = nullptr;
  id->id.send_cq_channel = id->id.recv_cq_channel = nullptr;
  id->owns_cqs = false;
}

// After creation: INIT for connected QPs; a UD QP goes straight to RTS.
int prepare_qp(CmId* id) {
  int error = modify(id, IBV_QPS_INIT);
  if (error == 0 && is_ud(id)) {
    error = modify(id, IBV_QPS_RTR);
    if (error == 0) error = modify(id, IBV_QPS_RTS);
  }
  return error;
}

// The id takes a QP just created (0), or the QP and the CQs made for it go
// (an errno).
int adopt_qp(CmId* id, ibv_qp* qp) {
  if (qp == nullptr) {
    int error = errno;
    destroy_owned_cqs(id);
    return error;
  }
  id->id.qp = qp;
  id->id.qp_type = qp->qp_type;
  if (int error = prepare_qp(id)) {
    ibv_destroy_qp(qp);
    id->id.qp = nullptr;
    destroy_owned_cqs(id);
    return error;
  }
  id->id.pd = qp->pd;  // as librdmacm: rdma_reg_msgs registers in the QP's PD
  return 0;
}

}  // namespace

int create_qp(rdma_cm_id* public_id, ibv_pd* pd, ibv_qp_init_attr* attr) {
  if (public_id == nullptr || attr == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.verbs == nullptr || id->id.qp != nullptr) return fail(EINVAL);
  if (pd == nullptr) pd = id->id.pd;
  if (pd == nullptr || pd->context != id->id.verbs) return fail(EINVAL);
  // Through the extended call, as librdmacm makes every QP: it alone takes
  // the XRC domain an XRC_RECV QP is made in.
  ibv_qp_init_attr_ex ex{};
  ex.qp_context = attr->qp_context;
  ex.send_cq = attr->send_cq;
  ex.recv_cq = attr->recv_cq;
  ex.srq = attr->srq;
  ex.cap = attr->cap;
  ex.qp_type = attr->qp_type;
  ex.sq_sig_all = attr->sq_sig_all;
  ex.comp_mask = IBV_QP_INIT_ATTR_PD;
  ex.pd = pd;
  if (create_qp_ex(public_id, &ex) != 0) return -1;
  attr->cap = ex.cap;
  attr->send_cq = ex.send_cq;
  attr->recv_cq = ex.recv_cq;
  return 0;
}

int create_qp_ex(rdma_cm_id* public_id, ibv_qp_init_attr_ex* attr) {
  if (public_id == nullptr || attr == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.verbs == nullptr || id->id.qp != nullptr) return fail(EINVAL);
  if (!(attr->comp_mask & IBV_QP_INIT_ATTR_PD) || attr->pd == nullptr) {
    attr->comp_mask |= IBV_QP_INIT_ATTR_PD;
    attr->pd = id->id.pd;
  }
  const bool xrc_recv = attr->qp_type == IBV_QPT_XRC_RECV;
  if (xrc_recv && (!(attr->comp_mask & IBV_QP_INIT_ATTR_XRCD) || attr->xrcd == nullptr)) {
    attr->xrcd = Engine::instance().devices.xrcd_for(id->id.verbs);
    if (attr->xrcd == nullptr) return -1;
    attr->comp_mask |= IBV_QP_INIT_ATTR_XRCD;
  }
  if (int error = create_missing_cqs(id, attr->qp_type, attr->send_cq, attr->recv_cq, attr->cap.max_send_wr,
                                     attr->cap.max_recv_wr)) {
    destroy_owned_cqs(id);
    return fail(error);
  }
  if (attr->srq == nullptr && attr->qp_type != IBV_QPT_XRC_SEND && !xrc_recv) attr->srq = id->id.srq;
  if (int error = adopt_qp(id, ibv_create_qp_ex(id->id.verbs, attr))) return fail(error);
  // A domain's QP has no PD (nor CQs: the receive CQ made here serves the
  // XRC SRQ that rdma_create_srq makes); rdma_reg_msgs registers in the id's.
  if (xrc_recv) id->id.pd = attr->pd;
  return 0;
}

void destroy_qp(rdma_cm_id* public_id) {
  if (public_id == nullptr) return;
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.qp) ibv_destroy_qp(id->id.qp);
  const bool cq_serves_srq = id->id.qp_type == IBV_QPT_XRC_RECV && id->id.srq != nullptr;
  id->id.qp = nullptr;
  if (!cq_serves_srq) destroy_owned_cqs(id);  // else with the SRQ
}

// ---- shared receive queues -------------------------------------------------------

int create_srq(rdma_cm_id* public_id, ibv_pd* pd, ibv_srq_init_attr* attr) {
  if (public_id == nullptr || attr == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.verbs == nullptr || id->id.srq != nullptr) return fail(EINVAL);
  if (id->id.qp_type == IBV_QPT_XRC_RECV) {
    // An XRC_RECV id's SRQ is an XRC SRQ, as librdmacm makes it.
    ibv_srq_init_attr_ex ex{};
    ex.srq_context = attr->srq_context;
    ex.attr = attr->attr;
    ex.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD;
    ex.srq_type = IBV_SRQT_XRC;
    ex.pd = pd;
    const int result = create_srq_ex(public_id, &ex);
    attr->attr = ex.attr;
    return result;
  }
  ibv_srq* srq = ibv_create_srq(pd ? pd : id->id.pd, attr);
  if (srq == nullptr) return -1;
  id->id.srq = srq;
  return 0;
}

namespace {

// An XRC SRQ in the device's domain (unless one is named), completing on
// the id's receive CQ (made here if the id has none).
int create_xrc_srq(CmId* id, ibv_srq_init_attr_ex* attr) {
  if (!(attr->comp_mask & IBV_SRQ_INIT_ATTR_PD) || attr->pd == nullptr) {
    attr->pd = id->id.pd;
    attr->comp_mask |= IBV_SRQ_INIT_ATTR_PD;
  }
  if (!(attr->comp_mask & IBV_SRQ_INIT_ATTR_XRCD) || attr->xrcd == nullptr) {
    attr->xrcd = Engine::instance().devices.xrcd_for(id->id.verbs);
    if (attr->xrcd == nullptr) return -1;
  }
  if (!(attr->comp_mask & IBV_SRQ_INIT_ATTR_CQ) || attr->cq == nullptr) {
    ibv_cq* no_send_cq = nullptr;
    ibv_cq* recv_cq = id->id.recv_cq;
    if (int error = create_missing_cqs(id, IBV_QPT_XRC_RECV, no_send_cq, recv_cq, 0, attr->attr.max_wr))
      return fail(error);
    attr->cq = recv_cq;
  }
  attr->comp_mask |= IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ;
  ibv_srq* srq = ibv_create_srq_ex(id->id.verbs, attr);
  if (srq == nullptr) {
    if (id->id.qp == nullptr) destroy_owned_cqs(id);
    return -1;
  }
  id->id.srq = srq;
  return 0;
}

}  // namespace

int create_srq_ex(rdma_cm_id* public_id, ibv_srq_init_attr_ex* attr) {
  if (public_id == nullptr || attr == nullptr) return fail(EINVAL);
  if ((attr->comp_mask & IBV_SRQ_INIT_ATTR_TYPE) && attr->srq_type == IBV_SRQT_XRC) {
    std::lock_guard guard(Engine::instance().mutex);
    CmId* id = priv(public_id);
    if (id->id.verbs == nullptr || id->id.srq != nullptr) return fail(EINVAL);
    return create_xrc_srq(id, attr);
  }
  ibv_srq_init_attr basic{};
  basic.srq_context = attr->srq_context;
  basic.attr = attr->attr;
  if ((attr->comp_mask & IBV_SRQ_INIT_ATTR_TYPE) && attr->srq_type != IBV_SRQT_BASIC) return fail(EOPNOTSUPP);
  int result = create_srq(public_id, (attr->comp_mask & IBV_SRQ_INIT_ATTR_PD) ? attr->pd : nullptr, &basic);
  attr->attr = basic.attr;
  return result;
}

void destroy_srq(rdma_cm_id* public_id) {
  if (public_id == nullptr) return;
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.srq) ibv_destroy_srq(id->id.srq);
  id->id.srq = nullptr;
  // An XRC_RECV id's receive CQ served the SRQ (see destroy_qp).
  if (id->id.qp_type == IBV_QPT_XRC_RECV && id->id.qp == nullptr) destroy_owned_cqs(id);
}

}  // namespace softverbs::cm
