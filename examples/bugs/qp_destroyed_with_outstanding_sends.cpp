// Bug: the application destroys a QP whose SEND is still outstanding (the
// peer has posted no receive, so the device keeps retrying it): the SEND
// never completes, and an HCA may still be reading its buffer. `softverbs
// run --check` reports qp-destroyed-with-outstanding-sends for WR id 9.
#include "loopback.h"

int main() {
  bugs::Loopback l = bugs::open_loopback();
  static char message[64];
  ibv_mr* message_mr = bugs::register_buffer(l, message, sizeof message);

  ibv_sge sge{reinterpret_cast<uintptr_t>(message), sizeof message, message_mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = 9;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(l.a, &wr, &bad)) bugs::fail("ibv_post_send");

  ibv_destroy_qp(l.a);  // the bug: its SEND is outstanding
  ibv_dereg_mr(message_mr);
  ibv_destroy_qp(l.b);
  ibv_destroy_cq(l.cq);
  ibv_dealloc_pd(l.pd);
  ibv_close_device(l.context);
  return 0;
}
