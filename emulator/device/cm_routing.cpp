#include "device/cm_routing.h"

#include <algorithm>
#include <cerrno>

#include "device/device_memory.h"

namespace softverbs {

namespace {

using wire::cm::Attribute;

constexpr unsigned kSequenceBits = 32 - kQpnIndexBits;

// The agent `qpn` names, if it is one and its process lives.
bool agent_alive(DeviceMemory& memory, uint32_t qpn) {
  const QpRecord* qp = memory.qp_by_number(qpn);
  return qp != nullptr && qp->gsi_agent && qp->type == QpType::Ud && memory.owner_alive(qp->owner_process);
}

uint32_t agent_of_id(DeviceMemory& memory, uint32_t id) {
  const QpRecord& qp = memory.shared().qps[id >> kSequenceBits];
  const uint32_t qpn = qp.qpn;  // unlocked: the checks below see a QP that went
  return qp.live && agent_alive(memory, qpn) ? qpn : 0;
}

bool versions_overlap(uint8_t a, uint8_t b) { return a == 0 || b == 0 || a == b; }

// The agent listening on `service_id` for a REQ to `address` of IP version
// `ip_version` (0 when the REQ named none): one bound to that address, else
// a wildcard one that takes that version.
uint32_t listener_for(DeviceMemory& memory, uint64_t service_id, const std::array<uint8_t, 16>& address,
                      uint8_t ip_version) {
  SharedLock lock(memory.shared().cm_listeners.lock);
  constexpr std::array<uint8_t, 16> kAny{};
  uint32_t any = 0;
  for (const auto& entry : memory.shared().cm_listeners.entries) {
    if (entry.agent_qpn == 0 || entry.service_id != service_id || !agent_alive(memory, entry.agent_qpn)) continue;
    if (entry.address == address && address != kAny) return entry.agent_qpn;
    if (entry.address == kAny && versions_overlap(entry.ip_version, ip_version)) any = entry.agent_qpn;
  }
  return any;
}

}  // namespace

int add_cm_listener(DeviceMemory& memory, uint64_t service_id, const CmListenOn& on, uint32_t agent_qpn) {
  SharedLock lock(memory.shared().cm_listeners.lock);
  CmListenerTable::Entry* free_entry = nullptr;
  for (auto& entry : memory.shared().cm_listeners.entries) {
    const bool live = entry.agent_qpn != 0 && agent_alive(memory, entry.agent_qpn);
    if (!live) {
      if (free_entry == nullptr) free_entry = &entry;
      continue;
    }
    if (entry.service_id == service_id && entry.address == on.address &&
        versions_overlap(entry.ip_version, on.ip_version))
      return EADDRINUSE;
  }
  if (free_entry == nullptr) return ENOMEM;
  *free_entry = {service_id, on.address, agent_qpn, on.ip_version};
  return 0;
}

void remove_cm_listener(DeviceMemory& memory, uint64_t service_id, const CmListenOn& on, uint32_t agent_qpn) {
  SharedLock lock(memory.shared().cm_listeners.lock);
  for (auto& entry : memory.shared().cm_listeners.entries) {
    if (entry.agent_qpn == agent_qpn && entry.service_id == service_id && entry.address == on.address &&
        entry.ip_version == on.ip_version)
      entry = {};
  }
}

bool add_cm_connection(DeviceMemory& memory, const CmConnectionTable::Entry& entry) {
  CmConnectionTable& table = memory.shared().cm_connections;
  SharedLock lock(table.lock);
  for (uint32_t i = 0; i < static_cast<uint32_t>(CmConnectionTable::kCapacity); ++i) {
    if (table.entries[i].agent_qpn != 0) continue;
    table.entries[i] = entry;
    table.high_water = std::max(table.high_water, i + 1);
    table.in_use.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  return false;
}

namespace {

void free_connection(CmConnectionTable& table, CmConnectionTable::Entry& entry) {
  entry = {};
  table.in_use.fetch_sub(1, std::memory_order_relaxed);
}

// Frees every recorded connection that `ends` picks.
template <typename Predicate>
void free_connections_where(CmConnectionTable& table, Predicate ends) {
  SharedLock lock(table.lock);
  for (uint32_t i = 0; i < table.high_water; ++i) {
    CmConnectionTable::Entry& entry = table.entries[i];
    if (entry.agent_qpn != 0 && ends(entry)) free_connection(table, entry);
  }
}

}  // namespace

void remove_cm_connection(DeviceMemory& memory, uint32_t agent_qpn, uint32_t local_comm_id) {
  free_connections_where(memory.shared().cm_connections, [&](const CmConnectionTable::Entry& entry) {
    return entry.agent_qpn == agent_qpn && entry.local_comm_id == local_comm_id;
  });
}

bool cm_connections_recorded(DeviceMemory& memory) {
  return memory.shared().cm_connections.in_use.load(std::memory_order_relaxed) != 0;
}

std::vector<CmConnectionTable::Entry> due_orphan_dreqs(DeviceMemory& memory,
                                                       std::chrono::steady_clock::time_point now) {
  std::vector<CmConnectionTable::Entry> due;
  if (!cm_connections_recorded(memory)) return due;
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count();
  const int64_t resend_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(kCmResendAfter).count();
  CmConnectionTable& table = memory.shared().cm_connections;
  SharedLock lock(table.lock);
  for (uint32_t i = 0; i < table.high_water; ++i) {
    CmConnectionTable::Entry& entry = table.entries[i];
    if (entry.agent_qpn == 0) continue;
    if (!entry.announcing) {
      if (agent_alive(memory, entry.agent_qpn)) continue;
      entry.announcing = true;
      entry.dreqs_left = kMaxCmRetries;
    } else if (now_ns < entry.next_dreq_ns) {
      continue;
    } else if (entry.dreqs_left-- == 0) {
      free_connection(table, entry);  // no DREP came: the kernel's CM gives up too
      continue;
    }
    entry.next_dreq_ns = now_ns + resend_ns;
    due.push_back(entry);
  }
  return due;
}

namespace {

// A DREP for the DREQ of a connection whose process died: it is answered.
void settle_orphan_dreq(DeviceMemory& memory, uint32_t local_comm_id, uint32_t remote_comm_id) {
  if (!cm_connections_recorded(memory)) return;
  free_connections_where(memory.shared().cm_connections, [&](const CmConnectionTable::Entry& entry) {
    return entry.announcing && entry.local_comm_id == local_comm_id && entry.remote_comm_id == remote_comm_id;
  });
}

}  // namespace

std::array<uint8_t, wire::cm::kMadBytes> orphan_dreq(const CmConnectionTable::Entry& orphan) {
  return wire::cm::build_dreq(orphan.transaction_id, orphan.local_comm_id, orphan.remote_comm_id, orphan.remote_qpn);
}

bool cm_id_held(DeviceMemory& memory, uint32_t id) { return agent_of_id(memory, id) != 0; }

uint32_t cm_local_id(uint32_t agent_qpn, uint32_t sequence) {
  const uint32_t index = agent_qpn & ((1u << kQpnIndexBits) - 1);
  const uint32_t low = sequence & ((1u << kSequenceBits) - 1);
  return index << kSequenceBits | (low == 0 ? 1 : low);  // 0 means "none" in a REJ
}

std::optional<std::array<uint8_t, wire::cm::kMadBytes>> unclaimed_answer(const wire::cm::Mad& in) {
  wire::cm::Mad reply;
  reply.transaction_id = in.transaction_id;
  switch (in.attribute) {
    case Attribute::Req:
      reply.attribute = Attribute::Rej;
      reply.rej.remote_comm_id = in.req.local_comm_id;
      reply.rej.message = wire::cm::MessageRejected::Req;
      reply.rej.reason = wire::cm::reject::kInvalidServiceId;
      break;
    case Attribute::SidrReq:
      reply.attribute = Attribute::SidrRep;
      reply.sidr_rep.request_id = in.sidr_req.request_id;
      reply.sidr_rep.status = wire::cm::sidr_status::kUnsupported;
      reply.sidr_rep.service_id = in.sidr_req.service_id;
      break;
    case Attribute::Dreq:
      // So that the peer's disconnect completes.
      reply.attribute = Attribute::Drep;
      reply.drep.local_comm_id = in.dreq.remote_comm_id;
      reply.drep.remote_comm_id = in.dreq.local_comm_id;
      break;
    case Attribute::Rep:
      // So that the peer does not wait for an RTU.
      reply.attribute = Attribute::Rej;
      reply.rej.local_comm_id = in.rep.remote_comm_id;
      reply.rej.remote_comm_id = in.rep.local_comm_id;
      reply.rej.message = wire::cm::MessageRejected::Rep;
      reply.rej.reason = wire::cm::reject::kInvalidCommId;
      break;
    default:
      return std::nullopt;  // needs no answer
  }
  return wire::cm::build_cm_mad(reply);
}

CmDelivery route_cm_mad(DeviceMemory& memory, std::span<const uint8_t> bytes) {
  CmDelivery delivery;
  const auto route = wire::cm::cm_route(bytes);
  if (!route) return delivery;
  switch (route->attribute) {
    case Attribute::Req:
    case Attribute::SidrReq: {
      const auto mad = wire::cm::parse_cm_mad(bytes);
      if (!mad) return delivery;
      const auto& private_data = route->attribute == Attribute::Req
                                     ? std::span<const uint8_t>(mad->req.private_data)
                                     : std::span<const uint8_t>(mad->sidr_req.private_data);
      std::array<uint8_t, 16> destination{};
      uint8_t ip_version = 0;
      if (const auto ip = wire::cm::get_ip_header(private_data)) {
        destination = ip->destination;
        ip_version = ip->ip_version;
      }
      delivery.agent_qpn = listener_for(memory, route->service_id, destination, ip_version);
      if (delivery.agent_qpn == 0) delivery.answer = unclaimed_answer(*mad);
      return delivery;
    }
    case Attribute::Lap:
    case Attribute::Apr:
      return delivery;  // path migration is not offered
    default:
      break;
  }
  delivery.agent_qpn = agent_of_id(memory, route->receiver_id);
  if (delivery.agent_qpn != 0) return delivery;
  // Nobody holds the communication ID: its process ended.
  const auto mad = wire::cm::parse_cm_mad(bytes);
  if (!mad) return delivery;
  if (mad->attribute == Attribute::Drep) settle_orphan_dreq(memory, mad->drep.remote_comm_id, mad->drep.local_comm_id);
  delivery.answer = unclaimed_answer(*mad);
  return delivery;
}

}  // namespace softverbs
