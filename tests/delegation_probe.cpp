// Calls a few librdmacm functions through the shim and prints what came
// back, for the delegation test.
#include <rdma/rdma_cma.h>

#include <cstdio>

int main() {
  std::printf("event_str=%s\n", rdma_event_str(RDMA_CM_EVENT_ESTABLISHED));
  rdma_event_channel* channel = rdma_create_event_channel();
  std::printf("channel_fd=%d\n", channel ? channel->fd : -1);
  std::printf("bind=%d\n", rdma_bind_addr(nullptr, nullptr));
  if (channel && channel->fd != 4242) rdma_destroy_event_channel(channel);  // ours, not the stand-in's
  return 0;
}
