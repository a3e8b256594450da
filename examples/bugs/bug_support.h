/* What the deliberately buggy examples share: softverbs0, and RC QPs
 * connected to each other in this one process. Each example prints
 * "expect: ..." lines that its test looks for in the checker's report. */
#ifndef SOFTVERBS_EXAMPLES_BUG_SUPPORT_H
#define SOFTVERBS_EXAMPLES_BUG_SUPPORT_H

#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECKED(call)                                                   \
  do {                                                                  \
    if (!(call)) {                                                      \
      fprintf(stderr, "%s:%d: %s failed\n", __FILE__, __LINE__, #call); \
      exit(2);                                                          \
    }                                                                   \
  } while (0)

static inline struct ibv_context* open_softverbs0(void) {
  int count = 0;
  struct ibv_device** list = ibv_get_device_list(&count);
  struct ibv_context* context = NULL;
  for (int i = 0; list && i < count && !context; ++i)
    if (strcmp(ibv_get_device_name(list[i]), "softverbs0") == 0) context = ibv_open_device(list[i]);
  if (list) ibv_free_device_list(list);
  CHECKED(context != NULL);
  return context;
}

/* The RoCEv2 GID of an IPv4 address (softverbs0 has one). */
static inline int ipv4_gid_index(struct ibv_context* context, union ibv_gid* gid) {
  static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  for (int index = 0; index < 32; ++index) {
    struct ibv_gid_entry entry;
    if (ibv_query_gid_ex(context, 1, (uint32_t)index, &entry, 0) != 0) continue;
    if (entry.gid_type == IBV_GID_TYPE_ROCE_V2 && memcmp(entry.gid.raw, mapped, 12) == 0) {
      *gid = entry.gid;
      return index;
    }
  }
  return -1;
}

static inline struct ibv_qp* create_rc_qp(struct ibv_pd* pd, struct ibv_cq* send_cq, struct ibv_cq* recv_cq,
                                          uint32_t depth) {
  struct ibv_qp_init_attr init;
  memset(&init, 0, sizeof init);
  init.send_cq = send_cq;
  init.recv_cq = recv_cq;
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = depth;
  init.cap.max_recv_wr = depth;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  struct ibv_qp* qp = ibv_create_qp(pd, &init);
  CHECKED(qp != NULL);
  return qp;
}

/* Takes `qp` to RTS, connected to `peer` (another QP of this process).
 * `access`: its qp_access_flags; `rd_atomic`: its max_rd_atomic and
 * max_dest_rd_atomic. */
static inline void connect_rc_qp(struct ibv_qp* qp, uint32_t peer_qpn, int access, uint8_t rd_atomic) {
  union ibv_gid gid;
  const int gid_index = ipv4_gid_index(qp->context, &gid);
  CHECKED(gid_index >= 0);
  struct ibv_qp_attr attr;
  memset(&attr, 0, sizeof attr);
  attr.qp_state = IBV_QPS_INIT;
  attr.port_num = 1;
  attr.qp_access_flags = access;
  CHECKED(ibv_modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0);
  memset(&attr, 0, sizeof attr);
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = IBV_MTU_1024;
  attr.dest_qp_num = peer_qpn;
  attr.max_dest_rd_atomic = rd_atomic;
  attr.min_rnr_timer = 1;
  attr.ah_attr.port_num = 1;
  attr.ah_attr.is_global = 1;
  attr.ah_attr.grh.dgid = gid;
  attr.ah_attr.grh.sgid_index = (uint8_t)gid_index;
  attr.ah_attr.grh.hop_limit = 1;
  CHECKED(ibv_modify_qp(qp, &attr,
                        IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                            IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0);
  memset(&attr, 0, sizeof attr);
  attr.qp_state = IBV_QPS_RTS;
  attr.timeout = 14;
  attr.retry_cnt = 7;
  attr.rnr_retry = 7;
  attr.max_rd_atomic = rd_atomic;
  CHECKED(ibv_modify_qp(qp, &attr,
                        IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                            IBV_QP_MAX_QP_RD_ATOMIC) == 0);
}

/* Waits for one completion of `cq`; returns its status. */
static inline enum ibv_wc_status wait_completion(struct ibv_cq* cq, struct ibv_wc* wc) {
  int polled;
  while ((polled = ibv_poll_cq(cq, 1, wc)) == 0) {
  }
  CHECKED(polled == 1);
  return wc->status;
}

/* A CQ on a completion channel, an RC pair of this process on it, and one
 * signaled WRITE done: its completion event taken with ibv_get_cq_event and
 * not yet acknowledged. */
struct taken_cq_event {
  struct ibv_context* context;
  struct ibv_pd* pd;
  struct ibv_comp_channel* channel;
  struct ibv_cq* cq;
  struct ibv_qp* a;
  struct ibv_qp* b;
  struct ibv_mr* mr;
};

static inline struct taken_cq_event take_a_cq_event(void) {
  struct taken_cq_event s;
  s.context = open_softverbs0();
  s.pd = ibv_alloc_pd(s.context);
  s.channel = ibv_create_comp_channel(s.context);
  CHECKED(s.pd != NULL && s.channel != NULL);
  s.cq = ibv_create_cq(s.context, 4, NULL, s.channel, 0);
  CHECKED(s.cq != NULL);
  s.a = create_rc_qp(s.pd, s.cq, s.cq, 4);
  s.b = create_rc_qp(s.pd, s.cq, s.cq, 4);
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  connect_rc_qp(s.a, s.b->qp_num, access, 1);
  connect_rc_qp(s.b, s.a->qp_num, access, 1);
  static char buffer[64];
  s.mr = ibv_reg_mr(s.pd, buffer, sizeof buffer, access);
  CHECKED(s.mr != NULL);

  CHECKED(ibv_req_notify_cq(s.cq, 0) == 0);
  struct ibv_sge sge = {(uintptr_t)buffer, 8, s.mr->lkey};
  struct ibv_send_wr wr, *bad;
  memset(&wr, 0, sizeof wr);
  wr.wr_id = 1;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = (uintptr_t)buffer + 32;
  wr.wr.rdma.rkey = s.mr->rkey;
  CHECKED(ibv_post_send(s.a, &wr, &bad) == 0);
  struct ibv_cq* event_cq;
  void* event_context;
  CHECKED(ibv_get_cq_event(s.channel, &event_cq, &event_context) == 0 && event_cq == s.cq);
  struct ibv_wc wc;
  CHECKED(wait_completion(s.cq, &wc) == IBV_WC_SUCCESS);
  return s;
}

/* What take_a_cq_event made besides the CQ and the QPs. */
static inline void release_taken_cq_event(struct taken_cq_event* s) {
  ibv_dereg_mr(s->mr);
  ibv_destroy_comp_channel(s->channel);
  ibv_dealloc_pd(s->pd);
  ibv_close_device(s->context);
}

#endif
