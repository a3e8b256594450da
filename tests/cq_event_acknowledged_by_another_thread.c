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
  struct taken_cq_event s = take_a_cq_event();
  event_cq = s.cq;
  CHECKED(ibv_destroy_qp(s.a) == 0 && ibv_destroy_qp(s.b) == 0);
  pthread_t thread;
  CHECKED(pthread_create(&thread, NULL, acknowledge_later, NULL) == 0);
  CHECKED(ibv_destroy_cq(s.cq) == 0);
  if (atomic_load(&acknowledged)) printf("the destroy waited for the acknowledgement\n");
  pthread_join(thread, NULL);
  release_taken_cq_event(&s);
  return 0;
}
