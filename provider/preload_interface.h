// What the preload library asks the provider before it hands an application
// a pointer it read from a socket. A completion channel yields 8 bytes that
// libibverbs takes for an ibv_cq pointer, an async fd 16 bytes of which 8
// may be a CQ, QP or SRQ pointer: the provider, which made those objects,
// says whether the bytes name one of them. The provider finds the preload's
// registration function with dlsym (the preload is in the global scope; the
// provider, dlopen'ed by libibverbs, is not).
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>

extern "C" {

struct SoftverbsHandleValidator {
  uint32_t version;  // kValidatorVersion
  // A context of a softverbs device that is open.
  bool (*is_context)(const ibv_context* context);
  // A live CQ of `channel`'s context created with `channel`.
  bool (*is_channel_cq)(const ibv_comp_channel* channel, uint64_t cq);
  // `element` is what an event of `event_type` may name on `context`: a
  // live CQ, QP or SRQ of it for the events about one, anything for port
  // and device events.
  bool (*is_event_element)(const ibv_context* context, uint32_t event_type, uint64_t element);
  // The preload handed the application a completion event of `cq`, or an
  // async event of `event_type` naming `element`: the provider counts them
  // per object, to tell at a destroy whether all were acknowledged.
  void (*cq_event_delivered)(uint64_t cq);
  void (*async_event_delivered)(uint32_t event_type, uint64_t element);
  // Before a blocking ibv_get_cq_event reads `channel`: returns once its fd
  // may have a datagram, having done the device's work on this thread while
  // it waited (so that a packet wakes this thread alone, not a background
  // thread that then wakes this one); at once where there is none to do.
  // Returns a live CQ of `channel` whose event that work raised (and did
  // not send), to be delivered as read; 0 if none; kCqEventWaitInterrupted
  // (errno EINTR) where a signal would have interrupted the read.
  uint64_t (*wait_for_cq_event)(ibv_comp_channel* channel);
  // The application calls _exit() or _Exit(), which run no atexit handler:
  // the provider sends what an HCA would already have put on the wire (the
  // ACKs it holds for the application's next request).
  void (*before_exit)();
};

using SoftverbsRegisterValidator = void (*)(const SoftverbsHandleValidator* validator);
}

namespace softverbs {
inline constexpr uint32_t kValidatorVersion = 5;
inline constexpr uint64_t kCqEventWaitInterrupted = ~uint64_t{0};
inline constexpr const char* kRegisterValidatorSymbol = "softverbs_preload_register_validator";
}  // namespace softverbs
