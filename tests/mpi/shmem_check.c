/* An OpenSHMEM program of our own for the middleware tests: Open MPI's
 * OpenSHMEM over UCX (spml ucx) carries puts and gets as RDMA WRITEs and
 * READs into the symmetric heap, and its atomics as RDMA atomics. Every PE
 * puts a pattern into its right neighbour's heap (blocking and non-blocking)
 * and gets it back, 1 B to 1 MiB; then all PEs fetch-and-add and
 * compare-and-swap on PE 0's counters at once, pass a token round the ring
 * with put, fence and wait_until, and reduce and broadcast. PE 0 prints one
 * line per part; any mismatch is reported and the exit status is non-zero. */
#include <shmem.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned char pattern(int from, size_t at, int round) {
  return (unsigned char)(from * 37 + at * 11 + (at >> 10) + round * 101);
}

static long reduce_sync[SHMEM_REDUCE_SYNC_SIZE];
static long reduce_work[SHMEM_REDUCE_MIN_WRKDATA_SIZE];
static long broadcast_sync[SHMEM_BCAST_SYNC_SIZE];
static long contribution, total;
static long broadcast_value[4];

int main(void) {
  shmem_init();
  const int me = shmem_my_pe(), pes = shmem_n_pes();
  const int right = (me + 1) % pes, left = (me + pes - 1) % pes;
  int failures = 0;

  const size_t largest = (size_t)1 << 20;
  unsigned char* heap = shmem_malloc(largest);
  unsigned char* out = malloc(largest);
  unsigned char* back = malloc(largest);
  int round = 0;
  for (size_t bytes = 1; bytes <= largest; bytes *= 4, ++round) {
    for (size_t i = 0; i < bytes; ++i) out[i] = pattern(me, i, round);
    if (round % 2 == 0) {
      shmem_putmem(heap, out, bytes, right);
    } else {
      shmem_putmem_nbi(heap, out, bytes, right);
      shmem_quiet();
    }
    shmem_barrier_all();
    for (size_t i = 0; i < bytes; ++i)
      if (heap[i] != pattern(left, i, round)) {
        if (failures++ < 5) fprintf(stderr, "pe %d: put %zu B, byte %zu is %u\n", me, bytes, i, heap[i]);
        break;
      }
    memset(back, 0, bytes);
    shmem_getmem(back, heap, bytes, right);
    if (memcmp(back, out, bytes) != 0 && failures++ < 5) fprintf(stderr, "pe %d: get %zu B differs\n", me, bytes);
    shmem_barrier_all();
    if (me == 0 && bytes * 4 > largest) printf("put and get %zu B: checked\n", bytes);
  }

  /* Every PE adds into PE 0's counter and takes a ticket with
   * compare-and-swap, all at once. */
  long* counter = shmem_malloc(sizeof(long));
  long* tickets = shmem_malloc(sizeof(long));
  *counter = 0;
  *tickets = 0;
  shmem_barrier_all();
  const int adds = 500;
  for (int i = 0; i < adds; ++i) {
    const long before = shmem_long_atomic_fetch_add(counter, 1, 0);
    if ((before < 0 || before >= (long)adds * pes) && failures++ < 5) fprintf(stderr, "pe %d: fetched %ld\n", me, before);
  }
  int taken = 0;
  for (int i = 0; i < adds; ++i) {
    const long seen = shmem_long_atomic_fetch(tickets, 0);
    if (shmem_long_atomic_compare_swap(tickets, seen, seen + 1, 0) == seen) ++taken;
  }
  long* taken_by = shmem_malloc(sizeof(long) * (size_t)pes);
  shmem_barrier_all();
  shmem_long_p(&taken_by[me], taken, 0);
  shmem_barrier_all();
  if (me == 0) {
    long all_taken = 0;
    for (int pe = 0; pe < pes; ++pe) all_taken += taken_by[pe];
    if (*counter != (long)adds * pes) failures++, fprintf(stderr, "counter is %ld\n", *counter);
    if (*tickets != all_taken) failures++, fprintf(stderr, "tickets %ld, taken %ld\n", *tickets, all_taken);
    if (failures == 0) printf("atomics over %d PEs: checked\n", pes);
  }

  /* A token round the ring: each PE waits for its flag, then passes its
   * number on; the fence orders the token before the flag. */
  int* token = shmem_malloc(sizeof(int));
  long* flag = shmem_malloc(sizeof(long));
  *token = -1;
  *flag = 0;
  shmem_barrier_all();
  if (me != 0) {
    shmem_long_wait_until(flag, SHMEM_CMP_EQ, 1);
    if (*token != left && failures++ < 5) fprintf(stderr, "pe %d: token %d from %d\n", me, *token, left);
  }
  if (right != 0) {
    shmem_int_p(token, me, right);
    shmem_fence();
    shmem_long_p(flag, 1, right);
  }
  shmem_barrier_all();
  if (me == 0) printf("token ring over %d PEs: checked\n", pes);

  for (int i = 0; i < SHMEM_REDUCE_SYNC_SIZE; ++i) reduce_sync[i] = SHMEM_SYNC_VALUE;
  for (int i = 0; i < SHMEM_BCAST_SYNC_SIZE; ++i) broadcast_sync[i] = SHMEM_SYNC_VALUE;
  contribution = me + 1;
  if (me == 0)
    for (int i = 0; i < 4; ++i) broadcast_value[i] = 1000 + i;
  shmem_barrier_all();
  shmem_long_sum_to_all(&total, &contribution, 1, 0, 0, pes, reduce_work, reduce_sync);
  shmem_broadcast64(broadcast_value, broadcast_value, 4, 0, 0, 0, pes, broadcast_sync);
  if (total != (long)pes * (pes + 1) / 2 && failures++ < 5) fprintf(stderr, "pe %d: sum %ld\n", me, total);
  for (int i = 0; i < 4; ++i)
    if (broadcast_value[i] != 1000 + i && failures++ < 5) fprintf(stderr, "pe %d: broadcast %d\n", me, i);
  shmem_barrier_all();
  if (me == 0) printf("reduce and broadcast over %d PEs: %s\n", pes, failures ? "FAILED" : "checked");

  shmem_free(flag);
  shmem_free(token);
  shmem_free(taken_by);
  shmem_free(tickets);
  shmem_free(counter);
  shmem_free(heap);
  free(back);
  free(out);
  shmem_finalize();
  return failures != 0;
}
