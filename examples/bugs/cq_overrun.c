/* Bug: a CQ smaller than the completions its QP can have outstanding. Two
 * signaled WRITEs into a CQ of one entry, polled only afterwards: the
 * second completion does not fit. An HCA raises IBV_EVENT_CQ_ERR and moves
 * the QP to the error state; so does softverbs. Check: cq-overrun, naming
 * the QP and the WR whose completion was lost. */
#include "bug_support.h"

__attribute__((noinline)) static void post_two_writes(struct ibv_qp* qp, struct ibv_mr* mr, char* buffer) {
  for (uint64_t wr_id = 1; wr_id <= 2; ++wr_id) {
    struct ibv_sge sge = {(uintptr_t)buffer, 8, mr->lkey};
    struct ibv_send_wr wr, *bad;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = (uintptr_t)buffer + 32;
    wr.wr.rdma.rkey = mr->rkey;
    CHECKED(ibv_post_send(qp, &wr, &bad) == 0);
  }
}

int main(void) {
  struct ibv_context* context = open_softverbs0();
  struct ibv_pd* pd = ibv_alloc_pd(context);
  CHECKED(pd != NULL);
  struct ibv_cq* tiny = ibv_create_cq(context, 1, NULL, NULL, 0); /* the bug: one entry for two WRs */
  struct ibv_cq* other = ibv_create_cq(context, 4, NULL, NULL, 0);
  CHECKED(tiny != NULL && other != NULL);
  struct ibv_qp* a = create_rc_qp(pd, tiny, tiny, 2);
  struct ibv_qp* b = create_rc_qp(pd, other, other, 2);
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  connect_rc_qp(a, b->qp_num, access, 1);
  connect_rc_qp(b, a->qp_num, access, 1);
  static char buffer[64];
  struct ibv_mr* mr = ibv_reg_mr(pd, buffer, sizeof buffer, access);
  CHECKED(mr != NULL);
  printf("expect: QP 0x0*%x\n", a->qp_num);
  printf("expect: WR id 2\n");
  fflush(stdout);

  post_two_writes(a, mr, buffer);
  /* The CQ error and the QP's fatal error arrive as async events. */
  for (int seen = 0; seen < 2; ++seen) {
    struct ibv_async_event event;
    CHECKED(ibv_get_async_event(context, &event) == 0);
    ibv_ack_async_event(&event);
  }
  struct ibv_wc wc;
  CHECKED(wait_completion(tiny, &wc) == IBV_WC_SUCCESS && wc.wr_id == 1);

  ibv_destroy_qp(a);
  ibv_destroy_qp(b);
  ibv_dereg_mr(mr);
  ibv_destroy_cq(tiny);
  ibv_destroy_cq(other);
  ibv_dealloc_pd(pd);
  ibv_close_device(context);
  return 0;
}
