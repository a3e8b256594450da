// A small program for the trace tests: two RC QPs of softverbs0 connected
// to each other; QP 1 SENDs, then posts an RDMA WRITE and a SEND. With
// --bad-rkey the WRITE names an rkey that does not exist: it completes with
// IBV_WC_REM_ACCESS_ERR and the SEND behind it is flushed, which is the one
// difference the traces of the two runs must show. With --leave-at-once it
// leaves through _exit() once the SENDs completed, destroying nothing.
#include <infiniband/verbs.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "qp_setup.h"

namespace {

using namespace softverbs::test;

// Polls `cq` until `count` completions came; false after 10 s.
bool reap(ibv_cq* cq, int count) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (count > 0) {
    ibv_wc wc[4];
    const int n = ibv_poll_cq(cq, 4, wc);
    if (n < 0) return false;
    count -= n;
    if (std::chrono::steady_clock::now() > deadline) return false;
  }
  return true;
}

int fail(const char* what) {
  std::fprintf(stderr, "trace_example: %s\n", what);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const bool bad_rkey = argc > 1 && std::strcmp(argv[1], "--bad-rkey") == 0;
  const bool leave_at_once = argc > 1 && std::strcmp(argv[1], "--leave-at-once") == 0;
  ibv_context* context = open_softverbs0();
  if (context == nullptr) return fail("no softverbs0");
  ibv_pd* pd = ibv_alloc_pd(context);
  std::vector<char> buffer(8192);
  ibv_mr* mr = ibv_reg_mr(pd, buffer.data(), buffer.size(), kAllAccess);
  ibv_cq* cq_a = ibv_create_cq(context, 16, nullptr, nullptr, 0);
  ibv_cq* cq_b = ibv_create_cq(context, 16, nullptr, nullptr, 0);
  if (pd == nullptr || mr == nullptr || cq_a == nullptr || cq_b == nullptr) return fail("cannot create objects");
  ibv_qp_init_attr attr{};
  attr.qp_type = IBV_QPT_RC;
  attr.cap = {8, 8, 1, 1, 0};
  attr.send_cq = attr.recv_cq = cq_a;
  ibv_qp* a = ibv_create_qp(pd, &attr);
  attr.send_cq = attr.recv_cq = cq_b;
  ibv_qp* b = ibv_create_qp(pd, &attr);
  if (a == nullptr || b == nullptr) return fail("cannot create QPs");
  if (to_init(a, IBV_QPT_RC, kAllAccess) != 0 || to_init(b, IBV_QPT_RC, kAllAccess) != 0 ||
      to_rtr(a, IBV_QPT_RC, b->qp_num) != 0 || to_rtr(b, IBV_QPT_RC, a->qp_num) != 0 || to_rts(a, IBV_QPT_RC) != 0 ||
      to_rts(b, IBV_QPT_RC) != 0)
    return fail("cannot connect the QPs");

  ibv_sge receive_sge{reinterpret_cast<uintptr_t>(buffer.data() + 4096), 64, mr->lkey};
  for (uint64_t id = 1; id <= 3; ++id) {
    ibv_recv_wr receive{};
    receive.wr_id = id;
    receive.sg_list = &receive_sge;
    receive.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    if (ibv_post_recv(b, &receive, &bad) != 0) return fail("cannot post receives");
  }
  ibv_sge send_sge{reinterpret_cast<uintptr_t>(buffer.data()), 64, mr->lkey};
  ibv_send_wr send{};
  send.wr_id = 1;
  send.sg_list = &send_sge;
  send.num_sge = 1;
  send.opcode = IBV_WR_SEND;
  send.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(a, &send, &bad) != 0 || !reap(cq_a, 1) || !reap(cq_b, 1)) return fail("the first SEND failed");

  ibv_send_wr write{}, second = send;
  write.wr_id = 2;
  write.sg_list = &send_sge;
  write.num_sge = 1;
  write.opcode = IBV_WR_RDMA_WRITE;
  write.send_flags = IBV_SEND_SIGNALED;
  write.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(buffer.data() + 2048);
  write.wr.rdma.rkey = bad_rkey ? ~mr->rkey : mr->rkey;
  write.next = &second;
  second.wr_id = 3;
  if (ibv_post_send(a, &write, &bad) != 0 || !reap(cq_a, 2)) return fail("the WRITE and SEND did not complete");
  if (!bad_rkey && !reap(cq_b, 1)) return fail("the second SEND did not arrive");
  if (leave_at_once) _exit(0);

  // The end: both QPs to the error state, which flushes what b still holds.
  ibv_qp_attr error{};
  error.qp_state = IBV_QPS_ERR;
  if (ibv_modify_qp(a, &error, IBV_QP_STATE) != 0 || ibv_modify_qp(b, &error, IBV_QP_STATE) != 0)
    return fail("cannot move the QPs to the error state");
  if (!reap(cq_b, bad_rkey ? 2 : 1)) return fail("the receives were not flushed");
  ibv_destroy_qp(a);
  ibv_destroy_qp(b);
  ibv_destroy_cq(cq_a);
  ibv_destroy_cq(cq_b);
  ibv_dereg_mr(mr);
  ibv_dealloc_pd(pd);
  ibv_close_device(context);
  return 0;
}
