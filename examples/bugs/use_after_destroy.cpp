// Bug: the application posts on a QP it has destroyed. On an HCA (and on
// softverbs without --check) the QP's memory is freed and the call reads
// garbage or crashes; under `softverbs run --check` the destroyed QP is
// kept, the post fails with EINVAL and use-after-destroy is reported with
// the call site. Without --check this example skips the post, which would
// crash it.
#include "loopback.h"

int main() {
  bugs::Loopback l = bugs::open_loopback();
  static char message[64];
  ibv_mr* message_mr = bugs::register_buffer(l, message, sizeof message);
  ibv_qp* stale = l.a;
  ibv_destroy_qp(l.a);

  if (std::getenv("SOFTVERBS_CHECK") != nullptr) {
    ibv_sge sge{reinterpret_cast<uintptr_t>(message), sizeof message, message_mr->lkey};
    ibv_send_wr wr{};
    wr.wr_id = 11;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    ibv_send_wr* bad = nullptr;
    const int error = ibv_post_send(stale, &wr, &bad);  // the bug: `stale` was destroyed
    std::printf("ibv_post_send on the destroyed QP: %s\n", std::strerror(error));
  }

  ibv_destroy_qp(l.b);
  ibv_dereg_mr(message_mr);
  ibv_destroy_cq(l.cq);
  ibv_dealloc_pd(l.pd);
  ibv_close_device(l.context);
  return 0;
}
