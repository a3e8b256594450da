/* Bug: fork() while memory is registered, without ibv_fork_init() or
 * RDMAV_FORK_SAFE. On an HCA the parent's next write to a registered page
 * copies it (copy on write), and the device goes on with the page the
 * parent no longer sees. Check: fork-with-registered-memory. */
#include <sys/wait.h>
#include <unistd.h>

#include "bug_support.h"

__attribute__((noinline)) static pid_t fork_child(void) { return fork(); /* the bug */ }

int main(void) {
  struct ibv_context* context = open_softverbs0();
  struct ibv_pd* pd = ibv_alloc_pd(context);
  CHECKED(pd != NULL);
  static char buffer[4096];
  struct ibv_mr* mr = ibv_reg_mr(pd, buffer, sizeof buffer, IBV_ACCESS_LOCAL_WRITE);
  CHECKED(mr != NULL);
  const pid_t child = fork_child();
  CHECKED(child >= 0);
  if (child == 0) _exit(0);
  int status = 0;
  CHECKED(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  buffer[0] = 1;
  ibv_dereg_mr(mr);
  ibv_dealloc_pd(pd);
  ibv_close_device(context);
  return 0;
}
