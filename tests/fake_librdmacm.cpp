// A stand-in for the real librdmacm, to prove the shim's delegation: the
// shim loads it (SOFTVERBS_RDMACM=real, SOFTVERBS_RDMACM_REAL=<this>) and
// must hand calls to it. Its answers are recognisably not the emulation's.
#include <rdma/rdma_cma.h>

#include <cerrno>

extern "C" __attribute__((visibility("default"))) const char* rdma_event_str(rdma_cm_event_type) {
  return "FAKE_LIBRDMACM_EVENT";
}

extern "C" __attribute__((visibility("default"))) rdma_event_channel* rdma_create_event_channel(void) {
  static rdma_event_channel channel{4242};
  return &channel;
}

extern "C" __attribute__((visibility("default"))) int rdma_bind_addr(rdma_cm_id*, sockaddr*) {
  errno = 4243;
  return -4243;
}
