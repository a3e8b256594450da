// What the rdma_cm emulation's files share among themselves (cm_engine.h is
// what rdma_cma_api.cpp calls): IB CM timing, the engine that owns ids and
// QP1 agents, and the helpers that addresses, events, MADs and QPs need
// from one another.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "cm_agent.h"
#include "cm_engine.h"
#include "cm_protocol.h"
#include "device/cm_routing.h"
#include "host/device_registry.h"
#include "listener_directory.h"
#include "wire/cm_mad.h"

namespace softverbs::cm {

using Clock = std::chrono::steady_clock;
using MadBytes = std::array<uint8_t, wire::cm::kMadBytes>;
namespace mad = wire::cm;

constexpr uint8_t kHopLimit = 64;

// IB CM timing (kCmResponseTimeout, kMaxCmRetries, kCmResendAfter): in
// device/cm_routing.h, which the device's announcements of dead processes'
// connections follow too.
// A connection's time wait after its disconnect, ended by TIMEWAIT_EXIT: the
// kernel's IB CM waits 2^(lifetime - 8) ms, the path's packet lifetime on
// RoCE being 17 (rdma_cm's 16, plus one).
constexpr auto kTimewait = std::chrono::milliseconds(1 << (17 - 8));

inline int fail(int error) {
  errno = error;
  return -1;
}

// The application holds pointers to the first member of each.
inline CmId* priv(rdma_cm_id* id) { return reinterpret_cast<CmId*>(id); }
inline EventChannel* priv(rdma_event_channel* channel) { return reinterpret_cast<EventChannel*>(channel); }
inline QueuedEvent* priv(rdma_cm_event* event) { return reinterpret_cast<QueuedEvent*>(event); }

inline bool is_ud(const CmId* id) { return id->id.qp_type == IBV_QPT_UD; }
inline uint16_t port_space_of(const CmId* id) { return static_cast<uint16_t>(id->id.ps); }

// ---- addresses and routes (cm_addresses.cpp) ---------------------------------

socklen_t sockaddr_length(const sockaddr* address);
void copy_address(sockaddr_storage& out, const sockaddr* in);
WireAddress to_wire(const sockaddr_storage& address);
sockaddr_storage from_wire(const WireAddress& wire);
// `gid` (an IP address as a GID) as WireAddress, with `port` in host order.
WireAddress wire_address(const std::array<uint8_t, 16>& gid, uint8_t ip_version, uint16_t port);
// RoCE v2 GID of an IP address: IPv4-mapped for IPv4.
ibv_gid gid_of(const sockaddr_storage& address);
std::array<uint8_t, 16> gid_bytes(const sockaddr_storage& address);
// What a listener bound to `local` takes. An IPv4 wildcard takes IPv4 only;
// an IPv6 one IPv4 too unless AFONLY is set, which defaults to
// net.ipv6.bindv6only as in the kernel's rdma_cm.
CmListenOn listen_on(const sockaddr_storage& local, std::optional<bool> afonly);
// Is `address` one of this host's (network namespace's) addresses?
bool is_local_address(const sockaddr_storage& address);
// The local address the kernel would route `destination` from (0 or an errno).
int route_source(const sockaddr_storage& destination, sockaddr_storage& source);
// The GID a connection to `destination` leaves from.
std::array<uint8_t, 16> source_gid(CmAgent* agent, const sockaddr_storage& bound, const sockaddr_storage& destination);

// One context and one PD per device, shared by all ids, as librdmacm keeps.
class Devices {
 public:
  // The device that carries `local`, else one on the loopback netdev.
  ibv_context* context_for(const sockaddr_storage& local);
  ibv_pd* pd_for(ibv_context* context);
  // The device's XRC domain for XRC_RECV QPs and XRC SRQs that name none,
  // opened at first use as librdmacm opens its own (nullptr and errno).
  ibv_xrcd* xrcd_for(ibv_context* context);
  const std::vector<ibv_context*>& all();

 private:
  void open_all();
  bool opened_ = false;
  std::vector<ibv_context*> contexts_;
  std::map<ibv_context*, ibv_pd*> pds_;
  std::map<ibv_context*, ibv_xrcd*> xrcds_;
};

// Uses the address's device for `id`: verbs, PD and port as librdmacm fills them.
bool attach_device(CmId* id, Devices& devices, const sockaddr_storage& local);

// ---- the engine (cm_engine.cpp) -----------------------------------------------

class Engine {
 public:
  static Engine& instance();

  std::recursive_mutex mutex;
  std::condition_variable_any events_acked;       // with `mutex`
  std::condition_variable_any lingering_drained;  // with `mutex`
  Devices devices;
  std::set<CmId*> ids;
  std::unique_ptr<ListenerDirectory> directory = std::make_unique<ListenerDirectory>(default_runtime_dir());

  // This process's QP1 agent on each device, made on first use.
  std::map<ibv_context*, std::unique_ptr<CmAgent>> agents;
  CmAgent* agent_for(ibv_context* context);
  // Event channels the application destroyed, kept: see destroy_event_channel.
  std::vector<std::unique_ptr<EventChannel>> retired_channels;
  // DREQs of ids already destroyed, resent until the peer's DREP comes or
  // the retries run out, as the kernel's CM goes on after rdma_destroy_id
  // (and after the process ends: see wait_for_lingering_at_exit).
  struct Lingering {
    CmAgent* agent;
    uint32_t local_comm_id;
    std::array<uint8_t, 16> local_gid, peer_gid;
    uint8_t tos;
    Resending dreq;
  };
  std::vector<Lingering> lingering;

