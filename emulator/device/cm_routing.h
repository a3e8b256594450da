// QP1 of a softverbs device. No kernel CM owns it: each process that uses
// rdma_cm creates a UD QP with IBV_QP_CREATE_SOURCE_QPN = 1, a CM agent,
// and the device hands every CM MAD that arrives for QP1 to the agent it
// belongs to: a REQ or SIDR_REQ to the agent that listens on its service ID
// (and destination address), any other message to the agent whose
// communication ID it names (the IDs an agent hands out carry its QP
// index). What no agent takes the device answers as the kernel's CM does.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "device/shared_mutex.h"
#include "wire/cm_mad.h"

namespace softverbs {

class DeviceMemory;

inline constexpr uint32_t kGsiQpn = 1;

// IB CM timing, as softverbs's MADs announce it: the peer answers within
// 4.096 us * 2^18 (~1.07 s) or the message is resent, up to kMaxCmRetries
// times; a REQ nobody answers ends in UNREACHABLE after ~5 s.
inline constexpr uint8_t kCmResponseTimeout = 18;
inline constexpr uint8_t kMaxCmRetries = 4;
inline constexpr auto kCmResendAfter = std::chrono::nanoseconds(4096ull << kCmResponseTimeout);

// What a listener takes: the REQs for one address, or with an all-zero
// address those for any of the device's, of IP version 4 or 6 or of both
// (0): rdma_cm's AFONLY option decides that for an IPv6 wildcard.
struct CmListenOn {
  std::array<uint8_t, 16> address{};
  uint8_t ip_version = 0;
  bool operator==(const CmListenOn&) const = default;
};

// Listening service IDs, in device memory. Its lock is a leaf: routing
// happens under the device's other locks.
struct CmListenerTable {
  SharedMutex lock;
  struct Entry {
    uint64_t service_id = 0;
    std::array<uint8_t, 16> address{};  // all zero: any address of the device
    uint32_t agent_qpn = 0;             // 0: a free entry
    uint8_t ip_version = 0;             // CmListenOn's
  };
  static constexpr int kCapacity = 512;
  Entry entries[kCapacity];
};

// The device's established rdma_cm connections. The kernel's CM sends a
// DREQ for each connection of a process whose rdma_cm file closes, however
// it ended, and resends it until the peer's DREP comes or its retries run
// out. Here another process of the device (or the device's CM watcher)
// sends them for one that died: a peer on another host has no other way to
// learn of the death. The entry stays, announcing, until then: whichever
// process sweeps next resends its DREQ, and whichever receives the DREP
// ends it. Its lock is a leaf.
struct CmConnectionTable {
  SharedMutex lock;
  struct Entry {
    uint32_t agent_qpn = 0;  // 0: a free entry; the owner lives as long as this agent
    uint32_t local_comm_id = 0;
    uint32_t remote_comm_id = 0;
    uint32_t remote_qpn = 0;
    uint64_t transaction_id = 0;
    std::array<uint8_t, 16> local_gid{};
    std::array<uint8_t, 16> peer_gid{};
    uint8_t traffic_class = 0;
    // Its agent died and its DREQ was sent: resent at next_dreq (steady
    // clock, the same in every process of the host) while dreqs_left.
    bool announcing = false;
    uint8_t dreqs_left = 0;
    int64_t next_dreq_ns = 0;
  };
  static constexpr int kCapacity = 4096;
  std::atomic<uint32_t> in_use{0};  // read unlocked: whether a sweep has anything to look at
  uint32_t high_water = 0;          // no entry at or above it was ever used
  Entry entries[kCapacity];
};

// false where the table is full (the connection then goes unannounced if
// its process dies).
bool add_cm_connection(DeviceMemory& memory, const CmConnectionTable::Entry& entry);
void remove_cm_connection(DeviceMemory& memory, uint32_t agent_qpn, uint32_t local_comm_id);
bool cm_connections_recorded(DeviceMemory& memory);
// The entries whose agent has died and whose DREQ is due at `now`: newly
// orphaned ones, and those announced kCmResendAfter ago with no DREP since
// (1 + kMaxCmRetries sends in all; an entry is freed after its last).
std::vector<CmConnectionTable::Entry> due_orphan_dreqs(DeviceMemory& memory, std::chrono::steady_clock::time_point now);
// The DREQ the kernel's CM would send for `orphan` as its process's file closed.
std::array<uint8_t, wire::cm::kMadBytes> orphan_dreq(const CmConnectionTable::Entry& orphan);

// 0; EADDRINUSE where a live agent listens on the service ID and address
// already (for a wildcard: of an IP version it takes too); ENOMEM when the
// table is full of live entries.
int add_cm_listener(DeviceMemory& memory, uint64_t service_id, const CmListenOn& on, uint32_t agent_qpn);
void remove_cm_listener(DeviceMemory& memory, uint64_t service_id, const CmListenOn& on, uint32_t agent_qpn);

// The communication ID (or SIDR request ID) number `sequence` of an agent.
uint32_t cm_local_id(uint32_t agent_qpn, uint32_t sequence);

// Whether a live agent holds communication ID `id` (handed out on this
// device): false once the process that owns it has died.
bool cm_id_held(DeviceMemory& memory, uint32_t id);

// The kernel CM's answer to a MAD that no agent or id takes: REJ "invalid
// service ID" for a REQ, SIDR_REP "unsupported" for a SIDR_REQ, DREP for a
// DREQ, REJ "invalid communication ID" for a REP; nullopt for the rest.
std::optional<std::array<uint8_t, wire::cm::kMadBytes>> unclaimed_answer(const wire::cm::Mad& in);

// Where a CM MAD for QP1 goes: the agent's QPN, or the answer the device
// gives for the sender (as from QP1, the MAD's transaction ID kept), or
// neither (dropped: not a CM MAD, or one that needs no answer).
struct CmDelivery {
  uint32_t agent_qpn = 0;
  std::optional<std::array<uint8_t, wire::cm::kMadBytes>> answer;
};
CmDelivery route_cm_mad(DeviceMemory& memory, std::span<const uint8_t> mad);

}  // namespace softverbs
