#include "handle_registry.h"

#include <dlfcn.h>

#include <array>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "checker/report.h"
#include "event_kinds.h"
#include "preload_interface.h"

namespace softverbs::provider {

namespace {

struct Registry {
  std::mutex mutex;
  std::array<std::unordered_map<uint64_t, DeliveredEvents>, 4> live;  // by HandleKind
};

Registry& registry() {
  static Registry instance;
  return instance;
}

uint64_t key(const void* handle) { return reinterpret_cast<uint64_t>(handle); }

bool is_context(const ibv_context* context) { return is_live_handle(HandleKind::Context, key(context)); }

}  // namespace

bool is_channel_cq(const ibv_comp_channel* channel, uint64_t cq) {
  if (channel == nullptr || !is_live_handle(HandleKind::Cq, cq)) return false;
  // Live, so the pointer may be followed now.
  return reinterpret_cast<const ibv_cq*>(cq)->channel == channel;
}

namespace {

bool is_event_element_checked(const ibv_context* context, uint32_t event_type, uint64_t element) {
  return is_valid_event(context, event_type, element);
}

// Counted only while the object is registered: a pointer the preload
// validated may have been destroyed since.
void count_event(HandleKind kind, uint64_t handle, uint32_t DeliveredEvents::*counter) {
  if (!check::enabled()) return;  // only the checker reads the counts
  Registry& r = registry();
  std::lock_guard guard(r.mutex);
  auto& live = r.live[static_cast<size_t>(kind)];
  if (auto found = live.find(handle); found != live.end()) ++(found->second.*counter);
}

void cq_event_delivered(uint64_t cq) { count_event(HandleKind::Cq, cq, &DeliveredEvents::completion); }

void async_event_delivered(uint32_t event_type, uint64_t element) {
  switch (event_element(event_type)) {
    case EventElement::Cq:
      count_event(HandleKind::Cq, element, &DeliveredEvents::async);
      break;
    case EventElement::Qp:
      count_event(HandleKind::Qp, element, &DeliveredEvents::async);
      break;
    case EventElement::Srq:
      count_event(HandleKind::Srq, element, &DeliveredEvents::async);
      break;
    default:  // port and device events: ibv_ack_async_event counts none
      break;
  }
}

// Its wait and exit hooks come from offer_validator_to_preload: they live
// with the CQs and the UDP transport, which the event fuzzer does not link.
SoftverbsHandleValidator validator_table{
    kValidatorVersion,     is_context, is_channel_cq, is_event_element_checked, cq_event_delivered,
    async_event_delivered, nullptr,    nullptr};

}  // namespace

void register_handle(HandleKind kind, const void* handle) {
  Registry& r = registry();
  std::lock_guard guard(r.mutex);
  r.live[static_cast<size_t>(kind)][key(handle)] = DeliveredEvents{};
}

DeliveredEvents unregister_handle(HandleKind kind, const void* handle) {
  Registry& r = registry();
  std::lock_guard guard(r.mutex);
  auto& live = r.live[static_cast<size_t>(kind)];
  auto found = live.find(key(handle));
  if (found == live.end()) return {};
  const DeliveredEvents events = found->second;
  live.erase(found);
  return events;
}

namespace detail {
void visit_live_handles(HandleKind kind, const ibv_context* context, void (*visit)(void*, uint64_t, DeliveredEvents),
                        void* state) {
  std::vector<std::pair<uint64_t, DeliveredEvents>> of_context;
  {
    Registry& r = registry();
    std::lock_guard guard(r.mutex);
    for (const auto& [handle, events] : r.live[static_cast<size_t>(kind)])
      // The handle's context: the first member of ibv_cq, ibv_qp and ibv_srq.
      if (*reinterpret_cast<ibv_context* const*>(handle) == context) of_context.emplace_back(handle, events);
  }
  for (const auto& [handle, events] : of_context) visit(state, handle, events);
}
}  // namespace detail

bool is_live_handle(HandleKind kind, uint64_t handle) {
  Registry& r = registry();
  std::lock_guard guard(r.mutex);
  return r.live[static_cast<size_t>(kind)].count(handle) != 0;
}

bool is_valid_event(const ibv_context* context, uint32_t event_type, uint64_t element) {
  HandleKind kind = HandleKind::Qp;
  switch (event_element(event_type)) {
    case EventElement::Cq:
      kind = HandleKind::Cq;
      break;
    case EventElement::Qp:
      kind = HandleKind::Qp;
      break;
    case EventElement::Srq:
      kind = HandleKind::Srq;
      break;
    case EventElement::Port:
      return element <= 1;  // a port number (one port), or none
    case EventElement::Wq:  // no WQs here
    case EventElement::Unknown:
      return false;
  }
  if (!is_live_handle(kind, element)) return false;
  // The handle's context: the first member of ibv_cq, ibv_qp and ibv_srq.
  return *reinterpret_cast<ibv_context* const*>(element) == context;
}

const SoftverbsHandleValidator& handle_validator() { return validator_table; }

void offer_validator_to_preload(uint64_t (*wait_for_cq_event)(ibv_comp_channel*), void (*before_exit)()) {
  static const bool offered = [wait_for_cq_event, before_exit] {
    validator_table.wait_for_cq_event = wait_for_cq_event;
    validator_table.before_exit = before_exit;
    auto offer = reinterpret_cast<SoftverbsRegisterValidator>(dlsym(RTLD_DEFAULT, kRegisterValidatorSymbol));
    if (offer != nullptr) offer(&validator_table);
    return true;
  }();
  (void)offered;
}

}  // namespace softverbs::provider
