#include "rc_endpoint.h"

#include "qp_setup.h"

namespace softverbs::test {

ibv_context* open_softverbs0(int& gid_index, ibv_gid& gid) {
  ibv_context* context = open_softverbs0();
  gid_index = context ? ipv4_gid_index(context, &gid) : -1;
  return context;
}

Endpoint::~Endpoint() {
  if (qp_) ibv_destroy_qp(qp_);
  if (mr_) ibv_dereg_mr(mr_);
  if (cq_) ibv_destroy_cq(cq_);
  if (pd_) ibv_dealloc_pd(pd_);
  if (context_) ibv_close_device(context_);
}

bool Endpoint::open(size_t buffer_bytes, int depth) {
  owned_.assign(buffer_bytes, 0);
  return open(owned_.data(), owned_.size(), depth);
}

bool Endpoint::open(void* memory, size_t bytes, int depth) {
  buffer_ = static_cast<uint8_t*>(memory);
  buffer_bytes_ = bytes;
  context_ = open_softverbs0(gid_index_, gid_);
  if (!context_) return false;
  pd_ = ibv_alloc_pd(context_);
  cq_ = ibv_create_cq(context_, depth * 2, nullptr, nullptr, 0);
  if (!pd_ || !cq_ || gid_index_ < 0) return false;
  mr_ = ibv_reg_mr(pd_, buffer_, buffer_bytes_, kAllAccess);
  ibv_qp_init_attr init{};
  init.send_cq = init.recv_cq = cq_;
  init.qp_type = IBV_QPT_RC;
  init.cap = {static_cast<uint32_t>(depth), static_cast<uint32_t>(depth), kMaxSendSges, 1, 0};
  qp_ = mr_ ? ibv_create_qp(pd_, &init) : nullptr;
  return mr_ && qp_;
}

ConnectInfo Endpoint::info() const {
  ConnectInfo info;
  info.qpn = qp_->qp_num;
  info.psn = 0xfffff0;  // near the wrap, so that PSNs roll over during the test
  info.gid = gid_;
  info.address = reinterpret_cast<uint64_t>(buffer_);
  info.rkey = mr_->rkey;
  return info;
}

bool Endpoint::connect(const ConnectInfo& peer, uint8_t timeout, uint8_t retry_count) {
  PeerPath path;
  path.qpn = peer.qpn;
  path.psn = peer.psn;
  path.gid = peer.gid;
  path.sgid_index = static_cast<uint8_t>(gid_index_);
  RcTiming timing;
  timing.timeout = timeout;
  timing.retry_count = retry_count;
  timing.rnr_retry = rnr_retry;
  return to_init(qp_, IBV_QPT_RC, kAllAccess) == 0 && to_rtr(qp_, IBV_QPT_RC, path) == 0 &&
         to_rts(qp_, IBV_QPT_RC, info().psn, timing) == 0;
}

int Endpoint::post_send(uint64_t wr_id, size_t offset, uint32_t length, ibv_wr_opcode opcode, const ConnectInfo* peer,
                        uint64_t add) {
  return post(wr_id, offset, length, opcode, peer, offset, add);
}

int Endpoint::post_write(uint64_t wr_id, size_t local_offset, uint32_t length, const ConnectInfo& peer,
                         uint64_t remote_offset) {
  return post(wr_id, local_offset, length, IBV_WR_RDMA_WRITE, &peer, remote_offset, 0);
}

int Endpoint::post_recv(uint64_t wr_id, size_t offset, uint32_t length) {
  ibv_sge sge{reinterpret_cast<uint64_t>(buffer_ + offset), length, mr_->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  return ibv_post_recv(qp_, &wr, &bad);
}

ibv_qp_state Endpoint::state() {
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  ibv_query_qp(qp_, &attr, IBV_QP_STATE, &init);
  return attr.qp_state;
}

int Endpoint::post(uint64_t wr_id, size_t local_offset, uint32_t length, ibv_wr_opcode opcode, const ConnectInfo* peer,
                   uint64_t remote_offset, uint64_t add) {
  ibv_sge sge{reinterpret_cast<uint64_t>(buffer_ + local_offset), length, mr_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = opcode;
  wr.send_flags = IBV_SEND_SIGNALED;
  if (peer && opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) {
    wr.wr.atomic.remote_addr = peer->address + remote_offset;
    wr.wr.atomic.compare_add = add;
    wr.wr.atomic.rkey = peer->rkey;
  } else if (peer) {
    wr.wr.rdma.remote_addr = peer->address + remote_offset;
    wr.wr.rdma.rkey = peer->rkey;
  }
  ibv_send_wr* bad = nullptr;
  return ibv_post_send(qp_, &wr, &bad);
}

}  // namespace softverbs::test
