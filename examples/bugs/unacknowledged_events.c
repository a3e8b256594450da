/* Bug: a completion event taken with ibv_get_cq_event and never
 * acknowledged with ibv_ack_cq_events before ibv_destroy_cq. libibverbs on
 * an HCA waits in ibv_destroy_cq until every event is acknowledged: the
 * program hangs there. Check: unacknowledged-events. */
#include "bug_support.h"

__attribute__((noinline)) static void destroy_without_ack(struct ibv_cq* cq) {
  CHECKED(ibv_destroy_cq(cq) == 0); /* the bug: one event not acknowledged */
}

int main(void) {
  struct taken_cq_event s = take_a_cq_event();
  CHECKED(ibv_destroy_qp(s.a) == 0 && ibv_destroy_qp(s.b) == 0);
  destroy_without_ack(s.cq);
  release_taken_cq_event(&s);
  return 0;
}
