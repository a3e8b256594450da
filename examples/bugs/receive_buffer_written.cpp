// Bug: the application writes into a receive buffer it has posted (here it
// sets a "not yet received" flag at the end of the buffer) before the
// receive's completion. An HCA may place the message over it at any moment
// until the completion. `softverbs run --check` reports
// receive-buffer-written for WR id 7 (the receive).
#include "loopback.h"

int main() {
  bugs::Loopback l = bugs::open_loopback();
  static char message[64], receive[256];
  std::memset(message, 'm', sizeof message);
  ibv_mr* message_mr = bugs::register_buffer(l, message, sizeof message);
  ibv_mr* receive_mr = bugs::register_buffer(l, receive, sizeof receive);

  ibv_sge receive_sge{reinterpret_cast<uintptr_t>(receive), sizeof receive, receive_mr->lkey};
  ibv_recv_wr receive_wr{};
  receive_wr.wr_id = 7;
  receive_wr.sg_list = &receive_sge;
  receive_wr.num_sge = 1;
  ibv_recv_wr* bad_receive = nullptr;
  if (ibv_post_recv(l.b, &receive_wr, &bad_receive)) bugs::fail("ibv_post_recv");
  receive[sizeof receive - 1] = 1;  // the bug: the buffer belongs to the device now

  ibv_sge sge{reinterpret_cast<uintptr_t>(message), sizeof message, message_mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = 1;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(l.a, &wr, &bad)) bugs::fail("ibv_post_send");
  for (int i = 0; i < 2; ++i) {
    ibv_wc wc = bugs::wait_completion(l.cq);
    std::printf("WR %llu: %s\n", static_cast<unsigned long long>(wc.wr_id), ibv_wc_status_str(wc.status));
  }

  ibv_dereg_mr(message_mr);
  ibv_dereg_mr(receive_mr);
  bugs::close_loopback(l);
  return 0;
}
