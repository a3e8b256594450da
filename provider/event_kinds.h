// What the element of an asynchronous event names, by the event's type, as
// libibverbs' ibv_get_async_event reads it: one table for the preload's
// check, the provider's own and the fuzz target.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>

namespace softverbs {

enum class EventElement : uint8_t { Cq, Qp, Srq, Wq, Port, Unknown };

inline EventElement event_element(uint32_t event_type) {
  switch (event_type) {
    case IBV_EVENT_CQ_ERR:
      return EventElement::Cq;
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_COMM_EST:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_PATH_MIG_ERR:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
      return EventElement::Qp;
    case IBV_EVENT_SRQ_ERR:
    case IBV_EVENT_SRQ_LIMIT_REACHED:
      return EventElement::Srq;
    case IBV_EVENT_WQ_FATAL:
      return EventElement::Wq;
    case IBV_EVENT_DEVICE_FATAL:
    case IBV_EVENT_PORT_ACTIVE:
    case IBV_EVENT_PORT_ERR:
    case IBV_EVENT_LID_CHANGE:
    case IBV_EVENT_PKEY_CHANGE:
    case IBV_EVENT_SM_CHANGE:
    case IBV_EVENT_CLIENT_REREGISTER:
    case IBV_EVENT_GID_CHANGE:
      return EventElement::Port;
    default:
      return EventElement::Unknown;
  }
}

}  // namespace softverbs
