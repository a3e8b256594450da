#include "event_datagram.h"

#include <cstdint>
#include <cstring>

#include "event_kinds.h"

namespace softverbs {

std::optional<ibv_cq*> decode_channel_datagram(std::span<const unsigned char> bytes, bool sender_trusted,
                                               const ibv_comp_channel* channel,
                                               const SoftverbsHandleValidator& validator) {
  uint64_t handle = 0;
  if (!sender_trusted || bytes.size() != sizeof handle) return std::nullopt;
  std::memcpy(&handle, bytes.data(), sizeof handle);
  if (!validator.is_channel_cq(channel, handle)) return std::nullopt;
  return reinterpret_cast<ibv_cq*>(handle);
}

std::optional<ibv_async_event> decode_async_datagram(std::span<const unsigned char> bytes, bool sender_trusted,
                                                     const ibv_context* context,
                                                     const SoftverbsHandleValidator& validator) {
  struct {
    uint64_t element;
    uint32_t event_type;
    uint32_t reserved;
  } raw{};
  static_assert(sizeof raw == 16);
  if (!sender_trusted || bytes.size() != sizeof raw) return std::nullopt;
  std::memcpy(&raw, bytes.data(), sizeof raw);
  if (!validator.is_event_element(context, raw.event_type, raw.element)) return std::nullopt;
  ibv_async_event event{};
  event.event_type = static_cast<ibv_event_type>(raw.event_type);
  switch (event_element(raw.event_type)) {
    case EventElement::Cq:
      event.element.cq = reinterpret_cast<ibv_cq*>(raw.element);
      break;
    case EventElement::Srq:
      event.element.srq = reinterpret_cast<ibv_srq*>(raw.element);
      break;
    case EventElement::Qp:
      event.element.qp = reinterpret_cast<ibv_qp*>(raw.element);
      break;
    case EventElement::Wq:
      event.element.wq = reinterpret_cast<ibv_wq*>(raw.element);
      break;
    case EventElement::Port:
    case EventElement::Unknown:
      event.element.port_num = static_cast<int>(raw.element);
      break;
  }
  return event;
}

}  // namespace softverbs
