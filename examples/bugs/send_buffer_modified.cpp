// Bug: the application reuses the source buffer of an RDMA WRITE before the
// WRITE's completion. An HCA reads the buffer by DMA at any moment until the
// completion, so the peer may get the old bytes, the new ones or a mix.
// `softverbs run --check` reports send-buffer-modified for WR id 42.
#include "loopback.h"

int main() {
  bugs::Loopback l = bugs::open_loopback();
  static char source[4096], target[4096];
  std::memset(source, 'a', sizeof source);
  ibv_mr* source_mr = bugs::register_buffer(l, source, sizeof source);
  ibv_mr* target_mr = bugs::register_buffer(l, target, sizeof target);

  ibv_sge sge{reinterpret_cast<uintptr_t>(source), sizeof source, source_mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = 42;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(target);
  wr.wr.rdma.rkey = target_mr->rkey;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(l.a, &wr, &bad)) bugs::fail("ibv_post_send");
  std::memset(source, 'b', 64);  // the bug: the next message is written before the completion
  ibv_wc wc = bugs::wait_completion(l.cq);
  std::printf("WRITE completed: %s\n", ibv_wc_status_str(wc.status));

  ibv_dereg_mr(source_mr);
  ibv_dereg_mr(target_mr);
  bugs::close_loopback(l);
  return 0;
}
