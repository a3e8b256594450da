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

void register_handle(HandleKind kind, const void* handle);
void unregister_handle(HandleKind kind, const void* handle);
bool is_live_handle(HandleKind kind, uint64_t handle);

// The checks the preload makes, over this registry.
const SoftverbsHandleValidator& handle_validator();
// Hands the preload (if it is loaded) those checks, once.
void offer_validator_to_preload();

// ibv_async_event as libibverbs built it from the 16 bytes it read:
// whether its element is one of `context`'s live objects where the event
// type says it names one.
bool is_valid_event(const ibv_context* context, uint32_t event_type, uint64_t element);

}  // namespace softverbs::provider
