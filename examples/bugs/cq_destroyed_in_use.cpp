// Bug: the application tears down in the wrong order: the CQ before the
// QPs that complete on it (and the PD before its memory region). An HCA
// refuses both with EBUSY, which the application ignores, and the CQ and
// PD leak. `softverbs run --check` reports cq-destroyed-in-use and
// pd-deallocated-in-use, with the stack of the destroy.
#include "loopback.h"

int main() {
  bugs::Loopback l = bugs::open_loopback();
  static char buffer[64];
  ibv_mr* mr = bugs::register_buffer(l, buffer, sizeof buffer);

  ibv_destroy_cq(l.cq);  // the bug: two QPs still complete on it (EBUSY, ignored)
  ibv_dealloc_pd(l.pd);  // and this PD still has the QPs and the MR (EBUSY, ignored)
  ibv_destroy_qp(l.a);
  ibv_destroy_qp(l.b);
  ibv_dereg_mr(mr);
  ibv_destroy_cq(l.cq);
  ibv_dealloc_pd(l.pd);
  ibv_close_device(l.context);
  return 0;
}