  // Arms the resend timer for the earliest MAD awaiting its answer (an
  // id's or a lingering DREQ); where one is sent, added or due sooner.
  void schedule_resends();

  // From the kernel's generator: a peer that saw one connection's PSNs
  // cannot predict the next one's (a forged packet needs the PSN).
  uint32_t random_psn();

 private:
  Engine();
  ~Engine();  // never runs: the engine lives as long as the process
  struct Waits;
  Waits& waits();
  bool served() const;
  void watch(CmAgent* agent);
  void on_readable(CmAgent* agent);
  void resend_due();
  // TIMEWAIT_EXIT for the ids whose time wait is over.
  void end_due_timewaits(Clock::time_point now);
  // Connected ids whose peer, on this device, has died: DISCONNECTED, as
  // the DREQ the peer's kernel CM would have sent.
  bool watching_peers() const;
  void check_peers(Clock::time_point now);
  Clock::time_point next_peer_check{};
  // Looks for connections of the device's dead processes (see
  // announce_orphaned_connections): often while any is recorded, seldom
  // otherwise, as long as this process has an agent.
  void sweep_orphans(Clock::time_point now);
  std::optional<Clock::time_point> next_orphan_sweep() const;
  Clock::time_point next_sweep{};
  static void wait_for_lingering_at_exit();

  // The agents' descriptors and the resend timer, on the process's
  // background runtime (support/background.h).
  std::unique_ptr<Waits> waits_;
};

// Where a MAD being resent stands at `now`: not due, due again (rescheduled
// here; the caller sends it), or out of retries.
enum class Due : uint8_t { Not, Resend, Exhausted };
Due step(Resending& resending, Clock::time_point now);

// ---- events and channels (cm_api_events.cpp) ---------------------------------

bool open_channel(EventChannel& channel);
void take_signal_byte(EventChannel& channel);
void give_signal_byte(EventChannel& channel);
// Queues an event of `type` for `id` on `channel` (the id's by default).
void deliver(CmId* id, rdma_cm_event_type type, int status, std::unique_ptr<QueuedEvent> event = nullptr,
             EventChannel* channel = nullptr);
// An event whose private data is the whole `area` (IB CM delivers it zero padded).
std::unique_ptr<QueuedEvent> event_with_private_data(const uint8_t* data, size_t area, bool ud);
// A new id in the engine's set (nullptr where its own channel cannot be made).
CmId* new_id(EventChannel* channel, void* context, rdma_port_space ps, ibv_qp_type qp_type);
// Waits on a synchronous id's private channel for one of `wanted`.
std::unique_ptr<QueuedEvent> wait_for(CmId* id, std::initializer_list<rdma_cm_event_type> wanted);
// After a synchronous operation: 0 for `success`, else -1 and librdmacm's errno.
int finish_sync(CmId* id, std::unique_ptr<QueuedEvent> event, rdma_cm_event_type success);

// ---- CM MADs (cm_mads.cpp) and the protocol (cm_protocol.cpp) -----------------

// The MAD that carries `message` on `id`'s connection, and the reverse.
MadBytes mad_for(const CmId* id, const Message& message);
uint32_t remote_qpn_of(const CmId* id);
Message message_of(const mad::Mad& in);
bool carries_dreq(const MadBytes& bytes);
// Sends `message` on the id's connection; one the peer must answer is resent.
bool send_to_peer(CmId* id, const Message& message);
// Moves `id` to `next`. An established connection is recorded in the
// device while it lasts, so that if this process dies another process of
// the device sends its DREQ (see CmConnectionTable).
void set_state(CmId* id, IdState next);
// What the peer hears of an id that goes (rdma_destroy_id, or the process's
// exit): a DREQ for a connection (it lingers after the id: see
// Engine::lingering), a REJ mid-handshake, as the kernel's IB CM sends them.
void end_connection(Engine& engine, CmId* id);
// DREQs, as the kernel's CM sends them (resent until a DREP ends them: see
// due_orphan_dreqs), for the connections of the device's processes that died.
void announce_orphaned_connections(CmAgent* agent);
// Nothing more is resent on the id: the peer answered, or the connection ends.
inline void stop_resending(CmId* id) { id->awaiting_answer.reset(); }
// A MAD that arrived on `agent`; a MAD resent enough times and never answered.
void on_mad(Engine& engine, CmAgent* agent, const ReceivedMad& received);
void on_no_answer(CmId* id);
// The peer ended the connection (its DREQ, or the death of its process):
// DISCONNECTED for a connected id. The QP stays as it is, as with
// librdmacm, whose DISCONNECTED leaves it alone.
void ended_by_peer(CmId* id);
// A connected (not UD) id whose connection ended: TIMEWAIT_EXIT follows
// after kTimewait, unless the id is destroyed first.
void enter_timewait(CmId* id);

// ---- queue pairs (cm_qp.cpp) ----------------------------------------------------

ibv_ah_attr path_to_peer(CmId* id);
// The attributes of one QP transition, as rdma_init_qp_attr reports them.
int qp_attributes(CmId* id, ibv_qp_state state, ibv_qp_attr& attr, int& mask);
int modify(CmId* id, ibv_qp_state state);
void move_qp_to_error(CmId* id);
// The device's limits on outstanding RDMA READ/atomic operations.
void clamp_depths(CmId* id);

}  // namespace softverbs::cm
