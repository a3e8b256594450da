// libFuzzer entry point (scripts/fuzz): what the preload takes from a
// completion channel or an async fd, where any local user can send a
// datagram. A datagram is accepted only from a trusted sender, and only if
// the pointer in it names a live object of the right kind, context and
// channel: the input picks the bytes, their length and the sender's trust,
// over a registry holding a few live objects and one destroyed one.
#include <infiniband/verbs.h>

#include <cstdlib>
#include <cstring>
#include <iterator>
#include <vector>

#include "event_datagram.h"
#include "event_kinds.h"
#include "handle_registry.h"

namespace {

using namespace softverbs;
using provider::HandleKind;

struct Objects {
  ibv_context context{}, other_context{};
  ibv_comp_channel channel{}, other_channel{};
  ibv_cq cq{}, cq_elsewhere{}, destroyed_cq{};
  ibv_qp qp{};
  ibv_srq srq{};
  Objects() {
    channel.context = &context;
    other_channel.context = &context;
    cq.context = &context;
    cq.channel = &channel;
    cq_elsewhere.context = &other_context;
    cq_elsewhere.channel = &other_channel;
    destroyed_cq.context = &context;
    destroyed_cq.channel = &channel;
    qp.context = &context;
    srq.context = &context;
    provider::register_handle(HandleKind::Context, &context);
    provider::register_handle(HandleKind::Context, &other_context);
    provider::register_handle(HandleKind::Cq, &cq);
    provider::register_handle(HandleKind::Cq, &cq_elsewhere);
    provider::register_handle(HandleKind::Cq, &destroyed_cq);
    provider::unregister_handle(HandleKind::Cq, &destroyed_cq);
    provider::register_handle(HandleKind::Qp, &qp);
    provider::register_handle(HandleKind::Srq, &srq);
  }
};

Objects& objects() {
  static Objects instance;
  return instance;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Objects& o = objects();
  if (size < 1) return 0;
  // First byte: the sender's trust and which pointers the bytes may hold.
  const bool trusted = data[0] & 1;
  std::vector<unsigned char> bytes(data + 1, data + size);
  // Let the fuzzer reach real pointers: a selector in the second byte
  // overwrites the first 8 bytes with one of the objects' addresses.
  if (bytes.size() >= 9) {
    const void* pick[] = {&o.cq, &o.cq_elsewhere, &o.destroyed_cq, &o.qp, &o.srq, &o.context};
    const uint8_t which = bytes[0] % 8;
    if (which < std::size(pick)) {
      const uint64_t address = reinterpret_cast<uint64_t>(pick[which]);
      std::memcpy(bytes.data() + 1, &address, 8);
    }
    bytes.erase(bytes.begin());
  }
  const SoftverbsHandleValidator& check = provider::handle_validator();
  if (auto cq = decode_channel_datagram(bytes, trusted, &o.channel, check)) {
    if (!trusted || *cq != &o.cq) std::abort();  // only the live CQ of this channel
  }
  if (auto event = decode_async_datagram(bytes, trusted, &o.context, check)) {
    if (!trusted) std::abort();
    switch (event_element(event->event_type)) {
      case EventElement::Cq:
        if (event->element.cq != &o.cq) std::abort();
        break;
      case EventElement::Qp:
        if (event->element.qp != &o.qp) std::abort();
        break;
      case EventElement::Srq:
        if (event->element.srq != &o.srq) std::abort();
        break;
      case EventElement::Port:
        if (event->element.port_num < 0 || event->element.port_num > 1) std::abort();
        break;
      case EventElement::Wq:
      case EventElement::Unknown:
        std::abort();  // nothing of these may be taken
    }
  }
  return 0;
}
