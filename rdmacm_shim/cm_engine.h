// The rdma_cm emulation: event channels, ids and their connection state
// machine, whose MADs the process's background runtime takes off the wire
// and resends. The exported C API (rdma_cma_api.cpp) is a thin layer over this.
#pragma once

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "cm_agent.h"
#include "cm_protocol.h"

namespace softverbs::cm {

struct QueuedEvent {
  rdma_cm_event event{};  // first: the application holds a pointer to it
  std::vector<uint8_t> private_data;
};

// Events wait in `queue`; the descriptor the application polls (channel.fd,
// one end of a socket pair) holds one byte per queued event, so it is
// readable exactly while events wait. Blocking readers wait on `ready`.
struct EventChannel {
  rdma_event_channel channel{};  // first: the application holds a pointer to it
  int signal_write = -1;
  std::deque<std::unique_ptr<QueuedEvent>> queue;
  std::condition_variable_any ready;  // with the engine's mutex
  bool destroyed = false;
  std::thread::id destroyed_by;
};

enum class IdState : uint8_t {
  Idle,
  Bound,
  AddressResolved,
  RouteResolved,
  Listening,
  RequestSent,       // active: REQ or SIDR_REQ out
  ResponseReceived,  // active: REP in, the application owns the QP (rdma_establish next)
  RequestReceived,   // passive: CONNECT_REQUEST delivered
  ReplySent,         // passive: REP out, waiting for RTU
  Connected,
  Disconnected,
};

// A CM MAD the peer must answer, resent until it does or its retries run
// out (for an id, and for a DREQ that outlives its id).
struct Resending {
  std::array<uint8_t, wire::cm::kMadBytes> mad{};
  std::chrono::steady_clock::time_point at{};  // the next resend
  int left = 0;                                // resends still allowed
};

struct CmId {
  rdma_cm_id id{};  // first: the application holds a pointer to it
  EventChannel* channel = nullptr;
  std::unique_ptr<EventChannel> own_channel;  // synchronous ids
  IdState state = IdState::Idle;
  // The connection on the wire (IB CM MADs through QP1): this process's
  // agent on the id's device, both communication IDs, both GIDs, the MAD
  // that is resent until the peer answers it, and the last answer sent
  // (sent again when the peer resends what it answered).
  CmAgent* agent = nullptr;
  uint32_t local_comm_id = 0;
  uint32_t remote_comm_id = 0;
  uint64_t transaction_id = 0;
  std::array<uint8_t, 16> local_gid{};
  std::array<uint8_t, 16> peer_gid{};
  std::optional<Resending> awaiting_answer;
  // When the time wait of its ended connection is over (TIMEWAIT_EXIT).
  std::optional<std::chrono::steady_clock::time_point> timewait_ends;
  std::chrono::steady_clock::time_point request_sent_at{};
  std::optional<std::array<uint8_t, wire::cm::kMadBytes>> last_answer;
  // A listener's registrations: the agents whose devices route its REQs here.
  std::vector<std::pair<CmAgent*, CmListenOn>> listening;
  std::optional<bool> afonly;  // RDMA_OPTION_ID_AFONLY, if set
  bool listed = false;         // in the listener directory
  CmId* listener = nullptr;
  // What the peer sent, for rdma_init_qp_attr and the QP transitions.
  std::optional<ConnectRequest> request;
  std::optional<ConnectReply> reply;
  uint32_t local_psn = 0;  // the PSN our QP expects first (its rq_psn), sent in our REQ or REP
  uint8_t responder_resources = 0;
  uint8_t initiator_depth = 0;
  uint8_t retry_count = 7;
  uint8_t rnr_retry_count = 7;
  uint8_t ack_timeout = 14;
  uint8_t tos = 0;
  uint32_t remote_qpn_for_ud = 0;
  ibv_ece local_ece{};
  ibv_ece remote_ece{};
  bool owns_cqs = false;
  std::optional<ibv_qp_init_attr> endpoint_qp_attr;  // rdma_create_ep on a passive id
  ibv_pd* endpoint_pd = nullptr;
  std::unique_ptr<QueuedEvent> held_event;  // synchronous ids: id->event
  ibv_sa_path_rec path{};                   // what id->route.path_rec points at
  struct Membership {
    sockaddr_storage address;
    ibv_gid mgid;
    bool attached;
  };
  std::vector<Membership> multicast;
  // rdma_destroy_id waits until every event the application has taken for
  // the id is acked; events not yet taken are dropped, as the kernel does.
  uint64_t events_taken = 0;
  uint64_t events_acked = 0;
};

// Each returns 0 or sets errno and returns -1, as librdmacm does.
rdma_event_channel* create_event_channel();
void destroy_event_channel(rdma_event_channel* channel);
int create_id(rdma_event_channel* channel, rdma_cm_id** id, void* context, rdma_port_space ps, ibv_qp_type qp_type);
int destroy_id(rdma_cm_id* id);
int bind_addr(rdma_cm_id* id, const sockaddr* address);
int resolve_addr(rdma_cm_id* id, const sockaddr* source, const sockaddr* destination, int timeout_ms);
int resolve_route(rdma_cm_id* id, int timeout_ms);
int create_qp(rdma_cm_id* id, ibv_pd* pd, ibv_qp_init_attr* attr);
int create_qp_ex(rdma_cm_id* id, ibv_qp_init_attr_ex* attr);
void destroy_qp(rdma_cm_id* id);
int create_srq(rdma_cm_id* id, ibv_pd* pd, ibv_srq_init_attr* attr);
int create_srq_ex(rdma_cm_id* id, ibv_srq_init_attr_ex* attr);
void destroy_srq(rdma_cm_id* id);
int connect(rdma_cm_id* id, const rdma_conn_param* param);
int establish(rdma_cm_id* id);
int listen(rdma_cm_id* id, int backlog);
int get_request(rdma_cm_id* listen_id, rdma_cm_id** id);
int accept(rdma_cm_id* id, const rdma_conn_param* param);
int reject(rdma_cm_id* id, const void* private_data, uint8_t length, uint16_t reason);
int disconnect(rdma_cm_id* id);
int get_cm_event(rdma_event_channel* channel, rdma_cm_event** event);
int ack_cm_event(rdma_cm_event* event);
int migrate_id(rdma_cm_id* id, rdma_event_channel* channel);
int set_option(rdma_cm_id* id, int level, int name, const void* value, size_t length);
int init_qp_attr(rdma_cm_id* id, ibv_qp_attr* attr, int* mask);
int join_multicast(rdma_cm_id* id, const sockaddr* address, void* context, bool send_only);
int leave_multicast(rdma_cm_id* id, const sockaddr* address);
int set_local_ece(rdma_cm_id* id, const ibv_ece* ece);
int get_remote_ece(rdma_cm_id* id, ibv_ece* ece);
ibv_context** get_devices(int* count);
void free_devices(ibv_context** list);
int create_ep(rdma_cm_id** id, rdma_addrinfo* info, ibv_pd* pd, ibv_qp_init_attr* attr);
void destroy_ep(rdma_cm_id* id);
int getaddrinfo(const char* node, const char* service, const rdma_addrinfo* hints, rdma_addrinfo** result);
void freeaddrinfo(rdma_addrinfo* info);
const char* event_str(rdma_cm_event_type event);

}  // namespace softverbs::cm
