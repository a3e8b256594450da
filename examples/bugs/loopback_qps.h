// For the adversarial examples: RC QPs of one process connected to one
// another over the device's port (GID 0), with plain libibverbs calls.
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

struct Device {
  ibv_context* context = nullptr;
  ibv_pd* pd = nullptr;
  ibv_gid gid{};

  // The device named by $IBV_DEVICE, else the first one.
  Device() {
    int count = 0;
    ibv_device** list = ibv_get_device_list(&count);
    if (list == nullptr || count == 0) fail("no RDMA device");
    const char* wanted = std::getenv("IBV_DEVICE");
    ibv_device* chosen = list[0];
    for (int i = 0; wanted && i < count; ++i)
      if (std::strcmp(ibv_get_device_name(list[i]), wanted) == 0) chosen = list[i];
    context = ibv_open_device(chosen);
    ibv_free_device_list(list);
    if (context == nullptr) fail("ibv_open_device");
    pd = ibv_alloc_pd(context);
    if (pd == nullptr) fail("ibv_alloc_pd");
    if (ibv_query_gid(context, 1, 0, &gid)) fail("ibv_query_gid");
  }
};

inline ibv_qp* create_rc_qp(Device& device, ibv_cq* cq) {
  ibv_qp_init_attr init{};
  init.send_cq = cq;
  init.recv_cq = cq;
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = 64;
  init.cap.max_recv_wr = 64;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  ibv_qp* qp = ibv_create_qp(device.pd, &init);
  if (qp == nullptr) fail("ibv_create_qp");
  return qp;
}

// Takes `qp` to RTS, connected to the QP numbered `remote_qpn` of this device.
inline void connect(Device& device, ibv_qp* qp, uint32_t remote_qpn) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.port_num = 1;
  attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (ibv_modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    fail("modify to INIT");
  attr = {};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = IBV_MTU_1024;
  attr.dest_qp_num = remote_qpn;
  attr.max_dest_rd_atomic = 1;
  attr.min_rnr_timer = 12;
  attr.ah_attr.is_global = 1;
  attr.ah_attr.grh.dgid = device.gid;
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
  attr.rnr_retry = 7;
  attr.max_rd_atomic = 1;
  if (ibv_modify_qp(qp, &attr,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC))
    fail("modify to RTS");
}

// A pair of connected RC QPs on `cq`.
struct QpPair {
  ibv_qp* a;
  ibv_qp* b;
  QpPair(Device& device, ibv_cq* cq) : a(create_rc_qp(device, cq)), b(create_rc_qp(device, cq)) {
    connect(device, a, b->qp_num);
    connect(device, b, a->qp_num);
  }
};

inline void post_write(ibv_qp* qp, ibv_mr* source, uint32_t length, uint64_t remote, uint32_t rkey, uint64_t wr_id) {
  ibv_sge sge{reinterpret_cast<uint64_t>(source->addr), length, source->lkey};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = remote;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(qp, &wr, &bad)) fail("ibv_post_send");
}

// Waits for one completion on `cq`; exits on an error status.
inline ibv_wc wait_completion(ibv_cq* cq) {
  ibv_wc wc{};
  int got;
  while ((got = ibv_poll_cq(cq, 1, &wc)) == 0) {
  }
  if (got < 0 || wc.status != IBV_WC_SUCCESS) {
    std::fprintf(stderr, "completion failed: %s\n", got < 0 ? "poll" : ibv_wc_status_str(wc.status));
    std::exit(2);
  }
  return wc;
}

}  // namespace bugs
