// For the adversarial examples: RC QPs of one process connected to one
// another over the device's port (GID 0), with plain libibverbs calls.
#pragma once

#include <infiniband/verbs.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "loopback.h"

namespace bugs {

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

// A pair of connected RC QPs on `cq`.
struct QpPair {
  ibv_qp* a;
  ibv_qp* b;
  QpPair(Device& device, ibv_cq* cq) : a(create_rc_qp(device, cq)), b(create_rc_qp(device, cq)) {
    connect(a, b->qp_num, device.gid);
    connect(b, a->qp_num, device.gid);
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
inline ibv_wc wait_success(ibv_cq* cq) {
  ibv_wc wc = wait_completion(cq);
  if (wc.status != IBV_WC_SUCCESS) {
    std::fprintf(stderr, "completion failed: %s\n", ibv_wc_status_str(wc.status));
    std::exit(2);
  }
  return wc;
}

}  // namespace bugs
