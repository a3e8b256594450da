/* Bug: registered memory given back to the system while its memory region
 * is live. On an HCA the region keeps the old pages pinned and the device
 * reads and writes them, unseen by whatever is mapped at that address
 * next. Check: registered-memory-freed (twice: munmap, then free of a
 * large, mmap-backed malloc chunk). */
#include <sys/mman.h>

#include "bug_support.h"

enum { kMappedBytes = 64 * 1024, kMallocBytes = 4 * 1024 * 1024 };

__attribute__((noinline)) static void unmap_while_registered(struct ibv_pd* pd) {
  void* buffer = mmap(NULL, kMappedBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECKED(buffer != MAP_FAILED);
  struct ibv_mr* mr = ibv_reg_mr(pd, buffer, kMappedBytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  CHECKED(mr != NULL);
  munmap(buffer, kMappedBytes); /* the bug: the region still covers it */
  CHECKED(ibv_dereg_mr(mr) == 0);
}

__attribute__((noinline)) static void free_while_registered(struct ibv_pd* pd) {
  /* Large enough that glibc's malloc maps it on its own. */
  char* buffer = malloc(kMallocBytes);
  CHECKED(buffer != NULL);
  memset(buffer, 1, kMallocBytes);
  struct ibv_mr* mr = ibv_reg_mr(pd, buffer, kMallocBytes, IBV_ACCESS_LOCAL_WRITE);
  CHECKED(mr != NULL);
  free(buffer); /* the bug: the region still covers it */
  CHECKED(ibv_dereg_mr(mr) == 0);
}

int main(void) {
  struct ibv_context* context = open_softverbs0();
  struct ibv_pd* pd = ibv_alloc_pd(context);
  CHECKED(pd != NULL);
  unmap_while_registered(pd);
  free_while_registered(pd);
  ibv_dealloc_pd(pd);
  ibv_close_device(context);
  return 0;
}
