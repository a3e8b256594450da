// This process's end of QP1 on one device: a UD QP created with source QPN
// 1 (the device routes CM MADs among such agents, cm_routing.h), receive
// buffers for MADs, and the device memory where listeners are recorded so
// that REQs for their service IDs reach this process.
#pragma once

#include <infiniband/verbs.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "device/cm_routing.h"
#include "wire/cm_mad.h"

namespace softverbs {
class DeviceMemory;
}

namespace softverbs::cm {

using Gid16 = std::array<uint8_t, 16>;

struct ReceivedMad {
  Gid16 source{};       // the sender's GID (its IP address)
  Gid16 destination{};  // ours, as it addressed us
  std::array<uint8_t, wire::cm::kMadBytes> bytes{};
};

// A RoCE v2 entry of port 1's GID table: the first that is `wanted`, or
// the first of all when nothing is wanted.
struct GidEntry {
  uint8_t index = 0;
  Gid16 gid{};
};
std::optional<GidEntry> find_roce_v2_gid(ibv_context* context, const std::optional<Gid16>& wanted);

class CmAgent {
 public:
  // nullptr (and errno) where the device cannot make one.
  static std::unique_ptr<CmAgent> create(ibv_context* context, ibv_pd* pd);
  ~CmAgent();
  CmAgent(const CmAgent&) = delete;
  CmAgent& operator=(const CmAgent&) = delete;

  ibv_context* context() const { return context_; }
  uint32_t qpn() const { return qp_->qp_num; }
  uint64_t node_guid() const { return node_guid_; }
  // The descriptor that is readable when MADs may have arrived.
  int event_fd() const { return channel_->fd; }
  // A fresh communication ID (or SIDR request ID) that names this agent.
  uint32_t next_local_id();

  // Sends a MAD to QP1 at `destination` from our GID `source`; false where
  // no RoCE v2 GID of ours is `source` or the send cannot be posted.
  bool send(const Gid16& source, const Gid16& destination, uint8_t traffic_class,
            const std::array<uint8_t, wire::cm::kMadBytes>& mad);
  // The MADs that arrived; re-arms the event descriptor.
  std::vector<ReceivedMad> take();

  // Whether `gid` is a RoCE v2 GID of the device; its first one.
  bool has_gid(const Gid16& gid) { return gid_index(gid).has_value(); }
  std::optional<Gid16> first_gid();

  // Whether a live process holds communication ID `id` of this device. A
  // peer process that died sends no DREQ (the kernel's CM would send one
  // for it), so the engine asks this of its connected peers.
  bool peer_alive(uint32_t id);

  // The device's record of this agent's established connections (see
  // CmConnectionTable), and the connections of agents whose process died
  // whose DREQ is due (see due_orphan_dreqs).
  void record_connection(const CmConnectionTable::Entry& entry);
  void forget_connection(uint32_t local_comm_id);
  bool connections_recorded();
  std::vector<CmConnectionTable::Entry> due_orphan_dreqs();

  // Listeners (0, or an errno); an all-zero address listens on all of the
  // device's addresses (see CmListenOn).
  int add_listener(uint64_t service_id, const CmListenOn& on);
  void remove_listener(uint64_t service_id, const CmListenOn& on);

 private:
  CmAgent() = default;
  bool post_receive(size_t slot);
  std::optional<uint8_t> gid_index(const Gid16& gid);

  static constexpr size_t kReceives = 512;
  static constexpr size_t kGrhBytes = 40;
  static constexpr size_t kSlotBytes = kGrhBytes + wire::cm::kMadBytes;

  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_comp_channel* channel_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  ibv_mr* mr_ = nullptr;
  std::vector<uint8_t> buffers_;  // kReceives receive slots, then kSends send slots
  size_t next_send_ = 0;
  uint32_t next_sequence_ = 0;
  uint64_t node_guid_ = 0;
  std::map<std::pair<Gid16, Gid16>, ibv_ah*> ahs_;  // by source and destination GID
  std::map<Gid16, uint8_t> gid_indexes_;
  std::shared_ptr<DeviceMemory> memory_;
  static constexpr size_t kSends = 128;
};

}  // namespace softverbs::cm
