/* A correct program for the verbs checker's tests (check_tools_test): a
 * completion event taken with ibv_get_cq_event is acknowledged by another
 * thread while the main thread is already in ibv_destroy_cq, as programs
 * with an event thread do (UCX's async thread acknowledges so). libibverbs
 * on an HCA waits in the destroy for the acknowledgement; so must softverbs,
 * and `softverbs run --check=error` must report nothing. Prints "the destroy
 * waited for the acknowledgement" and exits 0 when it did. */
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "bug_support.h"

static struct ibv_cq* event_cq;
static atomic_int acknowledged;

static void* acknowledge_later(void* unused) {
  (void)unused;
  usleep(200 * 1000);
  atomic_store(&acknowledged, 1);
  ibv_ack_cq_events(event_cq, 1);
  return NULL;
}

int main(void) {
  struct ibv_context* context = open_softverbs0();
  struct ibv_pd* pd = ibv_alloc_pd(context);
  struct ibv_comp_channel* channel = ibv_create_comp_channel(context);
  CHECKED(pd != NULL && channel != NULL);
  struct ibv_cq* cq = ibv_create_cq(context, 4, NULL, channel, 0);
  CHECKED(cq != NULL);
  struct ibv_qp* a = create_rc_qp(pd, cq, cq, 4);
  struct ibv_qp* b = create_rc_qp(pd, cq, cq, 4);
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  connect_rc_qp(a, b->qp_num, access, 1);
  connect_rc_qp(b, a->qp_num, access, 1);
  static char buffer[64];
  struct ibv_mr* mr = ibv_reg_mr(pd, buffer, sizeof buffer, access);
  CHECKED(mr != NULL);

  CHECKED(ibv_req_notify_cq(cq, 0) == 0);
  struct ibv_sge sge = {(uintptr_t)buffer, 8, mr->lkey};
  struct ibv_send_wr wr, *bad;
  memset(&wr, 0, sizeof wr);
  wr.wr_id = 1;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = (uintptr_t)buffer + 32;
  wr.wr.rdma.rkey = mr->rkey;
  CHECKED(ibv_post_send(a, &wr, &bad) == 0);
  void* event_context;
  CHECKED(ibv_get_cq_event(channel, &event_cq, &event_context) == 0);
  struct ibv_wc wc;
  CHECKED(wait_completion(cq, &wc) == IBV_WC_SUCCESS);

  CHECKED(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0);
  pthread_t thread;
  CHECKED(pthread_create(&thread, NULL, acknowledge_later, NULL) == 0);
  CHECKED(ibv_destroy_cq(cq) == 0);
  if (atomic_load(&acknowledged)) printf("the destroy waited for the acknowledgement\n");
  pthread_join(thread, NULL);
  ibv_dereg_mr(mr);
  ibv_destroy_comp_channel(channel);
  ibv_dealloc_pd(pd);
  ibv_close_device(context);
  return 0;
}
