// Bug: the application deregisters the memory region of a SEND that is
// still outstanding (its peer has posted no receive yet, so the device
// keeps retrying it). An HCA then completes it with a protection error, or
// reads memory that is no longer the application's. `softverbs run
// --check` reports mr-deregistered-in-use for WR id 5.
#include "loopback.h"

int main() {
  bugs::Loopback l = bugs::open_loopback();
  static char message[64], receive[64];
  ibv_mr* message_mr = bugs::register_buffer(l, message, sizeof message);
  ibv_mr* receive_mr = bugs::register_buffer(l, receive, sizeof receive);

  ibv_sge sge{reinterpret_cast<uintptr_t>(message), sizeof message, message_mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = 5;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(l.a, &wr, &bad)) bugs::fail("ibv_post_send");
  ibv_dereg_mr(message_mr);  // the bug: the SEND is still outstanding (no receive at the peer)

  ibv_sge receive_sge{reinterpret_cast<uintptr_t>(receive), sizeof receive, receive_mr->lkey};
  ibv_recv_wr receive_wr{};
  receive_wr.wr_id = 6;
  receive_wr.sg_list = &receive_sge;
  receive_wr.num_sge = 1;
  ibv_recv_wr* bad_receive = nullptr;
  if (ibv_post_recv(l.b, &receive_wr, &bad_receive)) bugs::fail("ibv_post_recv");
  ibv_wc wc = bugs::wait_completion(l.cq);
  std::printf("WR %llu: %s\n", static_cast<unsigned long long>(wc.wr_id), ibv_wc_status_str(wc.status));

  ibv_dereg_mr(receive_mr);
  bugs::close_loopback(l);
  return 0;
}
