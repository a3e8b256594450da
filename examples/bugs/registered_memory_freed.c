/* Bug: memory given back to the system while its memory region is live,
 * and the region used afterwards. On an HCA the region keeps the old pages
 * pinned: the device reads and writes them, unseen by whatever is mapped at
 * that address now (here the program maps new memory there and expects the
 * WRITE to send it). Check: registered-memory-freed (twice: after munmap,
 * after free of a large, mmap-backed malloc chunk), at the post that uses
 * the region. Giving the memory back alone is not reported: memory caches
 * (UCX's, libfabric's) keep such regions and drop them unused. */
#include <sys/mman.h>

#include "bug_support.h"

enum { kMappedBytes = 64 * 1024, kMallocBytes = 4 * 1024 * 1024 };

static char target[64];

static void post_write(struct ibv_qp* qp, struct ibv_mr* mr, void* source, struct ibv_mr* target_mr, uint64_t wr_id) {
  struct ibv_sge sge = {(uintptr_t)source, sizeof target, mr->lkey};
  struct ibv_send_wr wr, *bad;
  memset(&wr, 0, sizeof wr);
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = (uintptr_t)target;
  wr.wr.rdma.rkey = target_mr->rkey;
  CHECKED(ibv_post_send(qp, &wr, &bad) == 0);
}

__attribute__((noinline)) static void write_after_unmap(struct ibv_qp* qp, struct ibv_cq* cq,
                                                        struct ibv_mr* target_mr) {
  void* buffer = mmap(NULL, kMappedBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECKED(buffer != MAP_FAILED);
  struct ibv_mr* mr = ibv_reg_mr(qp->pd, buffer, kMappedBytes, IBV_ACCESS_LOCAL_WRITE);
  CHECKED(mr != NULL);
  munmap(buffer, kMappedBytes); /* the bug, part one: the region still covers it */
  void* again = mmap(buffer, kMappedBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECKED(again != MAP_FAILED);
  if (again == buffer) {
    memset(again, 'm', kMappedBytes);
    post_write(qp, mr, buffer, target_mr, 1); /* part two: the stale region is used */
    struct ibv_wc wc;
    wait_completion(cq, &wc);
  } else {
    puts("the new mapping landed elsewhere: no use of the stale region");
  }
  munmap(again, kMappedBytes);
  CHECKED(ibv_dereg_mr(mr) == 0);
}

__attribute__((noinline)) static void write_after_free(struct ibv_qp* qp, struct ibv_cq* cq, struct ibv_mr* target_mr) {
  /* Large enough that glibc's malloc maps it on its own. */
  char* buffer = malloc(kMallocBytes);
  CHECKED(buffer != NULL);
  memset(buffer, 1, kMallocBytes);
  struct ibv_mr* mr = ibv_reg_mr(qp->pd, buffer, kMallocBytes, IBV_ACCESS_LOCAL_WRITE);
  CHECKED(mr != NULL);
  free(buffer); /* the bug, part one: the region still covers it */
  char* fresh = malloc(kMallocBytes);
  CHECKED(fresh != NULL);
  memset(fresh, 'f', kMallocBytes);
  post_write(qp, mr, fresh, target_mr, 2); /* part two: the stale region is used for the new buffer */
  struct ibv_wc wc;
  wait_completion(cq, &wc);
  free(fresh);
  CHECKED(ibv_dereg_mr(mr) == 0);
}

int main(void) {
  struct ibv_context* context = open_softverbs0();
  struct ibv_pd* pd = ibv_alloc_pd(context);
  struct ibv_cq* cq = ibv_create_cq(context, 8, NULL, NULL, 0);
  CHECKED(pd != NULL && cq != NULL);
  struct ibv_qp* a = create_rc_qp(pd, cq, cq, 4);
  struct ibv_qp* b = create_rc_qp(pd, cq, cq, 4);
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  connect_rc_qp(a, b->qp_num, access, 1);
  connect_rc_qp(b, a->qp_num, access, 1);
  struct ibv_mr* target_mr = ibv_reg_mr(pd, target, sizeof target, access);
  CHECKED(target_mr != NULL);
  printf("expect: QP 0x0*%x\n", a->qp_num);
  printf("expect: WR id 2\n");
  printf("expect: free\\(\\) of \n");
  fflush(stdout);
  write_after_unmap(a, cq, target_mr);
  write_after_free(a, cq, target_mr);
  CHECKED(ibv_dereg_mr(target_mr) == 0);
  ibv_destroy_qp(a);
  ibv_destroy_qp(b);
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  ibv_close_device(context);
  return 0;
}
