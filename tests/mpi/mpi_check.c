/* An MPI program of our own for the middleware tests: a ping-pong between
 * ranks 0 and 1 at every power of two from 8 B to 4 MiB, every byte of
 * every message checked, then an allreduce over all ranks. Prints one
 * line per size (rank 0) and exits non-zero on any mismatch. With an
 * argument, prints the 8-byte one-way latency in microseconds from
 * `iterations` round trips, for the benchmark. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned char pattern(int round, size_t at, int from) {
  return (unsigned char)(round * 131 + at * 7 + (at >> 9) + from * 29);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0, failures = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const size_t largest = (size_t)4 << 20;
  unsigned char* out = malloc(largest);
  unsigned char* in = malloc(largest);
  if (argc > 1) {
    const int iterations = atoi(argv[1]);
    double start = 0;
    /* Warm-up: the first few thousand round trips of a job over UCX's
     * verbs transports run slower (bench/NOTES.md). */
    for (int i = -10000; i < iterations; ++i) {
      if (i == 0) start = MPI_Wtime();
      if (rank == 0) {
        MPI_Send(out, 8, MPI_BYTE, 1, 0, MPI_COMM_WORLD);
        MPI_Recv(in, 8, MPI_BYTE, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else if (rank == 1) {
        MPI_Recv(in, 8, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(out, 8, MPI_BYTE, 0, 0, MPI_COMM_WORLD);
      }
    }
    if (rank == 0) printf("mpi one-way latency 8 B: %.3f us\n", (MPI_Wtime() - start) * 1e6 / iterations / 2);
    MPI_Finalize();
    return 0;
  }
  int round = 0;
  for (size_t bytes = 8; bytes <= largest; bytes *= 2, ++round) {
    const int repeats = bytes <= 65536 ? 20 : 3;
    for (int r = 0; r < repeats; ++r) {
      if (rank == 0) {
        for (size_t i = 0; i < bytes; ++i) out[i] = pattern(round + r, i, 0);
        MPI_Send(out, (int)bytes, MPI_BYTE, 1, round, MPI_COMM_WORLD);
        memset(in, 0, bytes);
        MPI_Recv(in, (int)bytes, MPI_BYTE, 1, round, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        for (size_t i = 0; i < bytes; ++i)
          if (in[i] != pattern(round + r, i, 1)) {
            if (failures++ < 5) fprintf(stderr, "rank 0: %zu B, byte %zu is %u\n", bytes, i, in[i]);
            break;
          }
      } else if (rank == 1) {
        memset(in, 0, bytes);
        MPI_Recv(in, (int)bytes, MPI_BYTE, 0, round, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        for (size_t i = 0; i < bytes; ++i)
          if (in[i] != pattern(round + r, i, 0)) {
            if (failures++ < 5) fprintf(stderr, "rank 1: %zu B, byte %zu is %u\n", bytes, i, in[i]);
            break;
          }
        for (size_t i = 0; i < bytes; ++i) out[i] = pattern(round + r, i, 1);
        MPI_Send(out, (int)bytes, MPI_BYTE, 0, round, MPI_COMM_WORLD);
      }
    }
    if (rank == 0) printf("ping-pong %zu B: checked\n", bytes);
  }
  /* Allreduce: each rank contributes rank + i at every position. */
  const int count = 1 << 16;
  long* values = malloc(count * sizeof(long));
  long* sums = malloc(count * sizeof(long));
  for (int i = 0; i < count; ++i) values[i] = rank + i;
  MPI_Allreduce(values, sums, count, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  for (int i = 0; i < count; ++i) {
    long expected = (long)size * (size - 1) / 2 + (long)size * i;
    if (sums[i] != expected) {
      if (failures++ < 5) fprintf(stderr, "rank %d: allreduce[%d] = %ld, not %ld\n", rank, i, sums[i], expected);
      break;
    }
  }
  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) printf("allreduce over %d ranks: %s\n", size, total == 0 ? "checked" : "WRONG");
  free(out);
  free(in);
  free(values);
  free(sums);
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
