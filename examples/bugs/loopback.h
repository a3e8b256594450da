// Two RC QPs of one process connected to each other on the first device
// (softverbs0 under `softverbs run`): the setup every example here shares.
// Each example is a small program with one deliberate verbs misuse that
// runs to exit 0 on its own and that `softverbs run --check` reports.
#pragma once

#include <infiniband/verbs.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace bugs {

[[noreturn]] inline void fail(const char* what) {
  std::perror(what);
  std::exit(2);
}

struct Loopback {
  ibv_context* context = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* a = nullptr;  // the application's QP
  ibv_qp* b = nullptr;  // its peer
};

inline ibv_qp* make_qp(const Loopback& l, uint32_t max_send_wr, bool signal_all) {
  ibv_qp_init_attr attr{};
  attr.send_cq = l.cq;
  attr.recv_cq = l.cq;
  attr.qp_type = IBV_QPT_RC;
  attr.sq_sig_all = signal_all ? 1 : 0;
  attr.cap.max_send_wr = max_send_wr;
  attr.cap.max_recv_wr = 16;
  attr.cap.max_send_sge = 1;
  attr.cap.max_recv_sge = 1;
  ibv_qp* qp = ibv_create_qp(l.pd, &attr);
  if (qp == nullptr) fail("ibv_create_qp");
  return qp;
}

// From RESET to RTS, connected to `peer_qpn` at `gid` (GID index
// `gid_index` of port 1 on both sides).
inline void connect(ibv_qp* qp, uint32_t peer_qpn, const ibv_gid& gid, uint8_t gid_index = 0) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.port_num = 1;
  attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (ibv_modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    fail("modify to INIT");
  attr = {};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = IBV_MTU_1024;
  attr.dest_qp_num = peer_qpn;
  attr.max_dest_rd_atomic = 1;
  attr.min_rnr_timer = 1;
  attr.ah_attr.is_global = 1;
  attr.ah_attr.grh.dgid = gid;
  attr.ah_attr.grh.sgid_index = gid_index;
  attr.ah_attr.grh.hop_limit = 1;
  attr.ah_attr.port_num = 1;
  if (ibv_modify_qp(qp, &attr,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    fail("modify to RTR");
  attr = {};
  attr.qp_state = IBV_QPS_RTS;
  attr.timeout = 14;
  attr.retry_cnt = 7;
  attr.rnr_retry = 7;  // an RNR waits for ever
  attr.max_rd_atomic = 1;
  if (ibv_modify_qp(qp, &attr,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC))
    fail("modify to RTS");
}

inline Loopback open_loopback(uint32_t max_send_wr = 16, bool signal_all = false) {
  Loopback l;
  int count = 0;
  ibv_device** devices = ibv_get_device_list(&count);
  if (devices == nullptr || count == 0) fail("no RDMA device");
  l.context = ibv_open_device(devices[0]);
  ibv_free_device_list(devices);
  if (l.context == nullptr) fail("ibv_open_device");
  l.pd = ibv_alloc_pd(l.context);
  l.cq = ibv_create_cq(l.context, 64, nullptr, nullptr, 0);
  if (l.pd == nullptr || l.cq == nullptr) fail("ibv_alloc_pd/ibv_create_cq");
  l.a = make_qp(l, max_send_wr, signal_all);
  l.b = make_qp(l, 16, false);
  ibv_gid gid;
  if (ibv_query_gid(l.context, 1, 0, &gid)) fail("ibv_query_gid");
  connect(l.a, l.b->qp_num, gid);
  connect(l.b, l.a->qp_num, gid);
  return l;
}

inline ibv_mr* register_buffer(const Loopback& l, void* buffer, size_t length) {
  ibv_mr* mr =
      ibv_reg_mr(l.pd, buffer, length, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  if (mr == nullptr) fail("ibv_reg_mr");
  return mr;
}

// Polls until a completion comes; returns it.
inline ibv_wc wait_completion(ibv_cq* cq) {
  ibv_wc wc{};
  int n;
  while ((n = ibv_poll_cq(cq, 1, &wc)) == 0) {
  }
  if (n < 0) fail("ibv_poll_cq");
  return wc;
}

inline void close_loopback(Loopback& l) {
  ibv_destroy_qp(l.a);
  ibv_destroy_qp(l.b);
  ibv_destroy_cq(l.cq);
  ibv_dealloc_pd(l.pd);
  ibv_close_device(l.context);
}

}  // namespace bugs
