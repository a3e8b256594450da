/* An MPI program of our own for the middleware tests: one-sided
 * communication, which Open MPI's osc components carry as RDMA WRITEs, READs
 * and atomics. Every rank puts a pattern into its right neighbour's window
 * and reads its left neighbour's back (fence epochs, up to 1 MiB), then all
 * ranks add into rank 0's counters at once with MPI_Fetch_and_op and
 * MPI_Accumulate, and take turns with MPI_Compare_and_swap (passive target).
 * Prints one line per part (rank 0) and exits non-zero on any mismatch. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned char pattern(int from, size_t at, int round) {
  return (unsigned char)(from * 37 + at * 11 + (at >> 10) + round * 101);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0, failures = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;

  const size_t largest = (size_t)1 << 20;
  unsigned char* exposed = NULL;
  MPI_Win window;
  MPI_Win_allocate((MPI_Aint)largest, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &exposed, &window);
  unsigned char* out = malloc(largest);
  unsigned char* back = malloc(largest);
  int round = 0;
  for (size_t bytes = 8; bytes <= largest; bytes *= 8, ++round) {
    for (size_t i = 0; i < bytes; ++i) out[i] = pattern(rank, i, round);
    memset(back, 0, bytes);
    MPI_Win_fence(0, window);
    MPI_Put(out, (int)bytes, MPI_BYTE, right, 0, (int)bytes, MPI_BYTE, window);
    MPI_Win_fence(0, window);
    for (size_t i = 0; i < bytes; ++i)
      if (exposed[i] != pattern(left, i, round)) {
        if (failures++ < 5) fprintf(stderr, "rank %d: put %zu B, byte %zu is %u\n", rank, bytes, i, exposed[i]);
        break;
      }
    /* Read back what this rank put into its right neighbour. */
    MPI_Get(back, (int)bytes, MPI_BYTE, right, 0, (int)bytes, MPI_BYTE, window);
    MPI_Win_fence(0, window);
    if (memcmp(back, out, bytes) != 0 && failures++ < 5) fprintf(stderr, "rank %d: get %zu B differs\n", rank, bytes);
    if (rank == 0) printf("put and get %zu B: checked\n", bytes);
  }
  MPI_Win_free(&window);

  /* Counters on rank 0: [0] fetch-and-add, [1] accumulate, [2] the
   * compare-and-swap token. */
  int64_t* counters = NULL;
  MPI_Win_allocate(3 * sizeof(int64_t), sizeof(int64_t), MPI_INFO_NULL, MPI_COMM_WORLD, &counters, &window);
  /* Rank 0's own loads and stores of its window, in an epoch of its own. */
  MPI_Win_lock(MPI_LOCK_EXCLUSIVE, rank, 0, window);
  counters[0] = counters[1] = counters[2] = 0;
  MPI_Win_unlock(rank, window);
  MPI_Barrier(MPI_COMM_WORLD);
  const int adds = 1000;
  int64_t one = 1, fetched = 0;
  MPI_Win_lock_all(0, window);
  for (int i = 0; i < adds; ++i) {
    MPI_Fetch_and_op(&one, &fetched, MPI_INT64_T, 0, 0, MPI_SUM, window);
    MPI_Win_flush(0, window);
    if (fetched < 0 || fetched >= (int64_t)adds * size) failures++;
    int64_t value = rank + 1;
    MPI_Accumulate(&value, 1, MPI_INT64_T, 0, 1, 1, MPI_INT64_T, MPI_SUM, window);
  }
  MPI_Win_flush(0, window);
  /* Each rank swaps the token from its left neighbour's number to its own,
   * in rank order: rank r waits until it reads r. */
  int64_t expected = rank, mine = rank + 1, seen = -1;
  for (;;) {
    MPI_Compare_and_swap(&mine, &expected, &seen, MPI_INT64_T, 0, 2, window);
    MPI_Win_flush(0, window);
    if (seen == expected) break;
    if (seen > expected) {
      failures++;
      break;
    }
  }
  MPI_Win_unlock_all(window);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) {
    MPI_Win_lock(MPI_LOCK_EXCLUSIVE, 0, 0, window);
    const int64_t sum_of_values = (int64_t)adds * size * (size + 1) / 2;
    if (counters[0] != (int64_t)adds * size) {
      failures++;
      fprintf(stderr, "fetch-and-add: %lld, not %lld\n", (long long)counters[0], (long long)adds * size);
    }
    if (counters[1] != sum_of_values) {
      failures++;
      fprintf(stderr, "accumulate: %lld, not %lld\n", (long long)counters[1], (long long)sum_of_values);
    }
    if (counters[2] != size) {
      failures++;
      fprintf(stderr, "compare-and-swap token: %lld, not %d\n", (long long)counters[2], size);
    }
    MPI_Win_unlock(0, window);
  }
  MPI_Win_free(&window);
  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) printf("atomics over %d ranks: %s\n", size, total == 0 ? "checked" : "WRONG");
  free(out);
  free(back);
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
