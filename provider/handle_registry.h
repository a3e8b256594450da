// The objects this process's softverbs contexts have made and not yet
// destroyed, by the pointers libibverbs hands out: what a pointer read from
// a completion channel or an async fd must be before anyone follows it
// (see preload_interface.h).
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>

#include "preload_interface.h"

namespace softverbs::provider {

enum class HandleKind : uint8_t { Context, Cq, Qp, Srq };

// The events the preload handed the application about one object (see
// preload_interface.h): what ibv_ack_cq_events and ibv_ack_async_event
// must have acknowledged before the object is destroyed.
struct DeliveredEvents {
  uint32_t completion = 0;  // a CQ's, from its completion channel
  uint32_t async = 0;
};

void register_handle(HandleKind kind, const void* handle);
// Forgets the handle; returns the events delivered about it.
DeliveredEvents unregister_handle(HandleKind kind, const void* handle);
bool is_live_handle(HandleKind kind, uint64_t handle);
// The live handles of `kind` whose object belongs to `context`, with their
// events (for ibv_close_device's check).
template <typename Visit>
void for_each_live_handle(HandleKind kind, const ibv_context* context, Visit visit);

namespace detail {
void visit_live_handles(HandleKind kind, const ibv_context* context, void (*visit)(void*, uint64_t, DeliveredEvents),
                        void* state);
}

template <typename Visit>
void for_each_live_handle(HandleKind kind, const ibv_context* context, Visit visit) {
  detail::visit_live_handles(
      kind, context,
      [](void* state, uint64_t handle, DeliveredEvents events) { (*static_cast<Visit*>(state))(handle, events); },
      &visit);
}

// The checks the preload makes, over this registry.
const SoftverbsHandleValidator& handle_validator();
// Hands the preload (if it is loaded) those checks, once, with
// `wait_for_cq_event` as their wait hook and `before_exit` as their exit hook.
void offer_validator_to_preload(uint64_t (*wait_for_cq_event)(ibv_comp_channel*), void (*before_exit)());

// ibv_async_event as libibverbs built it from the 16 bytes it read:
// whether its element is one of `context`'s live objects where the event
// type says it names one.
bool is_valid_event(const ibv_context* context, uint32_t event_type, uint64_t element);

// The preload's wait_for_cq_event (preload_interface.h): over UDP the
// waiting thread reads the device's sockets itself until `channel` has an
// event, and returns it (a CQ of `channel`) if it raised it itself
// (completion_queues.cpp).
uint64_t wait_for_cq_event(ibv_comp_channel* channel);
// The validator's is_channel_cq (handle_registry.cpp).
bool is_channel_cq(const ibv_comp_channel* channel, uint64_t cq);

}  // namespace softverbs::provider
