// The extended send API (ibv_wr_*) and ibv_create_qp_ex.
#include <endian.h>

#include <cerrno>
#include <chrono>
#include <memory>

#include "provider_context.h"
#include "verbs_objects.h"

namespace softverbs::provider {

namespace {

// ---- the extended send API (ibv_wr_*) --------------------------------------
//
// Each ibv_wr_<opcode> call starts a work request from qp_ex->wr_id and
// wr_flags; the ibv_wr_set_* calls complete the last one; ibv_wr_complete
// posts the batch through post_send, so both APIs share every check.

ProviderQp* to_qp(ibv_qp_ex* qp) { return reinterpret_cast<ProviderQp*>(qp); }

// Inlined into each ibv_wr_<opcode> entry, whose return address is then the
// application's call site (the ibv_wr_* calls are inlines of verbs.h).
[[gnu::always_inline]] inline ibv_send_wr& begin_request(ibv_qp_ex* ex, ibv_wr_opcode opcode) {
  ProviderQp* qp = to_qp(ex);
  BuiltRequest& built = qp->batch.emplace_back();
  built.call_site = __builtin_return_address(0);
  built.wr.wr_id = ex->wr_id;
  built.wr.send_flags = ex->wr_flags;
  built.wr.opcode = opcode;
  return built.wr;
}

BuiltRequest* last_request(ibv_qp_ex* ex) {
  ProviderQp* qp = to_qp(ex);
  if (qp->batch.empty()) {
    qp->batch_error = EINVAL;  // a setter before any ibv_wr_<opcode>
    return nullptr;
  }
  return &qp->batch.back();
}

void wr_send(ibv_qp_ex* ex) { begin_request(ex, IBV_WR_SEND); }
void wr_send_imm(ibv_qp_ex* ex, __be32 imm) { begin_request(ex, IBV_WR_SEND_WITH_IMM).imm_data = imm; }
void wr_rdma_write(ibv_qp_ex* ex, uint32_t rkey, uint64_t remote) {
  begin_request(ex, IBV_WR_RDMA_WRITE).wr.rdma = {remote, rkey};
}
void wr_rdma_write_imm(ibv_qp_ex* ex, uint32_t rkey, uint64_t remote, __be32 imm) {
  ibv_send_wr& wr = begin_request(ex, IBV_WR_RDMA_WRITE_WITH_IMM);
  wr.wr.rdma = {remote, rkey};
  wr.imm_data = imm;
}
void wr_rdma_read(ibv_qp_ex* ex, uint32_t rkey, uint64_t remote) {
  begin_request(ex, IBV_WR_RDMA_READ).wr.rdma = {remote, rkey};
}
void wr_atomic_cmp_swp(ibv_qp_ex* ex, uint32_t rkey, uint64_t remote, uint64_t compare, uint64_t swap) {
  begin_request(ex, IBV_WR_ATOMIC_CMP_AND_SWP).wr.atomic = {remote, compare, swap, rkey};
}
void wr_atomic_fetch_add(ibv_qp_ex* ex, uint32_t rkey, uint64_t remote, uint64_t add) {
  begin_request(ex, IBV_WR_ATOMIC_FETCH_AND_ADD).wr.atomic = {remote, add, 0, rkey};
}
void wr_bind_mw(ibv_qp_ex* ex, ibv_mw* mw, uint32_t rkey, const ibv_mw_bind_info* info) {
  ibv_send_wr& wr = begin_request(ex, IBV_WR_BIND_MW);
  wr.bind_mw.mw = mw;
  wr.bind_mw.rkey = rkey;
  wr.bind_mw.bind_info = *info;
}
void wr_local_inv(ibv_qp_ex* ex, uint32_t invalidate_rkey) {
  begin_request(ex, IBV_WR_LOCAL_INV).invalidate_rkey = invalidate_rkey;
}
void wr_send_inv(ibv_qp_ex* ex, uint32_t invalidate_rkey) {
  begin_request(ex, IBV_WR_SEND_WITH_INV).invalidate_rkey = invalidate_rkey;
}
// The 8 bytes are copied now: the caller may reuse atomic_wr on return.
void wr_atomic_write(ibv_qp_ex* ex, uint32_t rkey, uint64_t remote, const void* atomic_wr) {
  begin_request(ex, IBV_WR_ATOMIC_WRITE).wr.rdma = {remote, rkey};
  BuiltRequest& built = to_qp(ex)->batch.back();
  const auto* bytes = static_cast<const uint8_t*>(atomic_wr);
  built.inline_bytes.assign(bytes, bytes + 8);
  built.wr.send_flags |= IBV_SEND_INLINE;
}
void wr_set_ud_addr(ibv_qp_ex* ex, ibv_ah* ah, uint32_t remote_qpn, uint32_t remote_qkey) {
  if (BuiltRequest* built = last_request(ex)) built->wr.wr.ud = {ah, remote_qpn, remote_qkey};
}
void wr_set_xrc_srqn(ibv_qp_ex* ex, uint32_t remote_srqn) {
  if (BuiltRequest* built = last_request(ex)) built->wr.qp_type.xrc.remote_srqn = remote_srqn;
}
void wr_set_sge(ibv_qp_ex* ex, uint32_t lkey, uint64_t addr, uint32_t length) {
  if (BuiltRequest* built = last_request(ex)) built->sges.assign(1, ibv_sge{addr, length, lkey});
}
void wr_set_sge_list(ibv_qp_ex* ex, size_t count, const ibv_sge* list) {
  if (BuiltRequest* built = last_request(ex)) built->sges.assign(list, list + count);
}
void wr_set_inline_data_list(ibv_qp_ex* ex, size_t count, const ibv_data_buf* buffers) {
  BuiltRequest* built = last_request(ex);
  if (built == nullptr) return;
  built->inline_bytes.clear();
  for (size_t i = 0; i < count; ++i) {
    const auto* bytes = static_cast<const uint8_t*>(buffers[i].addr);
    built->inline_bytes.insert(built->inline_bytes.end(), bytes, bytes + buffers[i].length);
  }
  built->wr.send_flags |= IBV_SEND_INLINE;
}
void wr_set_inline_data(ibv_qp_ex* ex, void* addr, size_t length) {
  ibv_data_buf buffer{addr, length};
  wr_set_inline_data_list(ex, 1, &buffer);
}

void wr_start(ibv_qp_ex* ex) {
  to_qp(ex)->batch.clear();
  to_qp(ex)->batch_error = 0;
}

void wr_abort(ibv_qp_ex* ex) { wr_start(ex); }

int wr_complete(ibv_qp_ex* ex) {
  ProviderQp* qp = to_qp(ex);
  int error = qp->batch_error;
  if (error == 0 && !qp->batch.empty()) {
    for (size_t i = 0; i < qp->batch.size(); ++i) {
      BuiltRequest& built = qp->batch[i];
      if (built.wr.send_flags & IBV_SEND_INLINE)
        built.sges.assign(1, ibv_sge{reinterpret_cast<uint64_t>(built.inline_bytes.data()),
                                     static_cast<uint32_t>(built.inline_bytes.size()), 0});
      built.wr.sg_list = built.sges.data();
      built.wr.num_sge = static_cast<int>(built.sges.size());
      built.wr.next = i + 1 < qp->batch.size() ? &qp->batch[i + 1].wr : nullptr;
    }
    ibv_send_wr* bad = nullptr;
    error =
        post_send_requests(&qp->verbs.qp, &qp->batch.front().wr, &bad, SendVerb::PostSend, nullptr, qp->batch.data());
  }
  wr_start(ex);
  return error;
}

constexpr uint64_t kSupportedSendOps = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_WRITE |
                                       IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ |
                                       IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD |
                                       IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV |
                                       IBV_QP_EX_WITH_SEND_WITH_INV | IBV_QP_EX_WITH_ATOMIC_WRITE;

}  // namespace

ibv_qp* create_qp_ex(ibv_context* context, ibv_qp_init_attr_ex* attr) {
  constexpr uint32_t kKnownMask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS |
                                  IBV_QP_INIT_ATTR_CREATE_FLAGS | IBV_QP_INIT_ATTR_MAX_TSO_HEADER;
  if (attr->qp_type == IBV_QPT_XRC_RECV) {
    // Made in an XRC domain, with no send queue: nothing else to ask for.
    if (attr->comp_mask & ~uint32_t{IBV_QP_INIT_ATTR_XRCD | IBV_QP_INIT_ATTR_PD}) {
      errno = EOPNOTSUPP;
      return nullptr;
    }
    return create_xrc_recv_qp(context, attr);
  }
  if (!(attr->comp_mask & IBV_QP_INIT_ATTR_PD) || attr->pd == nullptr || attr->pd->context != context) {
    errno = EINVAL;
    return nullptr;
  }
  const uint32_t create_flags = (attr->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) ? attr->create_flags : 0;
  // A UD QP with source QPN 1 is a CM agent: it sends and receives as QP1
  // (cm_routing.h), which is what the rdma_cm shim makes.
  const bool cm_agent = (create_flags & IBV_QP_CREATE_SOURCE_QPN) != 0;
  if (cm_agent && attr->qp_type != IBV_QPT_UD) {
    errno = EINVAL;
    return nullptr;
  }
  // Other creation flags, other source QPNs and TSO are not emulated;
  // asking for none of them is fine.
  if ((attr->comp_mask & ~kKnownMask) || (create_flags & ~uint32_t{IBV_QP_CREATE_SOURCE_QPN}) ||
      (cm_agent && attr->source_qpn != kGsiQpn) ||
      ((attr->comp_mask & IBV_QP_INIT_ATTR_MAX_TSO_HEADER) && attr->max_tso_header != 0) ||
      ((attr->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) && (attr->send_ops_flags & ~kSupportedSendOps)) ||
      // ATOMIC WRITE is a reliable-connection operation: RC and XRC (refused on UC and UD).
      ((attr->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) && (attr->send_ops_flags & IBV_QP_EX_WITH_ATOMIC_WRITE) &&
       attr->qp_type != IBV_QPT_RC && attr->qp_type != IBV_QPT_XRC_SEND)) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  ibv_qp_init_attr basic{};
  basic.qp_context = attr->qp_context;
  basic.send_cq = attr->send_cq;
  basic.recv_cq = attr->recv_cq;
  basic.srq = attr->srq;
  basic.cap = attr->cap;
  basic.qp_type = attr->qp_type;
  basic.sq_sig_all = attr->sq_sig_all;
  ibv_qp* ibv = create_qp(attr->pd, &basic);
  if (ibv == nullptr) return nullptr;
  attr->cap = basic.cap;
  if (cm_agent) {
    QpRecord& record = record_of(to_qp(ibv));
    SharedLock lock(record.lock);
    record.gsi_agent = 1;
  }
  if (attr->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) {
    ProviderQp* qp = to_qp(ibv);
    constexpr uint32_t kVerbsQpEx = 1u << 1;  // verbs_qp.comp_mask: ibv_qp_to_qp_ex() may hand out qp_ex
    qp->verbs.comp_mask |= kVerbsQpEx;
    ibv_qp_ex& ex = qp->verbs.qp_ex;
    ex.wr_send = wr_send;
    ex.wr_send_imm = wr_send_imm;
    ex.wr_rdma_write = wr_rdma_write;
    ex.wr_rdma_write_imm = wr_rdma_write_imm;
    ex.wr_rdma_read = wr_rdma_read;
    ex.wr_atomic_cmp_swp = wr_atomic_cmp_swp;
    ex.wr_atomic_fetch_add = wr_atomic_fetch_add;
    ex.wr_bind_mw = wr_bind_mw;
    ex.wr_local_inv = wr_local_inv;
    ex.wr_send_inv = wr_send_inv;
    ex.wr_atomic_write = wr_atomic_write;
    ex.wr_set_ud_addr = wr_set_ud_addr;
    ex.wr_set_xrc_srqn = wr_set_xrc_srqn;
    ex.wr_set_sge = wr_set_sge;
    ex.wr_set_sge_list = wr_set_sge_list;
    ex.wr_set_inline_data = wr_set_inline_data;
    ex.wr_set_inline_data_list = wr_set_inline_data_list;
    ex.wr_start = wr_start;
    ex.wr_complete = wr_complete;
    ex.wr_abort = wr_abort;
  }
  return ibv;
}

namespace {}  // namespace

}  // namespace softverbs::provider
