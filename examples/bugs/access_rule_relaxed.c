/* Bug: RDMA READs to a QP that was given max_dest_rd_atomic 0 (no
 * responder resources for READs or atomics). An HCA's responder rejects
 * the READ, which completes with IBV_WC_REM_INV_REQ_ERR; softverbs carries
 * it out. Check: access-rule, naming the QP and WR and saying which rule. */
#include "bug_support.h"

__attribute__((noinline)) static void post_read(struct ibv_qp* qp, struct ibv_mr* mr, char* buffer) {
  struct ibv_sge sge = {(uintptr_t)buffer, 8, mr->lkey};
  struct ibv_send_wr wr, *bad;
  memset(&wr, 0, sizeof wr);
  wr.wr_id = 7;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_READ;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = (uintptr_t)buffer + 32;
  wr.wr.rdma.rkey = mr->rkey;
  CHECKED(ibv_post_send(qp, &wr, &bad) == 0);
}

int main(void) {
  struct ibv_context* context = open_softverbs0();
  struct ibv_pd* pd = ibv_alloc_pd(context);
  struct ibv_cq* cq = ibv_create_cq(context, 8, NULL, NULL, 0);
  CHECKED(pd != NULL && cq != NULL);
  struct ibv_qp* a = create_rc_qp(pd, cq, cq, 2);
  struct ibv_qp* b = create_rc_qp(pd, cq, cq, 2);
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ;
  connect_rc_qp(a, b->qp_num, access, 1);
  connect_rc_qp(b, a->qp_num, access, 0); /* the bug: B takes no READs */
  static char buffer[64];
  struct ibv_mr* mr = ibv_reg_mr(pd, buffer, sizeof buffer, access);
  CHECKED(mr != NULL);
  printf("expect: QP 0x0*%x\n", a->qp_num);
  printf("expect: WR id 7\n");
  printf("expect: max_dest_rd_atomic 0\n");
  printf("expect: IBV_WC_REM_INV_REQ_ERR\n");
  fflush(stdout);

  post_read(a, mr, buffer);
  struct ibv_wc wc;
  CHECKED(wait_completion(cq, &wc) == IBV_WC_SUCCESS);

  ibv_destroy_qp(a);
  ibv_destroy_qp(b);
  ibv_dereg_mr(mr);
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  ibv_close_device(context);
  return 0;
}
