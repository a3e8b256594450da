// Bug: the application posts only unsignaled WRITEs and never asks for a
// completion. An HCA frees a send queue slot only when a later signaled
// completion is polled: after max_send_wr (8) posts the send queue is full
// and the next post fails with ENOMEM. `softverbs run --check` reports
// unsignaled-sends-not-reaped at the post that fills the queue (WR id 107).
#include "loopback.h"

int main() {
  bugs::Loopback l = bugs::open_loopback(/*max_send_wr=*/8);
  static char source[64], target[64];
  ibv_mr* source_mr = bugs::register_buffer(l, source, sizeof source);
  ibv_mr* target_mr = bugs::register_buffer(l, target, sizeof target);

  for (uint64_t i = 0; i < 8; ++i) {
    ibv_sge sge{reinterpret_cast<uintptr_t>(source), sizeof source, source_mr->lkey};
    ibv_send_wr wr{};
    wr.wr_id = 100 + i;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = 0;  // the bug: never IBV_SEND_SIGNALED
    wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(target);
    wr.wr.rdma.rkey = target_mr->rkey;
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(l.a, &wr, &bad)) bugs::fail("ibv_post_send");
  }
  std::printf("posted 8 unsignaled WRITEs\n");

  ibv_dereg_mr(source_mr);
  ibv_dereg_mr(target_mr);
  bugs::close_loopback(l);
  return 0;
}
