// What a datagram read from a softverbs completion channel or async fd may
// be taken for: the decisions the preload makes before libibverbs' callers
// see a pointer (preload_interface.h), apart from the socket calls so that
// a fuzz target can drive them.
#pragma once

#include <infiniband/verbs.h>

#include <optional>
#include <span>

#include "preload_interface.h"

namespace softverbs {

// The CQ a completion-channel datagram names: 8 bytes, from a trusted
// sender, naming a live CQ of `channel`.
std::optional<ibv_cq*> decode_channel_datagram(std::span<const unsigned char> bytes, bool sender_trusted,
                                               const ibv_comp_channel* channel,
                                               const SoftverbsHandleValidator& validator);

// The event an async-fd datagram carries, as ibv_get_async_event fills it:
// 16 bytes {element, type, reserved}, from a trusted sender, whose element
// is what the type says it names on `context`.
std::optional<ibv_async_event> decode_async_datagram(std::span<const unsigned char> bytes, bool sender_trusted,
                                                     const ibv_context* context,
                                                     const SoftverbsHandleValidator& validator);

}  // namespace softverbs
