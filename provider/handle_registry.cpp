#include "handle_registry.h"

#include <dlfcn.h>

#include <array>
#include <mutex>
#include <unordered_set>

#include "event_kinds.h"
#include "preload_interface.h"

namespace softverbs::provider {

namespace {

struct Registry {
  std::mutex mutex;
  std::array<std::unordered_set<uint64_t>, 4> live;  // by HandleKind
};

Registry& registry() {
  static Registry instance;
  return instance;
}

uint64_t key(const void* handle) { return reinterpret_cast<uint64_t>(handle); }

bool is_context(const ibv_context* context) { return is_live_handle(HandleKind::Context, key(context)); }

bool is_channel_cq(const ibv_comp_channel* channel, uint64_t cq) {
  if (channel == nullptr || !is_live_handle(HandleKind::Cq, cq)) return false;
  // Live, so the pointer may be followed now.
  return reinterpret_cast<const ibv_cq*>(cq)->channel == channel;
}

bool is_event_element_checked(const ibv_context* context, uint32_t event_type, uint64_t element) {
  return is_valid_event(context, event_type, element);
}

const SoftverbsHandleValidator kValidator{kValidatorVersion, is_context, is_channel_cq, is_event_element_checked};

}  // namespace

void register_handle(HandleKind kind, const void* handle) {
  Registry& r = registry();
  std::lock_guard guard(r.mutex);
  r.live[static_cast<size_t>(kind)].insert(key(handle));
}

void unregister_handle(HandleKind kind, const void* handle) {
  Registry& r = registry();
  std::lock_guard guard(r.mutex);
  r.live[static_cast<size_t>(kind)].erase(key(handle));
}

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

const SoftverbsHandleValidator& handle_validator() { return kValidator; }

void offer_validator_to_preload() {
  static const bool offered = [] {
    auto offer = reinterpret_cast<SoftverbsRegisterValidator>(dlsym(RTLD_DEFAULT, kRegisterValidatorSymbol));
    if (offer != nullptr) offer(&kValidator);
    return true;
  }();
  (void)offered;
}

}  // namespace softverbs::provider
