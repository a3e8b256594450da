#include "cm_engine.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <thread>

#include "device/cm_routing.h"
#include "device/multicast_table.h"
#include "host/device_registry.h"
#include "host/gid.h"
#include "listener_directory.h"
#include "support/debug_log.h"
#include "support/random_bits.h"

namespace softverbs::cm {

namespace {

// What the kernel's IB CM gives an RC QP at RTR, and so what rdma_cm
// applications get on hardware: 0, the longest RNR NAK delay (655.36 ms).
// A receive posted a little late then costs one long wait, not an
// IBV_WC_RNR_RETRY_EXC_ERR after a few short ones.
constexpr uint8_t kMinRnrTimer = 0;
constexpr uint8_t kHopLimit = 64;

// IB CM timing, as the MADs announce it: the peer answers within
// 4.096 us * 2^18 (~1.07 s) or the message is resent, up to kMaxCmRetries
// times; a REQ nobody answers ends in UNREACHABLE after ~5 s.
constexpr uint8_t kCmResponseTimeout = 18;
constexpr uint8_t kMaxCmRetries = 4;
constexpr auto kResendAfter = std::chrono::nanoseconds(4096ull << kCmResponseTimeout);
// What an MRA asks for: the listener's application has not accepted yet.
constexpr uint8_t kMraServiceTimeout = 20;
constexpr auto kMraWait = std::chrono::nanoseconds(4096ull << kMraServiceTimeout);
// A REQ that finds no listener within this long after it was first sent
// is tried again (a server re-listening between two connections, as
// perftest does, is a moment away on a real fabric too).
constexpr auto kListenerGrace = std::chrono::milliseconds(50);
constexpr auto kListenerRetry = std::chrono::milliseconds(5);

// Whether a CM MAD is a DREQ.
bool carries_dreq(const std::array<uint8_t, wire::cm::kMadBytes>& bytes) {
  const auto route = wire::cm::cm_route(bytes);
  return route && route->attribute == wire::cm::Attribute::Dreq;
}

int fail(int error) {
  errno = error;
  return -1;
}

CmId* priv(rdma_cm_id* id) { return reinterpret_cast<CmId*>(id); }

// A socket pair: the application's end honours O_NONBLOCK and poll, and we
// can take a byte back without blocking (MSG_DONTWAIT).
bool open_channel(EventChannel& channel) {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return false;
  channel.channel.fd = fds[0];
  channel.signal_write = fds[1];
  return true;
}

void take_signal_byte(EventChannel& channel) {
  char byte;
  [[maybe_unused]] ssize_t n = recv(channel.channel.fd, &byte, 1, MSG_DONTWAIT);
}

void give_signal_byte(EventChannel& channel) {
  char byte = 1;
  [[maybe_unused]] ssize_t n = send(channel.signal_write, &byte, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}
EventChannel* priv(rdma_event_channel* channel) { return reinterpret_cast<EventChannel*>(channel); }
QueuedEvent* priv(rdma_cm_event* event) { return reinterpret_cast<QueuedEvent*>(event); }

bool is_ud(const CmId* id) { return id->id.qp_type == IBV_QPT_UD; }

socklen_t sockaddr_length(const sockaddr* address) {
  return address->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

void copy_address(sockaddr_storage& out, const sockaddr* in) {
  out = {};
  std::memcpy(&out, in, sockaddr_length(in));
}

WireAddress to_wire(const sockaddr_storage& address) {
  WireAddress wire;
  wire.family = address.ss_family;
  if (address.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(address);
    wire.port = in.sin_port;
    std::memcpy(wire.address, &in.sin_addr, 4);
  } else {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(address);
    wire.port = in6.sin6_port;
    std::memcpy(wire.address, &in6.sin6_addr, 16);
  }
  return wire;
}

sockaddr_storage from_wire(const WireAddress& wire) {
  sockaddr_storage address{};
  address.ss_family = wire.family == AF_INET6 ? AF_INET6 : AF_INET;
  if (address.ss_family == AF_INET) {
    auto& in = reinterpret_cast<sockaddr_in&>(address);
    in.sin_port = wire.port;
    std::memcpy(&in.sin_addr, wire.address, 4);
  } else {
    auto& in6 = reinterpret_cast<sockaddr_in6&>(address);
    in6.sin6_port = wire.port;
    std::memcpy(&in6.sin6_addr, wire.address, 16);
  }
  return address;
}

// RoCE v2 GID of an IP address: IPv4-mapped for IPv4.
ibv_gid gid_of(const sockaddr_storage& address) {
  ibv_gid gid{};
  if (address.ss_family == AF_INET) {
    gid.raw[10] = gid.raw[11] = 0xff;
    std::memcpy(gid.raw + 12, &reinterpret_cast<const sockaddr_in&>(address).sin_addr, 4);
  } else {
    std::memcpy(gid.raw, &reinterpret_cast<const sockaddr_in6&>(address).sin6_addr, 16);
  }
  return gid;
}

// ---- devices -----------------------------------------------------------------

bool has_gid(ibv_context* context, const ibv_gid& wanted) {
  Gid16 gid;
  std::memcpy(gid.data(), wanted.raw, 16);
  return find_roce_v2_gid(context, gid).has_value();
}

// One context and one PD per device, shared by all ids, as librdmacm keeps.
class Devices {
 public:
  // The device whose GID table holds `local` (as RoCE resolves an address
  // to the netdev that has it), else a device on the loopback netdev, which
  // stands for every address of this host (a device on another netdev
  // carries only that netdev's addresses, as an HCA's port does).
  ibv_context* context_for(const sockaddr_storage& local) {
    open_all();
    for (ibv_context* context : contexts_)
      if (has_gid(context, gid_of(local))) return context;
    sockaddr_in loopback{};
    loopback.sin_family = AF_INET;
    loopback.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sockaddr_storage any_loopback{};
    std::memcpy(&any_loopback, &loopback, sizeof loopback);
    for (ibv_context* context : contexts_)
      if (has_gid(context, gid_of(any_loopback))) return context;
    return nullptr;
  }
  ibv_pd* pd_for(ibv_context* context) {
    auto it = pds_.find(context);
    if (it != pds_.end()) return it->second;
    ibv_pd* pd = ibv_alloc_pd(context);
    pds_[context] = pd;
    return pd;
  }
  const std::vector<ibv_context*>& all() {
    open_all();
    return contexts_;
  }

 private:
  void open_all() {
    if (opened_) return;
    opened_ = true;
    int count = 0;
    ibv_device** list = ibv_get_device_list(&count);
    for (int i = 0; list && i < count; ++i)
      if (ibv_context* context = ibv_open_device(list[i])) contexts_.push_back(context);
    if (list) ibv_free_device_list(list);
  }
  bool opened_ = false;
  std::vector<ibv_context*> contexts_;
  std::map<ibv_context*, ibv_pd*> pds_;
};

// Uses the address's device for `id`: verbs, PD and port as librdmacm fills them.
bool attach_device(CmId* id, Devices& devices, const sockaddr_storage& local) {
  ibv_context* context = devices.context_for(local);
  if (context == nullptr) return false;
  id->id.verbs = context;
  id->id.pd = devices.pd_for(context);
  id->id.port_num = 1;
  return true;
}

// Is `address` one of this host's (network namespace's) addresses?
bool is_local_address(const sockaddr_storage& address) {
  int fd = socket(address.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_storage probe = address;
  if (probe.ss_family == AF_INET)
    reinterpret_cast<sockaddr_in&>(probe).sin_port = 0;
  else
    reinterpret_cast<sockaddr_in6&>(probe).sin6_port = 0;
  bool local = bind(fd, reinterpret_cast<sockaddr*>(&probe), sockaddr_length(reinterpret_cast<sockaddr*>(&probe))) == 0;
  close(fd);
  return local;
}

// The local address the kernel would route `destination` from.
int route_source(const sockaddr_storage& destination, sockaddr_storage& source) {
  int fd = socket(destination.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno;
  sockaddr_storage target = destination;
  if (port_of(target) == 0) {
    if (target.ss_family == AF_INET)
      reinterpret_cast<sockaddr_in&>(target).sin_port = htons(9);
    else
      reinterpret_cast<sockaddr_in6&>(target).sin6_port = htons(9);
  }
  int error = 0;
  socklen_t length = sizeof source;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&target), sockaddr_length(reinterpret_cast<sockaddr*>(&target))) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&source), &length) != 0)
    error = errno;
  close(fd);
  return error;
}

// ---- the engine --------------------------------------------------------------

class Engine {
 public:
  static Engine& instance() {
    static Engine* engine = new Engine;  // lives as long as the process: the CM thread uses it
    return *engine;
  }

  std::recursive_mutex mutex;
  std::condition_variable_any events_acked;       // with `mutex`
  std::condition_variable_any lingering_drained;  // with `mutex`
  Devices devices;
  std::set<CmId*> ids;
  std::unique_ptr<ListenerDirectory> directory = std::make_unique<ListenerDirectory>(default_runtime_dir());

  // This process's QP1 agent on each device, made on first use.
  std::map<ibv_context*, std::unique_ptr<CmAgent>> agents;
  CmAgent* agent_for(ibv_context* context) {
    if (context == nullptr) return nullptr;
    auto& agent = agents[context];
    if (!agent) {
      agent = CmAgent::create(context, devices.pd_for(context));
      if (!agent) {
        debug_log("rdma_cm: no QP1 agent on %s: %s", ibv_get_device_name(context->device), strerror(errno));
        agents.erase(context);
        return nullptr;
      }
      start_thread();
      wake();  // the CM thread polls the new agent's descriptor
    }
    return agent.get();
  }
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

  void wake() {
    char byte = 1;
    [[maybe_unused]] ssize_t n = write(wake_write_, &byte, 1);
  }

  void start_thread() {
    if (thread_started_) return;
    thread_started_ = true;
    std::thread([this] { run(); }).detach();
  }

  // From the kernel's generator: a peer that saw one connection's PSNs
  // cannot predict the next one's (a forged packet needs the PSN).
  uint32_t random_psn() { return static_cast<uint32_t>(random_u64()) & 0xffffff; }

 private:
  Engine() {
    open_wake_pipe();
    std::atexit(wait_for_lingering_at_exit);
    // A forked child has no CM thread and shares the wake pipe: it starts
    // its own of each when it needs them. The lock is held across fork()
    // so that the child never inherits it mid-update.
    pthread_atfork([] { instance().mutex.lock(); }, [] { instance().mutex.unlock(); },
                   [] {
                     Engine& engine = instance();
                     close(engine.wake_read_);
                     close(engine.wake_write_);
                     engine.open_wake_pipe();
                     engine.thread_started_ = false;
                     // The parent's QP1 agents are the parent's: REQs for
                     // them go to it. The child makes its own (the verbs
                     // objects are left alone: they belong to the parent).
                     for (auto& [context, agent] : engine.agents) (void)agent.release();
                     engine.agents.clear();
                     for (CmId* id : engine.ids) {
                       id->agent = nullptr;
                       id->awaiting_answer.reset();
                       id->listening.clear();
                     }
                     // A recursive mutex knows its owner by thread id, which
                     // the child's only thread does not have: start afresh.
                     new (&engine.mutex) std::recursive_mutex;
                     new (&engine.events_acked) std::condition_variable_any;
                   });
  }
  void open_wake_pipe() {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0) {
      wake_read_ = fds[0];
      wake_write_ = fds[1];
    }
  }
  void run();
  // A program that ends right after its disconnect (rping's client does)
  // would take its DREQ's retries along; the kernel's CM keeps them. So
  // exit waits, up to two retries (~2.2 s, and only while a DREQ is
  // unanswered: a peer's device answers for a peer process that died).
  static void wait_for_lingering_at_exit() {
    Engine& engine = instance();
    std::unique_lock guard(engine.mutex);
    auto unanswered = [&engine] {
      if (!engine.lingering.empty()) return true;
      for (CmId* id : engine.ids)
        if (id->awaiting_answer && carries_dreq(id->awaiting_answer->mad)) return true;
      return false;
    };
    const auto deadline = std::chrono::steady_clock::now() + 2 * kResendAfter + std::chrono::milliseconds(100);
    while (unanswered() && engine.thread_started_ && std::chrono::steady_clock::now() < deadline)
      engine.lingering_drained.wait_for(guard, std::chrono::milliseconds(20));
  }

  int wake_read_ = -1, wake_write_ = -1;
  bool thread_started_ = false;
};

// Queues `event` on the id's channel; `area` is the private-data area size
// the receiver sees (IB CM delivers the whole area, zero padded).
void deliver(CmId* id, rdma_cm_event_type type, int status, std::unique_ptr<QueuedEvent> event = nullptr,
             EventChannel* channel = nullptr) {
  if (!event) event = std::make_unique<QueuedEvent>();
  event->event.id = &id->id;
  event->event.event = type;
  event->event.status = status;
  if (channel == nullptr) channel = id->channel;
  channel->queue.push_back(std::move(event));
  give_signal_byte(*channel);
  channel->ready.notify_all();
}

std::unique_ptr<QueuedEvent> event_with_private_data(const uint8_t* data, size_t area, bool ud) {
  auto event = std::make_unique<QueuedEvent>();
  event->private_data.assign(data, data + area);
  if (ud) {
    event->event.param.ud.private_data = event->private_data.data();
    event->event.param.ud.private_data_len = static_cast<uint8_t>(area);
  } else {
    event->event.param.conn.private_data = event->private_data.data();
    event->event.param.conn.private_data_len = static_cast<uint8_t>(area);
  }
  return event;
}

using Clock = std::chrono::steady_clock;
using MadBytes = std::array<uint8_t, wire::cm::kMadBytes>;
namespace mad = wire::cm;

std::array<uint8_t, 16> gid_bytes(const sockaddr_storage& address) {
  std::array<uint8_t, 16> out;
  const ibv_gid gid = gid_of(address);
  std::memcpy(out.data(), gid.raw, 16);
  return out;
}

uint16_t port_space_of(const CmId* id) { return static_cast<uint16_t>(id->id.ps); }

mad::IpHeader ip_header(const sockaddr_storage& source, const sockaddr_storage& destination) {
  mad::IpHeader header;
  header.ip_version = source.ss_family == AF_INET6 ? 6 : 4;
  header.source_port = port_of(source);
  header.source = gid_bytes(source);
  header.destination = gid_bytes(destination);
  return header;
}

WireAddress wire_address(const std::array<uint8_t, 16>& gid, uint8_t ip_version, uint16_t port) {
  WireAddress out;
  out.family = ip_version == 6 ? AF_INET6 : AF_INET;
  out.port = htons(port);
  if (ip_version == 6)
    std::memcpy(out.address, gid.data(), 16);
  else
    std::memcpy(out.address, gid.data() + 12, 4);
  return out;
}

template <size_t N>
void put_private(std::array<uint8_t, N>& area, size_t at, const uint8_t* data, size_t length) {
  std::memcpy(area.data() + at, data, std::min(length, N - at));
}

// The MAD that carries `message` on `id`'s connection.
MadBytes mad_for(const CmId* id, const Message& message) {
  mad::Mad out;
  out.transaction_id = id->transaction_id;
  const sockaddr_storage& local = id->id.route.addr.src_storage;
  const sockaddr_storage& peer = id->id.route.addr.dst_storage;
  switch (message.type) {
    case MessageType::Req: {
      const ConnectRequest& req = message.req;
      out.attribute = mad::Attribute::Req;
      mad::Req& m = out.req;
      m.local_comm_id = id->local_comm_id;
      m.vendor_id = req.ece_vendor_id & 0xffffff;
      m.local_eecn = req.ece_options & 0xffffff;
      m.service_id = mad::service_id(port_space_of(id), port_of(peer));
      m.local_ca_guid = id->agent ? id->agent->node_guid() : 0;
      m.local_qpn = req.qp_num;
      m.responder_resources = req.responder_resources;
      m.initiator_depth = req.initiator_depth;
      m.remote_cm_response_timeout = kCmResponseTimeout;
      m.transport_service_type = req.qp_type == IBV_QPT_UC ? 1 : 0;
      m.end_to_end_flow_control = req.flow_control != 0;
      m.starting_psn = req.start_psn;
      m.local_cm_response_timeout = kCmResponseTimeout;
      m.retry_count = req.retry_count;
      m.path_mtu = req.path_mtu;
      m.rnr_retry_count = req.rnr_retry_count;
      m.max_cm_retries = kMaxCmRetries;
      m.srq = req.srq != 0;
      m.primary.local_gid = id->local_gid;
      m.primary.remote_gid = id->peer_gid;
      m.primary.traffic_class = id->tos;
      m.primary.hop_limit = kHopLimit;
      m.primary.local_ack_timeout = id->ack_timeout;
      mad::put_ip_header(ip_header(local, peer), m.private_data);
      put_private(m.private_data, mad::kIpHeaderBytes, req.private_data, req.private_data_length);
      break;
    }
    case MessageType::Rep: {
      const ConnectReply& rep = message.rep;
      out.attribute = mad::Attribute::Rep;
      mad::Rep& m = out.rep;
      m.local_comm_id = id->local_comm_id;
      m.remote_comm_id = id->remote_comm_id;
      m.local_qpn = rep.qp_num;
      m.local_eecn = rep.ece_options & 0xffffff;
      m.starting_psn = rep.start_psn;
      m.responder_resources = rep.responder_resources;
      m.initiator_depth = rep.initiator_depth;
      m.end_to_end_flow_control = rep.flow_control != 0;
      m.rnr_retry_count = rep.rnr_retry_count;
      m.srq = rep.srq != 0;
      m.local_ca_guid = id->agent ? id->agent->node_guid() : 0;
      put_private(m.private_data, 0, rep.private_data, rep.private_data_length);
      break;
    }
    case MessageType::Rtu:
      out.attribute = mad::Attribute::Rtu;
      out.rtu.local_comm_id = id->local_comm_id;
      out.rtu.remote_comm_id = id->remote_comm_id;
      break;
    case MessageType::Rej:
      out.attribute = mad::Attribute::Rej;
      out.rej.local_comm_id = id->local_comm_id;
      out.rej.remote_comm_id = id->remote_comm_id;
      out.rej.message = id->state == IdState::RequestSent || id->state == IdState::ResponseReceived
                            ? mad::MessageRejected::Rep
                            : mad::MessageRejected::Req;
      out.rej.reason = message.rej.reason;
      put_private(out.rej.private_data, 0, message.rej.private_data, message.rej.private_data_length);
      break;
    case MessageType::Dreq:
      out.attribute = mad::Attribute::Dreq;
      out.dreq.local_comm_id = id->local_comm_id;
      out.dreq.remote_comm_id = id->remote_comm_id;
      out.dreq.remote_qpn = id->request ? id->request->qp_num : id->reply ? id->reply->qp_num : 0;
      break;
    case MessageType::Drep:
      out.attribute = mad::Attribute::Drep;
      out.drep.local_comm_id = id->local_comm_id;
      out.drep.remote_comm_id = id->remote_comm_id;
      break;
    case MessageType::SidrReq:
      out.attribute = mad::Attribute::SidrReq;
      out.sidr_req.request_id = id->local_comm_id;
      out.sidr_req.service_id = mad::service_id(port_space_of(id), port_of(peer));
      mad::put_ip_header(ip_header(local, peer), out.sidr_req.private_data);
      put_private(out.sidr_req.private_data, mad::kIpHeaderBytes, message.sidr_req.private_data,
                  message.sidr_req.private_data_length);
      break;
    case MessageType::SidrRep:
      out.attribute = mad::Attribute::SidrRep;
      out.sidr_rep.request_id = id->remote_comm_id;
      out.sidr_rep.status = static_cast<uint8_t>(message.sidr_rep.status);
      out.sidr_rep.qpn = message.sidr_rep.qp_num;
      out.sidr_rep.service_id = mad::service_id(port_space_of(id), port_of(local));
      out.sidr_rep.qkey = message.sidr_rep.qkey;
      put_private(out.sidr_rep.private_data, 0, message.sidr_rep.private_data, message.sidr_rep.private_data_length);
      break;
  }
  return mad::build_cm_mad(out);
}

// The GID a connection to `destination` leaves from: the bound address's
// where the device has it, else the address the kernel routes from, else
// the device's first (an application may bind an address of the host that
// the device does not carry, such as 127.0.0.1 when the device is on a veth).
std::array<uint8_t, 16> source_gid(CmAgent* agent, const sockaddr_storage& bound, const sockaddr_storage& destination) {
  const auto gid = gid_bytes(bound);
  if (agent->has_gid(gid)) return gid;
  sockaddr_storage routed{};
  if (route_source(destination, routed) == 0 && agent->has_gid(gid_bytes(routed))) return gid_bytes(routed);
  return agent->first_gid().value_or(gid);
}

// Sends `message` on the id's connection. One the peer must answer (REQ,
// REP, DREQ, SIDR_REQ) is resent until it does; an answer is kept to be
// sent again should the peer resend what it answers.
bool send_to_peer(CmId* id, const Message& message) {
  if (id->agent == nullptr) return false;
  const MadBytes bytes = mad_for(id, message);
  const bool expects_answer = message.type == MessageType::Req || message.type == MessageType::Rep ||
                              message.type == MessageType::Dreq || message.type == MessageType::SidrReq;
  if (expects_answer) {
    id->awaiting_answer = Resending{bytes, Clock::now() + kResendAfter, kMaxCmRetries};
  } else {
    id->last_answer = bytes;
  }
  const bool sent = id->agent->send(id->local_gid, id->peer_gid, id->tos, bytes);
  if (!sent) debug_log("rdma_cm: a CM MAD to QP1 could not be posted");
  if (expects_answer) Engine::instance().wake();  // the CM thread's timer
  return sent;
}

// Nothing more is resent on the id: the peer answered, or the connection ends.
void stop_resending(CmId* id) { id->awaiting_answer.reset(); }

// Where a MAD being resent stands at `now`: not due, due again (rescheduled
// here; the caller sends it), or out of retries.
enum class Due : uint8_t { Not, Resend, Exhausted };
Due step(Resending& resending, Clock::time_point now) {
  if (resending.at > now) return Due::Not;
  if (resending.left-- <= 0) return Due::Exhausted;
  resending.at = now + kResendAfter;
  return Due::Resend;
}

void move_qp_to_error(CmId* id) {
  if (id->id.qp == nullptr) return;
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  ibv_modify_qp(id->id.qp, &attr, IBV_QP_STATE);
}

ibv_ah_attr path_to_peer(CmId* id) {
  ibv_ah_attr ah{};
  ah.is_global = 1;
  ah.port_num = 1;
  ah.grh.hop_limit = kHopLimit;
  ah.grh.traffic_class = id->tos;
  // The GIDs the connection's MADs travelled between (as the kernel takes
  // the path from the REQ), else those of the addresses.
  constexpr std::array<uint8_t, 16> kNone{};
  ah.grh.dgid = gid_of(id->id.route.addr.dst_storage);
  if (id->peer_gid != kNone) std::memcpy(ah.grh.dgid.raw, id->peer_gid.data(), 16);
  // The source GID's index: the RoCE v2 entry of our address.
  ibv_gid wanted = gid_of(id->id.route.addr.src_storage);
  if (id->local_gid != kNone) std::memcpy(wanted.raw, id->local_gid.data(), 16);
  Gid16 source;
  std::memcpy(source.data(), wanted.raw, 16);
  if (const auto found = find_roce_v2_gid(id->id.verbs, source)) ah.grh.sgid_index = found->index;
  return ah;
}

// The attributes of one QP transition, as rdma_init_qp_attr reports them.
int qp_attributes(CmId* id, ibv_qp_state state, ibv_qp_attr& attr, int& mask) {
  std::memset(&attr, 0, sizeof attr);
  attr.qp_state = state;
  mask = IBV_QP_STATE;
  switch (state) {
    case IBV_QPS_INIT:
      attr.pkey_index = 0;
      attr.port_num = 1;
      mask |= IBV_QP_PKEY_INDEX | IBV_QP_PORT;
      if (is_ud(id)) {
        attr.qkey = RDMA_UDP_QKEY;
        mask |= IBV_QP_QKEY;
      } else {
        attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
        if (id->responder_resources) attr.qp_access_flags |= IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
        mask |= IBV_QP_ACCESS_FLAGS;
      }
      return 0;
    case IBV_QPS_RTR: {
      if (is_ud(id)) return 0;
      uint32_t peer_qpn = 0, peer_psn = 0;
      if (id->request) {
        peer_qpn = id->request->qp_num;
        peer_psn = id->request->start_psn;
      } else if (id->reply) {
        peer_qpn = id->reply->qp_num;
        peer_psn = id->reply->start_psn;
      } else {
        return EINVAL;  // nothing from the peer yet
      }
      ibv_port_attr port{};
      ibv_query_port(id->id.verbs, 1, &port);
      attr.path_mtu = port.active_mtu;
      attr.dest_qp_num = peer_qpn;
      attr.rq_psn = peer_psn;
      attr.ah_attr = path_to_peer(id);
      mask |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
      if (id->id.qp_type == IBV_QPT_RC) {
        attr.max_dest_rd_atomic = id->responder_resources;
        attr.min_rnr_timer = kMinRnrTimer;
        mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
      }
      return 0;
    }
    case IBV_QPS_RTS:
      attr.sq_psn = is_ud(id) ? 0 : id->local_psn;
      mask |= IBV_QP_SQ_PSN;
      if (id->id.qp_type == IBV_QPT_RC) {
        attr.timeout = id->ack_timeout;
        attr.retry_cnt = id->retry_count;
        attr.rnr_retry = id->rnr_retry_count;
        attr.max_rd_atomic = id->initiator_depth;
        mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
      }
      return 0;
    default:
      return EINVAL;
  }
}

int modify(CmId* id, ibv_qp_state state) {
  ibv_qp_attr attr;
  int mask;
  if (int error = qp_attributes(id, state, attr, mask)) return error;
  return ibv_modify_qp(id->id.qp, &attr, mask);
}

// The device's limits on outstanding RDMA READ/atomic operations.
void clamp_depths(CmId* id) {
  ibv_device_attr attr{};
  if (id->id.verbs && ibv_query_device(id->id.verbs, &attr) == 0) {
    id->responder_resources = static_cast<uint8_t>(std::min<int>(id->responder_resources, attr.max_qp_rd_atom));
    id->initiator_depth = static_cast<uint8_t>(std::min<int>(id->initiator_depth, attr.max_qp_init_rd_atom));
  }
}

void fill_conn_event(QueuedEvent& event, uint8_t responder_resources, uint8_t initiator_depth, uint8_t flow_control,
                     uint8_t retry_count, uint8_t rnr_retry_count, uint8_t srq, uint32_t qp_num) {
  rdma_conn_param& conn = event.event.param.conn;
  conn.responder_resources = responder_resources;
  conn.initiator_depth = initiator_depth;
  conn.flow_control = flow_control;
  conn.retry_count = retry_count;
  conn.rnr_retry_count = rnr_retry_count;
  conn.srq = srq;
  conn.qp_num = qp_num;
}

CmId* new_id(EventChannel* channel, void* context, rdma_port_space ps, ibv_qp_type qp_type) {
  auto id = std::make_unique<CmId>();
  if (channel == nullptr) {
    // A synchronous id: its events go to a private channel that the
    // blocking calls read.
    id->own_channel = std::make_unique<EventChannel>();
    if (!open_channel(*id->own_channel)) return nullptr;
    channel = id->own_channel.get();
  }
  id->channel = channel;
  // As librdmacm: a synchronous id's own channel is its id->channel too.
  id->id.channel = &channel->channel;
  id->id.context = context;
  id->id.ps = ps;
  id->id.qp_type = qp_type;
  id->responder_resources = id->initiator_depth = RDMA_MAX_RESP_RES;
  CmId* raw = id.release();
  Engine::instance().ids.insert(raw);
  return raw;
}

// ---- the CM thread's handlers ---------------------------------------------

void on_request(Engine& engine, CmId* listener, CmAgent* agent, const ReceivedMad& received, uint32_t peer_id,
                uint64_t transaction_id, const Message& message) {
  bool ud = message.type == MessageType::SidrReq;
  CmId* id = new_id(listener->own_channel ? nullptr : listener->channel, listener->id.context, listener->id.ps,
                    listener->id.qp_type);
  if (id == nullptr) return;
  id->listener = listener;
  id->agent = agent;
  id->local_comm_id = agent->next_local_id();
  id->remote_comm_id = peer_id;
  id->transaction_id = transaction_id;
  id->local_gid = received.destination;
  id->peer_gid = received.source;
  id->state = IdState::RequestReceived;
  id->local_psn = engine.random_psn();
  const WireAddress& source = ud ? message.sidr_req.source : message.req.source;
  const WireAddress& destination = ud ? message.sidr_req.destination : message.req.destination;
  id->id.route.addr.src_storage = from_wire(destination);
  id->id.route.addr.dst_storage = from_wire(source);
  id->id.route.addr.addr.ibaddr.sgid = gid_of(id->id.route.addr.src_storage);
  id->id.route.addr.addr.ibaddr.dgid = gid_of(id->id.route.addr.dst_storage);
  id->id.verbs = agent->context();
  id->id.pd = engine.devices.pd_for(agent->context());
  id->id.port_num = 1;
  std::unique_ptr<QueuedEvent> event;
  if (ud) {
    event = event_with_private_data(message.sidr_req.private_data, kSidrReqPrivateData, true);
  } else {
    const ConnectRequest& req = message.req;
    id->request = req;
    id->remote_ece = {req.ece_vendor_id, req.ece_options, 0};
    // The peer's view, mirrored: what it can initiate is what we respond to.
    id->responder_resources = req.initiator_depth;
    id->initiator_depth = req.responder_resources;
    id->retry_count = req.retry_count;
    id->rnr_retry_count = req.rnr_retry_count;
    clamp_depths(id);
    event = event_with_private_data(req.private_data, kReqPrivateData, false);
    fill_conn_event(*event, req.initiator_depth, req.responder_resources, req.flow_control, req.retry_count,
                    req.rnr_retry_count, req.srq, req.qp_num);
  }
  event->event.listen_id = &listener->id;
  // On the listener's channel: rdma_get_request waits there for a synchronous one.
  deliver(id, RDMA_CM_EVENT_CONNECT_REQUEST, 0, std::move(event), listener->channel);
}

void on_message(Engine& engine, CmId* id, const Message& message) {
  switch (message.type) {
    case MessageType::Rep: {
      if (id->state != IdState::RequestSent) return;
      const ConnectReply& rep = message.rep;
      id->reply = rep;
      id->remote_ece = {rep.ece_vendor_id, rep.ece_options, 0};
      id->initiator_depth = std::min(id->initiator_depth, rep.responder_resources);
      auto event = event_with_private_data(rep.private_data, kRepPrivateData, false);
      fill_conn_event(*event, rep.initiator_depth, rep.responder_resources, rep.flow_control, 0, rep.rnr_retry_count,
                      rep.srq, rep.qp_num);
      if (id->id.qp == nullptr) {
        // The application moves its own QP, then calls rdma_establish.
        id->state = IdState::ResponseReceived;
        deliver(id, RDMA_CM_EVENT_CONNECT_RESPONSE, 0, std::move(event));
        return;
      }
      if (modify(id, IBV_QPS_RTR) != 0 || modify(id, IBV_QPS_RTS) != 0) {
        Message rej;
        rej.type = MessageType::Rej;
        rej.rej.reason = mad::reject::kNoQp;
        send_to_peer(id, rej);
        stop_resending(id);
        move_qp_to_error(id);
        id->state = IdState::Disconnected;
        deliver(id, RDMA_CM_EVENT_CONNECT_ERROR, -EINVAL);
        return;
      }
      Message rtu;
      rtu.type = MessageType::Rtu;
      send_to_peer(id, rtu);
      id->state = IdState::Connected;
      deliver(id, RDMA_CM_EVENT_ESTABLISHED, 0, std::move(event));
      return;
    }
    case MessageType::Rtu:
      if (id->state != IdState::ReplySent) return;
      id->state = IdState::Connected;
      deliver(id, RDMA_CM_EVENT_ESTABLISHED, 0);
      return;
    case MessageType::Rej: {
      if (id->state != IdState::RequestSent && id->state != IdState::ReplySent) return;
      auto event = event_with_private_data(message.rej.private_data, kRejPrivateData, false);
      stop_resending(id);
      move_qp_to_error(id);
      id->state = IdState::Disconnected;
      deliver(id, RDMA_CM_EVENT_REJECTED, message.rej.reason, std::move(event));
      return;
    }
    case MessageType::SidrRep: {
      if (id->state != IdState::RequestSent) return;
      const SidrReply& rep = message.sidr_rep;
      stop_resending(id);
      if (rep.status != 0) {
        // As librdmacm reports a SIDR_REP that refuses: UNREACHABLE with
        // its status (1: nobody listens, 2: rejected).
        id->state = IdState::Disconnected;
        deliver(id, RDMA_CM_EVENT_UNREACHABLE, static_cast<int>(rep.status),
                event_with_private_data(rep.private_data, kSidrRepPrivateData, true));
        return;
      }
      auto event = event_with_private_data(rep.private_data, kSidrRepPrivateData, true);
      event->event.param.ud.ah_attr = path_to_peer(id);
      event->event.param.ud.qp_num = rep.qp_num;
      event->event.param.ud.qkey = rep.qkey;
      id->state = IdState::Connected;
      deliver(id, RDMA_CM_EVENT_ESTABLISHED, 0, std::move(event));
      return;
    }
    case MessageType::Dreq: {
      Message drep;
      drep.type = MessageType::Drep;
      send_to_peer(id, drep);
      stop_resending(id);
      // The QP stays as it is, as with librdmacm, whose DISCONNECTED leaves
      // it alone: the application moves it (rdma_disconnect) or destroys it,
      // maybe with ibv_destroy_qp behind the shim's back, so this thread
      // must not touch it.
      if (id->state == IdState::Connected || id->state == IdState::ReplySent) {
        id->state = IdState::Disconnected;
        deliver(id, RDMA_CM_EVENT_DISCONNECTED, 0);
      }
      return;
    }
    case MessageType::Drep:
      stop_resending(id);
      return;
    case MessageType::Req:
    case MessageType::SidrReq:
      return;  // only on a listener's fresh connection
  }
  (void)engine;
}

// The Message a CM MAD carries, as the handlers above take it.
Message message_of(const mad::Mad& in) {
  Message out;
  auto take_private = [](uint8_t* to, uint8_t& length, const uint8_t* from, size_t size) {
    std::memcpy(to, from, size);
    length = static_cast<uint8_t>(size);
  };
  switch (in.attribute) {
    case mad::Attribute::Req: {
      out.type = MessageType::Req;
      const mad::Req& m = in.req;
      ConnectRequest& req = out.req;
      req.qp_num = m.local_qpn;
      req.start_psn = m.starting_psn;
      req.qp_type = static_cast<uint8_t>(m.transport_service_type == 1 ? IBV_QPT_UC : IBV_QPT_RC);
      req.responder_resources = m.responder_resources;
      req.initiator_depth = m.initiator_depth;
      req.retry_count = m.retry_count;
      req.rnr_retry_count = m.rnr_retry_count;
      req.flow_control = m.end_to_end_flow_control;
      req.srq = m.srq;
      req.path_mtu = m.path_mtu;
      req.ece_vendor_id = m.vendor_id;
      req.ece_options = m.local_eecn;
      if (const auto ip = mad::get_ip_header(m.private_data)) {
        req.source = wire_address(ip->source, ip->ip_version, ip->source_port);
        req.destination = wire_address(ip->destination, ip->ip_version, static_cast<uint16_t>(m.service_id));
      }
      take_private(req.private_data, req.private_data_length, m.private_data.data() + mad::kIpHeaderBytes,
                   kReqPrivateData);
      break;
    }
    case mad::Attribute::Rep: {
      out.type = MessageType::Rep;
      const mad::Rep& m = in.rep;
      ConnectReply& rep = out.rep;
      rep.qp_num = m.local_qpn;
      rep.start_psn = m.starting_psn;
      rep.responder_resources = m.responder_resources;
      rep.initiator_depth = m.initiator_depth;
      rep.rnr_retry_count = m.rnr_retry_count;
      rep.flow_control = m.end_to_end_flow_control;
      rep.srq = m.srq;
      rep.ece_options = m.local_eecn;
      take_private(rep.private_data, rep.private_data_length, m.private_data.data(), kRepPrivateData);
      break;
    }
    case mad::Attribute::Rtu:
      out.type = MessageType::Rtu;
      break;
    case mad::Attribute::Rej:
      out.type = MessageType::Rej;
      out.rej.reason = in.rej.reason;
      take_private(out.rej.private_data, out.rej.private_data_length, in.rej.private_data.data(), kRejPrivateData);
      break;
    case mad::Attribute::Dreq:
      out.type = MessageType::Dreq;
      break;
    case mad::Attribute::Drep:
      out.type = MessageType::Drep;
      break;
    case mad::Attribute::SidrReq:
      out.type = MessageType::SidrReq;
      if (const auto ip = mad::get_ip_header(in.sidr_req.private_data)) {
        out.sidr_req.source = wire_address(ip->source, ip->ip_version, ip->source_port);
        out.sidr_req.destination =
            wire_address(ip->destination, ip->ip_version, static_cast<uint16_t>(in.sidr_req.service_id));
      }
      take_private(out.sidr_req.private_data, out.sidr_req.private_data_length,
                   in.sidr_req.private_data.data() + mad::kIpHeaderBytes, kSidrReqPrivateData);
      break;
    case mad::Attribute::SidrRep:
      out.type = MessageType::SidrRep;
      out.sidr_rep.status = in.sidr_rep.status;
      out.sidr_rep.qp_num = in.sidr_rep.qpn;
      out.sidr_rep.qkey = in.sidr_rep.qkey;
      take_private(out.sidr_rep.private_data, out.sidr_rep.private_data_length, in.sidr_rep.private_data.data(),
                   kSidrRepPrivateData);
      break;
    default:
      break;
  }
  return out;
}

// Answers a MAD for which no id exists, as the kernel's CM does, but a
// REP: one for an id destroyed after its REQ went out is left to time out
// (docs/rdmacm.md).
void answer_without_id(CmAgent* agent, const ReceivedMad& received, const mad::Mad& in) {
  if (in.attribute == mad::Attribute::Rep) return;
  if (const auto answer = unclaimed_answer(in)) agent->send(received.destination, received.source, 0, *answer);
}

CmId* id_by_local(Engine& engine, const CmAgent* agent, uint32_t local_comm_id) {
  for (CmId* id : engine.ids)
    if (id->agent == agent && id->local_comm_id == local_comm_id && id->state != IdState::Listening) return id;
  return nullptr;
}

// A REQ or SIDR_REQ: a new id for the listener it names, or the answer to
// one resent.
void on_incoming_request(Engine& engine, CmAgent* agent, const ReceivedMad& received, const mad::Mad& in) {
  const bool ud = in.attribute == mad::Attribute::SidrReq;
  const uint32_t peer_id = ud ? in.sidr_req.request_id : in.req.local_comm_id;
  for (CmId* id : engine.ids) {
    if (id->agent != agent || id->remote_comm_id != peer_id || id->peer_gid != received.source ||
        id->listener == nullptr)
      continue;
    // Resent: the application has not accepted yet (an MRA says to wait),
    // or our REP was lost (sent again).
    if (id->state == IdState::RequestReceived && !ud) {
      mad::Mad mra;
      mra.attribute = mad::Attribute::Mra;
      mra.transaction_id = in.transaction_id;
      mra.mra.local_comm_id = id->local_comm_id;
      mra.mra.remote_comm_id = peer_id;
      mra.mra.message = mad::MessageRejected::Req;
      mra.mra.service_timeout = kMraServiceTimeout;
      agent->send(id->local_gid, id->peer_gid, id->tos, mad::build_cm_mad(mra));
    } else if (id->awaiting_answer) {
      agent->send(id->local_gid, id->peer_gid, id->tos, id->awaiting_answer->mad);
    } else if (id->last_answer) {
      agent->send(id->local_gid, id->peer_gid, id->tos, *id->last_answer);
    }
    return;
  }
  const uint64_t service_id = ud ? in.sidr_req.service_id : in.req.service_id;
  const Message message = message_of(in);
  const WireAddress& destination = ud ? message.sidr_req.destination : message.req.destination;
  const sockaddr_storage wanted = from_wire(destination);
  const auto wanted_gid = gid_bytes(wanted);
  CmId* listener = nullptr;
  for (CmId* id : engine.ids) {
    if (id->state != IdState::Listening || port_space_of(id) != (service_id >> 16 & 0xffff) ||
        port_of(id->id.route.addr.src_storage) != (service_id & 0xffff))
      continue;
    const bool registered = std::any_of(id->listening.begin(), id->listening.end(),
                                        [&](const auto& entry) { return entry.first == agent; });
    if (!registered) continue;
    if (gid_bytes(id->id.route.addr.src_storage) == wanted_gid) {
      listener = id;
      break;
    }
    if (is_wildcard(id->id.route.addr.src_storage)) listener = id;
  }
  if (listener == nullptr) {
    answer_without_id(agent, received, in);
    return;
  }
  on_request(engine, listener, agent, received, peer_id, in.transaction_id, message);
}

void on_mad(Engine& engine, CmAgent* agent, const ReceivedMad& received) {
  const auto parsed = mad::parse_cm_mad(received.bytes);
  if (!parsed) return;
  const mad::Mad& in = *parsed;
  if (in.attribute == mad::Attribute::Req || in.attribute == mad::Attribute::SidrReq) {
    on_incoming_request(engine, agent, received, in);
    return;
  }
  const auto route = mad::cm_route(received.bytes);
  if (in.attribute == mad::Attribute::Drep && route) {
    std::erase_if(engine.lingering, [&](const Engine::Lingering& entry) {
      return entry.agent == agent && entry.local_comm_id == route->receiver_id;
    });
  }
  CmId* id = route ? id_by_local(engine, agent, route->receiver_id) : nullptr;
  if (id == nullptr || id->peer_gid != received.source) {
    if (id == nullptr) answer_without_id(agent, received, in);
    return;
  }
  const Clock::time_point now = Clock::now();
  switch (in.attribute) {
    case mad::Attribute::Mra:
      // The peer's application has yet to accept: wait as long as it asks.
      if (id->awaiting_answer) {
        id->awaiting_answer->at = now + kMraWait + kResendAfter;
        id->awaiting_answer->left = kMaxCmRetries;
      }
      return;
    case mad::Attribute::Rep:
      if (id->state != IdState::RequestSent) {
        // Our RTU was lost and the REP comes again.
        if (id->last_answer && id->remote_comm_id == in.rep.local_comm_id)
          agent->send(id->local_gid, id->peer_gid, id->tos, *id->last_answer);
        return;
      }
      id->remote_comm_id = in.rep.local_comm_id;
      stop_resending(id);
      break;
    case mad::Attribute::Rej:
      if (id->state == IdState::RequestSent && in.rej.reason == mad::reject::kInvalidServiceId &&
          now - id->request_sent_at < kListenerGrace) {
        // No listener yet: one may be a moment away (see kListenerGrace).
        if (id->awaiting_answer) {
          id->awaiting_answer->at = now + kListenerRetry;
          ++id->awaiting_answer->left;
        }
        return;
      }
      stop_resending(id);
      break;
    case mad::Attribute::Rtu:
    case mad::Attribute::Drep:
    case mad::Attribute::SidrRep:
      stop_resending(id);
      break;
    default:
      break;
  }
  on_message(engine, id, message_of(in));
}

// What was resent enough times and never answered.
void on_no_answer(CmId* id) {
  id->awaiting_answer.reset();
  switch (id->state) {
    case IdState::RequestSent:
    case IdState::ReplySent:
      // As the kernel's rdma_cm reports a REQ or REP that timed out.
      id->state = IdState::Disconnected;
      deliver(id, RDMA_CM_EVENT_UNREACHABLE, -ETIMEDOUT);
      break;
    default:
      break;  // a DREQ: the disconnect was reported already
  }
}

void Engine::run() {
  // Allocated and freed only under the engine's lock, which fork() holds
  // (see the constructor): a child forked while this thread sat in the
  // allocator could find the allocator's lock taken for ever (a suspect
  // for one hang of a forked rdmacm_api_test child in the sanitizer build).
  std::vector<pollfd> fds;
  std::vector<CmAgent*> polled;
  for (;;) {
    int timeout_ms = -1;
    {
      std::lock_guard guard(mutex);
      fds.clear();
      polled.clear();
      fds.push_back({wake_read_, POLLIN, 0});
      for (auto& [context, agent] : agents) {
        fds.push_back({agent->event_fd(), POLLIN, 0});
        polled.push_back(agent.get());
      }
      const Clock::time_point now = Clock::now();
      auto until = [&](Clock::time_point when) {
        const auto wait = std::chrono::ceil<std::chrono::milliseconds>(when - now).count();
        const int ms = static_cast<int>(std::clamp<int64_t>(wait, 0, 60000));
        timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
      };
      for (CmId* id : ids)
        if (id->awaiting_answer) until(id->awaiting_answer->at);
      for (const Lingering& entry : lingering) until(entry.dreq.at);
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) continue;
    if (fds[0].revents) {
      char drain[64];
      while (read(wake_read_, drain, sizeof drain) > 0) {
      }
    }
    std::lock_guard guard(mutex);
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      CmAgent* agent = polled[i - 1];
      const bool still_there =
          std::any_of(agents.begin(), agents.end(), [agent](const auto& entry) { return entry.second.get() == agent; });
      if (!still_there) continue;
      for (const ReceivedMad& received : agent->take()) on_mad(*this, agent, received);
    }
    const Clock::time_point now = Clock::now();
    for (CmId* id : std::vector<CmId*>(ids.begin(), ids.end())) {
      if (!ids.count(id) || !id->awaiting_answer) continue;
      const Due due = step(*id->awaiting_answer, now);
      if (due == Due::Resend && id->agent)
        id->agent->send(id->local_gid, id->peer_gid, id->tos, id->awaiting_answer->mad);
      if (due == Due::Exhausted) on_no_answer(id);
    }
    std::erase_if(lingering, [&](Lingering& entry) {
      const Due due = step(entry.dreq, now);
      if (due == Due::Resend) entry.agent->send(entry.local_gid, entry.peer_gid, entry.tos, entry.dreq.mad);
      return due == Due::Exhausted;
    });
    if (lingering.empty()) lingering_drained.notify_all();
  }
}

// Waits on a synchronous id's private channel for one of `wanted`.
std::unique_ptr<QueuedEvent> wait_for(CmId* id, std::initializer_list<rdma_cm_event_type> wanted) {
  Engine& engine = Engine::instance();
  std::unique_lock guard(engine.mutex);
  EventChannel& channel = *id->own_channel;
  for (;;) {
    channel.ready.wait(guard, [&] { return !channel.queue.empty(); });
    std::unique_ptr<QueuedEvent> event = std::move(channel.queue.front());
    channel.queue.pop_front();
    take_signal_byte(channel);
    for (rdma_cm_event_type type : wanted)
      if (event->event.event == type) return event;
  }
}

// After a synchronous operation: 0 for the expected event, else -1 with the
// errno librdmacm uses for that outcome.
int finish_sync(CmId* id, std::unique_ptr<QueuedEvent> event, rdma_cm_event_type success) {
  if (!event) return fail(EIO);
  rdma_cm_event_type type = event->event.event;
  int status = event->event.status;
  id->held_event = std::move(event);
  id->id.event = &id->held_event->event;
  if (type == success) return 0;
  if (type == RDMA_CM_EVENT_REJECTED) return fail(ECONNREFUSED);
  if (type == RDMA_CM_EVENT_UNREACHABLE) return fail(ETIMEDOUT);
  return fail(status < 0 ? -status : EIO);
}

}  // namespace

namespace {

// The id an event counts for, as librdmacm counts it: a connection request
// for its listener (rdma_destroy_id of the new id does not wait for it; of
// the listener, it does), every other event for its own id. nullptr once
// that id is gone.
CmId* event_owner(Engine& engine, const rdma_cm_event& event) {
  rdma_cm_id* counted = event.event == RDMA_CM_EVENT_CONNECT_REQUEST && event.listen_id ? event.listen_id : event.id;
  CmId* id = priv(counted);
  return engine.ids.count(id) ? id : nullptr;
}

}  // namespace

// ---- channels and ids ----------------------------------------------------------

rdma_event_channel* create_event_channel() {
  auto channel = std::make_unique<EventChannel>();
  if (!open_channel(*channel)) return nullptr;
  return &channel.release()->channel;
}

void destroy_event_channel(rdma_event_channel* public_channel) {
  if (public_channel == nullptr) return;
  std::lock_guard guard(Engine::instance().mutex);
  EventChannel* channel = priv(public_channel);
  close(channel->channel.fd);
  close(channel->signal_write);
  channel->queue.clear();
  channel->destroyed = true;
  channel->destroyed_by = std::this_thread::get_id();
  // Another thread in rdma_get_cm_event on it keeps blocking, as on the
  // kernel's channel (rping's CM thread does until the process exits), and
  // so does one that gets there a moment later (rping's, when its main
  // thread tears down faster than the kernel's DREP would have come): so
  // the channel's memory stays, with the engine, which lives as long.
  Engine::instance().retired_channels.emplace_back(channel);
}

int create_id(rdma_event_channel* channel, rdma_cm_id** out, void* context, rdma_port_space ps, ibv_qp_type qp_type) {
  if (out == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  std::lock_guard guard(engine.mutex);
  engine.start_thread();
  CmId* id = new_id(channel ? priv(channel) : nullptr, context, ps, qp_type);
  if (id == nullptr) return fail(ENOMEM);
  *out = &id->id;
  return 0;
}

int destroy_id(rdma_cm_id* public_id) {
  if (public_id == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  std::unique_ptr<CmId> id;
  {
    std::unique_lock guard(engine.mutex);
    CmId* raw = priv(public_id);
    if (!engine.ids.count(raw)) return fail(EINVAL);
    // As librdmacm: events the application has taken must be acked first;
    // events it has not taken are dropped.
    for (EventChannel* channel : {raw->channel, raw->listener ? raw->listener->channel : nullptr}) {
      if (channel == nullptr || raw->own_channel) continue;
      for (auto it = channel->queue.begin(); it != channel->queue.end();) {
        if ((*it)->event.id == public_id) {
          it = channel->queue.erase(it);
          take_signal_byte(*channel);
        } else {
          ++it;
        }
      }
    }
    engine.events_acked.wait(guard, [raw] { return raw->events_acked >= raw->events_taken; });
    engine.ids.erase(raw);
    id.reset(raw);
    if (id->agent != nullptr && id->state == IdState::Connected) {
      // The DREQ lingers after the id (see Engine::lingering).
      Message dreq;
      dreq.type = MessageType::Dreq;
      send_to_peer(id.get(), dreq);
    } else if (id->agent != nullptr && !is_ud(id.get()) &&
               (id->state == IdState::RequestReceived || id->state == IdState::ReplySent ||
                id->state == IdState::ResponseReceived)) {
      // Mid-handshake, as the kernel's IB CM: a REJ (consumer), so that the
      // peer does not wait out its retries.
      Message rej;
      rej.type = MessageType::Rej;
      rej.rej.reason = mad::reject::kConsumer;
      send_to_peer(id.get(), rej);
    }
    if (id->awaiting_answer && id->agent != nullptr && carries_dreq(id->awaiting_answer->mad))
      engine.lingering.push_back(
          {id->agent, id->local_comm_id, id->local_gid, id->peer_gid, id->tos, *id->awaiting_answer});
    stop_resending(id.get());
    const uint64_t service_id = mad::service_id(port_space_of(id.get()), port_of(id->id.route.addr.src_storage));
    for (const auto& [agent, address] : id->listening) agent->remove_listener(service_id, address);
    if (id->listed) engine.directory->release(id->id.route.addr.src_storage);
    for (CmId* other : engine.ids)
      if (other->listener == id.get()) other->listener = nullptr;
  }
  engine.wake();
  if (id->own_channel) {
    close(id->own_channel->channel.fd);
    close(id->own_channel->signal_write);
  }
  return 0;
}

int bind_addr(rdma_cm_id* public_id, const sockaddr* address) {
  if (public_id == nullptr || address == nullptr) return fail(EINVAL);
  if (address->sa_family != AF_INET && address->sa_family != AF_INET6) return fail(EAFNOSUPPORT);
  Engine& engine = Engine::instance();
  std::lock_guard guard(engine.mutex);
  CmId* id = priv(public_id);
  if (id->state != IdState::Idle) return fail(EINVAL);
  sockaddr_storage local;
  copy_address(local, address);
  if (!is_wildcard(local) && !is_local_address(local)) return fail(EADDRNOTAVAIL);
  if (port_of(local) == 0) {
    uint16_t port = htons(engine.directory->free_port());
    if (local.ss_family == AF_INET)
      reinterpret_cast<sockaddr_in&>(local).sin_port = port;
    else
      reinterpret_cast<sockaddr_in6&>(local).sin6_port = port;
  }
  id->id.route.addr.src_storage = local;
  // A wildcard bind has no device yet, as with the kernel's rdma_cm.
  if (!is_wildcard(local)) {
    if (!attach_device(id, engine.devices, local)) return fail(ENODEV);
    id->id.route.addr.addr.ibaddr.sgid = gid_of(local);
  }
  id->state = IdState::Bound;
  return 0;
}

int resolve_addr(rdma_cm_id* public_id, const sockaddr* source, const sockaddr* destination, int) {
  if (public_id == nullptr || destination == nullptr) return fail(EINVAL);
  if (destination->sa_family != AF_INET && destination->sa_family != AF_INET6) return fail(EAFNOSUPPORT);
  Engine& engine = Engine::instance();
  CmId* id = priv(public_id);
  {
    std::lock_guard guard(engine.mutex);
    if (id->state != IdState::Idle && id->state != IdState::Bound) return fail(EINVAL);
    if (source != nullptr && id->state == IdState::Idle && bind_addr(public_id, source) != 0) return -1;
    sockaddr_storage remote;
    copy_address(remote, destination);
    sockaddr_storage local = id->id.route.addr.src_storage;
    int error = 0;
    if (id->state == IdState::Idle || is_wildcard(local)) {
      uint16_t port = id->state == IdState::Idle ? htons(engine.directory->free_port()) : htons(port_of(local));
      error = route_source(remote, local);
      if (local.ss_family == AF_INET)
        reinterpret_cast<sockaddr_in&>(local).sin_port = port;
      else
        reinterpret_cast<sockaddr_in6&>(local).sin6_port = port;
    }
    id->id.route.addr.dst_storage = remote;
    if (error != 0 || !attach_device(id, engine.devices, local)) {
      if (id->own_channel) return fail(error ? error : ENODEV);
      deliver(id, RDMA_CM_EVENT_ADDR_ERROR, -(error ? error : ENODEV));
      return 0;
    }
    id->id.route.addr.src_storage = local;
    id->id.route.addr.addr.ibaddr.sgid = gid_of(local);
    id->id.route.addr.addr.ibaddr.dgid = gid_of(remote);
    id->state = IdState::AddressResolved;
    if (!id->own_channel) deliver(id, RDMA_CM_EVENT_ADDR_RESOLVED, 0);
  }
  return 0;
}

int resolve_route(rdma_cm_id* public_id, int) {
  if (public_id == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->state != IdState::AddressResolved) return fail(EINVAL);
  // One path record, as an IB SA or RoCE resolution reports it.
  ibv_sa_path_rec& path = id->path;
  path = {};
  path.dgid = id->id.route.addr.addr.ibaddr.dgid;
  path.sgid = id->id.route.addr.addr.ibaddr.sgid;
  path.pkey = htons(0xffff);
  path.hop_limit = kHopLimit;
  path.traffic_class = id->tos;
  path.reversible = 1;
  path.numb_path = 1;
  // RoCE's path MTU is what the port's netdev carries.
  ibv_port_attr port{};
  path.mtu = id->id.verbs && ibv_query_port(id->id.verbs, 1, &port) == 0 ? port.active_mtu : IBV_MTU_1024;
  path.mtu_selector = 2;
  path.rate_selector = 2;
  path.rate = 3;
  path.packet_life_time_selector = 2;
  path.packet_life_time = 14;
  id->id.route.path_rec = &path;
  id->id.route.num_paths = 1;
  id->state = IdState::RouteResolved;
  if (!id->own_channel) deliver(id, RDMA_CM_EVENT_ROUTE_RESOLVED, 0);
  return 0;
}

// ---- queue pairs ---------------------------------------------------------------

namespace {

// Completion channels and CQs the application did not provide, with the id as
// cq_context, as librdmacm creates them for the rdma_post_*/get_*_comp inlines.
int create_missing_cqs(CmId* id, ibv_cq*& send_cq, ibv_cq*& recv_cq, uint32_t send_depth, uint32_t recv_depth) {
  if (recv_cq == nullptr) {
    id->id.recv_cq_channel = ibv_create_comp_channel(id->id.verbs);
    id->id.recv_cq = ibv_create_cq(id->id.verbs, std::max<uint32_t>(recv_depth, 1), &id->id, id->id.recv_cq_channel, 0);
    if (id->id.recv_cq == nullptr) return errno ? errno : ENOMEM;
    recv_cq = id->id.recv_cq;
    id->owns_cqs = true;
  }
  if (send_cq == nullptr) {
    id->id.send_cq_channel = ibv_create_comp_channel(id->id.verbs);
    id->id.send_cq = ibv_create_cq(id->id.verbs, std::max<uint32_t>(send_depth, 1), &id->id, id->id.send_cq_channel, 0);
    if (id->id.send_cq == nullptr) return errno ? errno : ENOMEM;
    send_cq = id->id.send_cq;
    id->owns_cqs = true;
  }
  return 0;
}

void destroy_owned_cqs(CmId* id) {
  if (!id->owns_cqs) return;
  if (id->id.send_cq) ibv_destroy_cq(id->id.send_cq);
  if (id->id.recv_cq) ibv_destroy_cq(id->id.recv_cq);
  if (id->id.send_cq_channel) ibv_destroy_comp_channel(id->id.send_cq_channel);
  if (id->id.recv_cq_channel) ibv_destroy_comp_channel(id->id.recv_cq_channel);
  id->id.send_cq = id->id.recv_cq = nullptr;
  id->id.send_cq_channel = id->id.recv_cq_channel = nullptr;
  id->owns_cqs = false;
}

// After creation: INIT for connected QPs; a UD QP goes straight to RTS.
int prepare_qp(CmId* id) {
  int error = modify(id, IBV_QPS_INIT);
  if (error == 0 && is_ud(id)) {
    error = modify(id, IBV_QPS_RTR);
    if (error == 0) error = modify(id, IBV_QPS_RTS);
  }
  return error;
}

}  // namespace

int create_qp(rdma_cm_id* public_id, ibv_pd* pd, ibv_qp_init_attr* attr) {
  if (public_id == nullptr || attr == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.verbs == nullptr || id->id.qp != nullptr) return fail(EINVAL);
  if (pd == nullptr) pd = id->id.pd;
  if (pd == nullptr || pd->context != id->id.verbs) return fail(EINVAL);
  ibv_qp_init_attr local = *attr;
  if (int error = create_missing_cqs(id, local.send_cq, local.recv_cq, local.cap.max_send_wr, local.cap.max_recv_wr)) {
    destroy_owned_cqs(id);
    return fail(error);
  }
  if (local.srq == nullptr) local.srq = id->id.srq;
  ibv_qp* qp = ibv_create_qp(pd, &local);
  if (qp == nullptr) {
    int error = errno;
    destroy_owned_cqs(id);
    return fail(error);
  }
  id->id.qp = qp;
  id->id.qp_type = qp->qp_type;
  if (int error = prepare_qp(id)) {
    ibv_destroy_qp(qp);
    id->id.qp = nullptr;
    destroy_owned_cqs(id);
    return fail(error);
  }
  id->id.pd = qp->pd;  // as librdmacm: rdma_reg_msgs registers in the QP's PD
  attr->cap = local.cap;
  attr->send_cq = local.send_cq;
  attr->recv_cq = local.recv_cq;
  return 0;
}

int create_qp_ex(rdma_cm_id* public_id, ibv_qp_init_attr_ex* attr) {
  if (public_id == nullptr || attr == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.verbs == nullptr || id->id.qp != nullptr) return fail(EINVAL);
  if (!(attr->comp_mask & IBV_QP_INIT_ATTR_PD) || attr->pd == nullptr) {
    attr->comp_mask |= IBV_QP_INIT_ATTR_PD;
    attr->pd = id->id.pd;
  }
  if (int error = create_missing_cqs(id, attr->send_cq, attr->recv_cq, attr->cap.max_send_wr, attr->cap.max_recv_wr)) {
    destroy_owned_cqs(id);
    return fail(error);
  }
  if (attr->srq == nullptr) attr->srq = id->id.srq;
  ibv_qp* qp = ibv_create_qp_ex(id->id.verbs, attr);
  if (qp == nullptr) {
    int error = errno;
    destroy_owned_cqs(id);
    return fail(error);
  }
  id->id.qp = qp;
  id->id.qp_type = qp->qp_type;
  if (int error = prepare_qp(id)) {
    ibv_destroy_qp(qp);
    id->id.qp = nullptr;
    destroy_owned_cqs(id);
    return fail(error);
  }
  id->id.pd = qp->pd;
  return 0;
}

void destroy_qp(rdma_cm_id* public_id) {
  if (public_id == nullptr) return;
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.qp) ibv_destroy_qp(id->id.qp);
  id->id.qp = nullptr;
  destroy_owned_cqs(id);
}

int create_srq(rdma_cm_id* public_id, ibv_pd* pd, ibv_srq_init_attr* attr) {
  if (public_id == nullptr || attr == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.verbs == nullptr || id->id.srq != nullptr) return fail(EINVAL);
  ibv_srq* srq = ibv_create_srq(pd ? pd : id->id.pd, attr);
  if (srq == nullptr) return -1;
  id->id.srq = srq;
  return 0;
}

int create_srq_ex(rdma_cm_id* public_id, ibv_srq_init_attr_ex* attr) {
  if (public_id == nullptr || attr == nullptr) return fail(EINVAL);
  ibv_srq_init_attr basic{};
  basic.srq_context = attr->srq_context;
  basic.attr = attr->attr;
  if ((attr->comp_mask & IBV_SRQ_INIT_ATTR_TYPE) && attr->srq_type != IBV_SRQT_BASIC) return fail(EOPNOTSUPP);
  int result = create_srq(public_id, (attr->comp_mask & IBV_SRQ_INIT_ATTR_PD) ? attr->pd : nullptr, &basic);
  attr->attr = basic.attr;
  return result;
}

void destroy_srq(rdma_cm_id* public_id) {
  if (public_id == nullptr) return;
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.srq) ibv_destroy_srq(id->id.srq);
  id->id.srq = nullptr;
}

// ---- connections -----------------------------------------------------------------

int connect(rdma_cm_id* public_id, const rdma_conn_param* param) {
  if (public_id == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  CmId* id = priv(public_id);
  {
    std::lock_guard guard(engine.mutex);
    if (id->state != IdState::RouteResolved) return fail(EINVAL);
    bool ud = is_ud(id);
    size_t limit = ud ? kSidrReqPrivateData : kReqPrivateData;
    if (param && param->private_data_len > limit) return fail(EINVAL);
    if (param && param->private_data_len && param->private_data == nullptr) return fail(EINVAL);
    id->local_psn = engine.random_psn();
    if (param) {
      id->responder_resources = param->responder_resources;
      id->initiator_depth = param->initiator_depth;
      id->retry_count = std::min<uint8_t>(param->retry_count, 7);
      id->rnr_retry_count = std::min<uint8_t>(param->rnr_retry_count, 7);
    }
    clamp_depths(id);
    const sockaddr_storage& destination = id->id.route.addr.dst_storage;
    CmAgent* agent = engine.agent_for(id->id.verbs);
    if (agent == nullptr) {
      id->state = IdState::Disconnected;
      deliver(id, RDMA_CM_EVENT_UNREACHABLE, -ENODEV);
    } else {
      id->agent = agent;
      id->local_comm_id = agent->next_local_id();
      id->transaction_id = random_u64();
      id->local_gid = source_gid(agent, id->id.route.addr.src_storage, destination);
      id->peer_gid = gid_bytes(destination);
      Message message;
      if (ud) {
        message.type = MessageType::SidrReq;
        message.sidr_req.source = to_wire(id->id.route.addr.src_storage);
        message.sidr_req.destination = to_wire(destination);
        if (param && param->private_data_len) {
          message.sidr_req.private_data_length = param->private_data_len;
          std::memcpy(message.sidr_req.private_data, param->private_data, param->private_data_len);
        }
      } else {
        ConnectRequest& req = message.req;
        message.type = MessageType::Req;
        req.qp_num = id->id.qp ? id->id.qp->qp_num : (param ? param->qp_num : 0);
        req.start_psn = id->local_psn;
        req.qp_type = static_cast<uint8_t>(id->id.qp_type);
        req.responder_resources = id->responder_resources;
        req.initiator_depth = id->initiator_depth;
        req.retry_count = id->retry_count;
        req.rnr_retry_count = id->rnr_retry_count;
        req.flow_control = param ? param->flow_control : 1;
        req.srq = id->id.srq != nullptr || (param && param->srq);
        req.ece_vendor_id = id->local_ece.vendor_id;
        req.ece_options = id->local_ece.options;
        req.source = to_wire(id->id.route.addr.src_storage);
        req.destination = to_wire(destination);
        ibv_port_attr port{};
        if (ibv_query_port(id->id.verbs, 1, &port) == 0) req.path_mtu = static_cast<uint8_t>(port.active_mtu);
        if (param && param->private_data_len) {
          req.private_data_length = param->private_data_len;
          std::memcpy(req.private_data, param->private_data, param->private_data_len);
        }
      }
      id->state = IdState::RequestSent;
      id->request_sent_at = Clock::now();
      engine.start_thread();
      if (!send_to_peer(id, message)) {
        stop_resending(id);
        id->state = IdState::Disconnected;
        deliver(id, RDMA_CM_EVENT_UNREACHABLE, -ENETUNREACH);
      }
    }
  }
  engine.wake();
  if (!id->own_channel) return 0;
  auto event = wait_for(id, {RDMA_CM_EVENT_ESTABLISHED, RDMA_CM_EVENT_CONNECT_RESPONSE, RDMA_CM_EVENT_REJECTED,
                             RDMA_CM_EVENT_UNREACHABLE, RDMA_CM_EVENT_CONNECT_ERROR});
  rdma_cm_event_type success = event && event->event.event == RDMA_CM_EVENT_CONNECT_RESPONSE
                                   ? RDMA_CM_EVENT_CONNECT_RESPONSE
                                   : RDMA_CM_EVENT_ESTABLISHED;
  return finish_sync(id, std::move(event), success);
}

int establish(rdma_cm_id* public_id) {
  if (public_id == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.qp != nullptr || id->state != IdState::ResponseReceived) return fail(EINVAL);
  Message rtu;
  rtu.type = MessageType::Rtu;
  if (!send_to_peer(id, rtu)) return fail(ECONNRESET);
  id->state = IdState::Connected;
  return 0;
}

int listen(rdma_cm_id* public_id, int) {
  if (public_id == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  {
    std::lock_guard guard(engine.mutex);
    CmId* id = priv(public_id);
    if (id->state == IdState::Idle) {
      sockaddr_in any{};
      any.sin_family = AF_INET;
      if (bind_addr(public_id, reinterpret_cast<sockaddr*>(&any)) != 0) return -1;
    }
    if (id->state != IdState::Bound) return fail(EINVAL);
    sockaddr_storage local = id->id.route.addr.src_storage;
    if (int error = engine.directory->claim(local)) return fail(error);
    // The devices that route REQs for the port here: the address's, or for
    // a wildcard every one.
    std::vector<ibv_context*> contexts;
    if (is_wildcard(local))
      contexts = engine.devices.all();
    else
      contexts.push_back(id->id.verbs);
    const uint64_t service_id = mad::service_id(port_space_of(id), port_of(local));
    const std::array<uint8_t, 16> address = is_wildcard(local) ? std::array<uint8_t, 16>{} : gid_bytes(local);
    int error = 0;
    for (ibv_context* context : contexts) {
      CmAgent* agent = engine.agent_for(context);
      if (agent == nullptr) continue;  // not a softverbs device
      error = agent->add_listener(service_id, address);
      if (error != 0) break;
      id->listening.emplace_back(agent, address);
    }
    if (error == 0 && id->listening.empty()) error = ENODEV;
    if (error != 0) {
      debug_log("rdma_listen on %s: %s", address_key(local).c_str(), strerror(error));
      for (const auto& [agent, where] : id->listening) agent->remove_listener(service_id, where);
      id->listening.clear();
      engine.directory->release(local);
      return fail(error);
    }
    id->listed = true;
    id->state = IdState::Listening;
    engine.start_thread();
  }
  engine.wake();
  return 0;
}

int get_request(rdma_cm_id* listen_id, rdma_cm_id** out) {
  if (listen_id == nullptr || out == nullptr) return fail(EINVAL);
  CmId* listener = priv(listen_id);
  if (!listener->own_channel || listener->state != IdState::Listening) return fail(EINVAL);
  auto event = wait_for(listener, {RDMA_CM_EVENT_CONNECT_REQUEST});
  if (!event) return fail(EIO);
  CmId* id = priv(event->event.id);
  std::lock_guard guard(Engine::instance().mutex);
  id->held_event = std::move(event);
  id->id.event = &id->held_event->event;
  if (listener->endpoint_qp_attr) {
    ibv_qp_init_attr attr = *listener->endpoint_qp_attr;
    if (create_qp(&id->id, listener->endpoint_pd, &attr) != 0) {
      int error = errno;
      reject(&id->id, nullptr, 0, kRejectConsumer);
      destroy_id(&id->id);
      return fail(error);
    }
  }
  *out = &id->id;
  return 0;
}

int accept(rdma_cm_id* public_id, const rdma_conn_param* param) {
  if (public_id == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  CmId* id = priv(public_id);
  bool wait = false;
  {
    std::lock_guard guard(engine.mutex);
    if (id->state != IdState::RequestReceived || id->agent == nullptr) return fail(EINVAL);
    size_t limit = is_ud(id) ? kSidrRepPrivateData : kRepPrivateData;
    if (param && param->private_data_len > limit) return fail(EINVAL);
    if (param && param->private_data_len && param->private_data == nullptr) return fail(EINVAL);
    Message message;
    if (is_ud(id)) {
      message.type = MessageType::SidrRep;
      message.sidr_rep.qp_num = id->id.qp ? id->id.qp->qp_num : (param ? param->qp_num : 0);
      message.sidr_rep.qkey = RDMA_UDP_QKEY;
      if (param && param->private_data_len) {
        message.sidr_rep.private_data_length = param->private_data_len;
        std::memcpy(message.sidr_rep.private_data, param->private_data, param->private_data_len);
      }
      bool sent = send_to_peer(id, message);
      stop_resending(id);
      id->state = IdState::Connected;
      return sent ? 0 : fail(ECONNRESET);
    }
    if (param) {
      id->responder_resources = param->responder_resources;
      id->initiator_depth = param->initiator_depth;
      id->rnr_retry_count = std::min<uint8_t>(param->rnr_retry_count, 7);
      clamp_depths(id);
    }
    if (id->id.qp != nullptr && (modify(id, IBV_QPS_RTR) != 0 || modify(id, IBV_QPS_RTS) != 0)) {
      int error = errno ? errno : EINVAL;
      return fail(error);
    }
    ConnectReply& rep = message.rep;
    message.type = MessageType::Rep;
    rep.qp_num = id->id.qp ? id->id.qp->qp_num : (param ? param->qp_num : 0);
    rep.start_psn = id->local_psn;
    rep.responder_resources = id->responder_resources;
    rep.initiator_depth = id->initiator_depth;
    rep.rnr_retry_count = id->rnr_retry_count;
    rep.flow_control = param ? param->flow_control : 1;
    rep.srq = id->id.srq != nullptr || (param && param->srq);
    rep.ece_vendor_id = id->local_ece.vendor_id;
    rep.ece_options = id->local_ece.options;
    if (param && param->private_data_len) {
      rep.private_data_length = param->private_data_len;
      std::memcpy(rep.private_data, param->private_data, param->private_data_len);
    }
    id->state = IdState::ReplySent;
    if (!send_to_peer(id, message)) {
      id->state = IdState::RequestReceived;
      return fail(ECONNRESET);
    }
    wait = id->own_channel != nullptr;
  }
  if (!wait) return 0;
  auto event = wait_for(id, {RDMA_CM_EVENT_ESTABLISHED, RDMA_CM_EVENT_DISCONNECTED, RDMA_CM_EVENT_REJECTED});
  return finish_sync(id, std::move(event), RDMA_CM_EVENT_ESTABLISHED);
}

int reject(rdma_cm_id* public_id, const void* private_data, uint8_t length, uint16_t reason) {
  if (public_id == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->state != IdState::RequestReceived || id->agent == nullptr) return fail(EINVAL);
  size_t limit = is_ud(id) ? kSidrRepPrivateData : kRejPrivateData;
  if (length > limit || (length && private_data == nullptr)) return fail(EINVAL);
  Message message;
  if (is_ud(id)) {
    message.type = MessageType::SidrRep;
    message.sidr_rep.status = mad::sidr_status::kRejected;  // the kernel's, whatever the reason
    (void)reason;
    message.sidr_rep.private_data_length = length;
    if (length) std::memcpy(message.sidr_rep.private_data, private_data, length);
  } else {
    message.type = MessageType::Rej;
    message.rej.reason = reason;
    message.rej.private_data_length = length;
    if (length) std::memcpy(message.rej.private_data, private_data, length);
  }
  send_to_peer(id, message);
  stop_resending(id);
  id->state = IdState::Disconnected;
  return 0;
}

int disconnect(rdma_cm_id* public_id) {
  if (public_id == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  // The QP goes to ERR first, which flushes what is posted on it, as
  // librdmacm does whatever comes next.
  move_qp_to_error(id);
  // As the kernel's rdma_cm: EINVAL only for an id with no connection
  // under way; after the peer disconnected first, 0.
  if (id->state == IdState::Idle || id->state == IdState::Bound || id->state == IdState::AddressResolved ||
      id->state == IdState::RouteResolved || id->state == IdState::Listening)
    return fail(EINVAL);
  if (id->state == IdState::Disconnected) return 0;
  // Not connected yet (a REQ out, a REP in, a request not accepted): the
  // kernel's DREQ cannot be sent and it says 0; the handshake goes on or
  // times out as it would.
  if (id->state != IdState::Connected && id->state != IdState::ReplySent) return 0;
  if (id->agent != nullptr) {
    Message dreq;
    dreq.type = MessageType::Dreq;
    send_to_peer(id, dreq);
  }
  id->state = IdState::Disconnected;
  // Both ends see DISCONNECTED, as with the kernel's rdma_cm.
  if (!id->own_channel) deliver(id, RDMA_CM_EVENT_DISCONNECTED, 0);
  return 0;
}

// ---- events ------------------------------------------------------------------------

int get_cm_event(rdma_event_channel* public_channel, rdma_cm_event** out) {
  if (public_channel == nullptr || out == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  std::unique_lock guard(engine.mutex);
  EventChannel* channel = priv(public_channel);
  while (channel->queue.empty()) {
    if (channel->destroyed) {
      // The thread that destroyed it gets the kernel's answer for a closed
      // descriptor; any other blocks for good (see destroy_event_channel).
      if (channel->destroyed_by == std::this_thread::get_id()) return fail(EBADF);
      channel->ready.wait(guard, [] { return false; });
    }
    // The application's descriptor decides: O_NONBLOCK set, no waiting.
    if (fcntl(channel->channel.fd, F_GETFL) & O_NONBLOCK) return fail(EAGAIN);
    channel->ready.wait(guard);
  }
  std::unique_ptr<QueuedEvent> event = std::move(channel->queue.front());
  channel->queue.pop_front();
  take_signal_byte(*channel);
  CmId* owner = event_owner(engine, event->event);
  if (owner != nullptr) ++owner->events_taken;
  *out = &event.release()->event;
  return 0;
}

int ack_cm_event(rdma_cm_event* event) {
  if (event == nullptr) return fail(EINVAL);
  std::unique_ptr<QueuedEvent> held(priv(event));
  Engine& engine = Engine::instance();
  std::lock_guard guard(engine.mutex);
  if (CmId* owner = event_owner(engine, *event)) {
    ++owner->events_acked;
    engine.events_acked.notify_all();
  }
  return 0;
}

int migrate_id(rdma_cm_id* public_id, rdma_event_channel* channel) {
  if (public_id == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  std::lock_guard guard(engine.mutex);
  CmId* id = priv(public_id);
  // As librdmacm: a NULL channel makes the id synchronous, with a channel
  // of its own; one that is synchronous already cannot be made so again.
  if (channel == nullptr && id->own_channel) return fail(EINVAL);
  std::unique_ptr<EventChannel> own;
  EventChannel* to;
  if (channel == nullptr) {
    own = std::make_unique<EventChannel>();
    if (!open_channel(*own)) return fail(ENOMEM);
    to = own.get();
  } else {
    to = priv(channel);
  }
  // Events not yet read move with the id.
  auto& from = id->channel->queue;
  for (auto it = from.begin(); it != from.end();) {
    if ((*it)->event.id == public_id) {
      to->queue.push_back(std::move(*it));
      take_signal_byte(*id->channel);
      give_signal_byte(*to);
      it = from.erase(it);
    } else {
      ++it;
    }
  }
  if (id->own_channel) {
    // A synchronous id leaves its channel, which goes (with the event it
    // held), as librdmacm destroys it: the id is asynchronous from now on.
    id->held_event.reset();
    id->id.event = nullptr;
    EventChannel& old = *id->own_channel;
    close(old.channel.fd);
    close(old.signal_write);
    old.queue.clear();
    old.destroyed = true;
    old.destroyed_by = std::this_thread::get_id();
    engine.retired_channels.push_back(std::move(id->own_channel));
  }
  id->own_channel = std::move(own);
  id->channel = to;
  id->id.channel = &to->channel;
  to->ready.notify_all();
  // As librdmacm: the events already taken for the id on its old channel
  // are acked before the call returns, so that none is handled there after.
  std::unique_lock wait(engine.mutex, std::adopt_lock);
  engine.events_acked.wait(wait, [&] { return !engine.ids.count(id) || id->events_acked >= id->events_taken; });
  wait.release();
  return 0;
}

int set_option(rdma_cm_id* public_id, int level, int name, const void* value, size_t length) {
  if (public_id == nullptr || value == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (level == RDMA_OPTION_ID) {
    switch (name) {
      case RDMA_OPTION_ID_TOS:
        if (length != sizeof(uint8_t)) return fail(EINVAL);
        id->tos = *static_cast<const uint8_t*>(value);
        return 0;
      case RDMA_OPTION_ID_REUSEADDR:
      case RDMA_OPTION_ID_AFONLY:
        return length == sizeof(int) ? 0 : fail(EINVAL);
      case RDMA_OPTION_ID_ACK_TIMEOUT:
        if (length != sizeof(uint8_t) || *static_cast<const uint8_t*>(value) > 31) return fail(EINVAL);
        id->ack_timeout = *static_cast<const uint8_t*>(value);
        return 0;
      default:
        return fail(ENOSYS);
    }
  }
  if (level == RDMA_OPTION_IB && name == RDMA_OPTION_IB_PATH) return 0;  // RoCE resolves its own path
  return fail(ENOSYS);
}

int init_qp_attr(rdma_cm_id* public_id, ibv_qp_attr* attr, int* mask) {
  if (public_id == nullptr || attr == nullptr || mask == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.verbs == nullptr) return fail(EINVAL);
  if (int error = qp_attributes(id, attr->qp_state, *attr, *mask)) return fail(error);
  return 0;
}

// ---- multicast ------------------------------------------------------------------

int join_multicast(rdma_cm_id* public_id, const sockaddr* address, void* context, bool send_only) {
  if (public_id == nullptr || address == nullptr) return fail(EINVAL);
  if (address->sa_family != AF_INET && address->sa_family != AF_INET6) return fail(EAFNOSUPPORT);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.verbs == nullptr || !is_ud(id)) return fail(EINVAL);
  CmId::Membership membership{};
  copy_address(membership.address, address);
  // RoCE v2's group GID, as the kernel's rdma_cm builds it: the IPv4-mapped
  // address (::ffff:a.b.c.d), or the IPv6 address itself.
  membership.mgid = gid_of(membership.address);
  softverbs::Gid group;
  std::memcpy(group.raw.data(), membership.mgid.raw, 16);
  if (!group.is_multicast()) return fail(EINVAL);
  for (const auto& joined : id->multicast)
    if (std::memcmp(&joined.address, &membership.address, sizeof membership.address) == 0) return fail(EADDRINUSE);
  if (!send_only && id->id.qp != nullptr) {
    if (int error = ibv_attach_mcast(id->id.qp, &membership.mgid, 0)) return fail(error);
    membership.attached = true;
  }
  id->multicast.push_back(membership);
  auto event = std::make_unique<QueuedEvent>();
  rdma_ud_param& ud = event->event.param.ud;
  ud.private_data = context;  // librdmacm hands the join's context back here
  ud.ah_attr = path_to_peer(id);
  ud.ah_attr.grh.dgid = membership.mgid;
  ud.qp_num = kMulticastQpn;
  ud.qkey = RDMA_UDP_QKEY;
  if (id->own_channel) return 0;  // a synchronous join is complete
  deliver(id, RDMA_CM_EVENT_MULTICAST_JOIN, 0, std::move(event));
  return 0;
}

int leave_multicast(rdma_cm_id* public_id, const sockaddr* address) {
  if (public_id == nullptr || address == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  sockaddr_storage wanted;
  copy_address(wanted, address);
  for (auto it = id->multicast.begin(); it != id->multicast.end(); ++it) {
    if (std::memcmp(&it->address, &wanted, sizeof wanted) != 0) continue;
    if (it->attached && id->id.qp) ibv_detach_mcast(id->id.qp, &it->mgid, 0);
    id->multicast.erase(it);
    return 0;
  }
  return fail(EADDRNOTAVAIL);
}

int set_local_ece(rdma_cm_id* public_id, const ibv_ece* ece) {
  if (public_id == nullptr || ece == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  priv(public_id)->local_ece = *ece;
  return 0;
}

int get_remote_ece(rdma_cm_id* public_id, ibv_ece* ece) {
  if (public_id == nullptr || ece == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  *ece = priv(public_id)->remote_ece;
  return 0;
}

ibv_context** get_devices(int* count) {
  std::lock_guard guard(Engine::instance().mutex);
  const auto& contexts = Engine::instance().devices.all();
  auto* list = static_cast<ibv_context**>(std::calloc(contexts.size() + 1, sizeof(ibv_context*)));
  if (list == nullptr) {
    errno = ENOMEM;
    return nullptr;
  }
  std::copy(contexts.begin(), contexts.end(), list);
  if (count) *count = static_cast<int>(contexts.size());
  return list;
}

void free_devices(ibv_context** list) { std::free(list); }

// ---- endpoints and address info ---------------------------------------------

int create_ep(rdma_cm_id** out, rdma_addrinfo* info, ibv_pd* pd, ibv_qp_init_attr* attr) {
  if (out == nullptr || info == nullptr) return fail(EINVAL);
  rdma_cm_id* public_id = nullptr;
  ibv_qp_type type = info->ai_qp_type ? static_cast<ibv_qp_type>(info->ai_qp_type) : IBV_QPT_RC;
  if (create_id(nullptr, &public_id, nullptr, static_cast<rdma_port_space>(info->ai_port_space), type) != 0) return -1;
  CmId* id = priv(public_id);
  int result = 0;
  if (attr) attr->qp_type = type;  // as librdmacm: the address info decides the QP type
  if (info->ai_flags & RAI_PASSIVE) {
    result = bind_addr(public_id, info->ai_src_addr);
    if (result == 0 && attr) {
      // Each id that rdma_get_request hands out gets a QP like this.
      id->endpoint_qp_attr = *attr;
      id->endpoint_pd = pd;
    }
  } else {
    result = resolve_addr(public_id, info->ai_src_addr, info->ai_dst_addr, 2000);
    if (result == 0) result = resolve_route(public_id, 2000);
    if (result == 0 && attr) result = create_qp(public_id, pd, attr);
  }
  if (result != 0) {
    int error = errno;
    destroy_id(public_id);
    return fail(error);
  }
  *out = public_id;
  return 0;
}

void destroy_ep(rdma_cm_id* id) {
  if (id == nullptr) return;
  destroy_qp(id);
  destroy_srq(id);
  destroy_id(id);
}

// With neither node nor service, the answer comes from the hints' addresses
// alone, as librdmacm allows.
int addrinfo_from_hints(const rdma_addrinfo* hints, rdma_addrinfo** result) {
  if (hints->ai_src_addr == nullptr && hints->ai_dst_addr == nullptr) return fail(EINVAL);
  auto* info = static_cast<rdma_addrinfo*>(std::calloc(1, sizeof(rdma_addrinfo)));
  if (info == nullptr) return fail(ENOMEM);
  *info = *hints;
  info->ai_next = nullptr;
  info->ai_src_canonname = info->ai_dst_canonname = nullptr;
  info->ai_route = info->ai_connect = nullptr;
  info->ai_route_len = info->ai_connect_len = 0;
  info->ai_qp_type = hints->ai_qp_type ? hints->ai_qp_type : IBV_QPT_RC;
  info->ai_port_space = hints->ai_port_space ? hints->ai_port_space : RDMA_PS_TCP;
  auto copy = [](const sockaddr* from, socklen_t length) -> sockaddr* {
    if (from == nullptr) return nullptr;
    auto* to = static_cast<sockaddr*>(std::calloc(1, sizeof(sockaddr_storage)));
    if (to) std::memcpy(to, from, std::min<size_t>(length ? length : sockaddr_length(from), sizeof(sockaddr_storage)));
    return to;
  };
  info->ai_src_addr = copy(hints->ai_src_addr, hints->ai_src_len);
  info->ai_dst_addr = copy(hints->ai_dst_addr, hints->ai_dst_len);
  const sockaddr* any = info->ai_src_addr ? info->ai_src_addr : info->ai_dst_addr;
  info->ai_family = any ? any->sa_family : AF_INET;
  *result = info;
  return 0;
}

int getaddrinfo(const char* node, const char* service, const rdma_addrinfo* hints, rdma_addrinfo** result) {
  if (result == nullptr || (node == nullptr && service == nullptr && hints == nullptr)) return fail(EINVAL);
  if (node == nullptr && service == nullptr) return addrinfo_from_hints(hints, result);
  int flags = hints ? hints->ai_flags : 0;
  addrinfo ask{};
  ask.ai_family = hints && hints->ai_family ? hints->ai_family : AF_UNSPEC;
  ask.ai_socktype = SOCK_STREAM;
  if (flags & RAI_PASSIVE) ask.ai_flags |= AI_PASSIVE;
  if (flags & RAI_NUMERICHOST) ask.ai_flags |= AI_NUMERICHOST;
  addrinfo* found = nullptr;
  if (int error = ::getaddrinfo(node, service, &ask, &found); error != 0) {
    errno = error == EAI_SYSTEM ? errno : ENODEV;
    return -1;
  }
  // Prefer IPv4, as the loopback-only examples expect.
  addrinfo* pick = found;
  for (addrinfo* a = found; a; a = a->ai_next)
    if (a->ai_family == AF_INET) {
      pick = a;
      break;
    }
  auto* info = static_cast<rdma_addrinfo*>(std::calloc(1, sizeof(rdma_addrinfo)));
  auto* address = static_cast<sockaddr*>(std::calloc(1, sizeof(sockaddr_storage)));
  if (info == nullptr || address == nullptr) {
    std::free(info);
    std::free(address);
    ::freeaddrinfo(found);
    return fail(ENOMEM);
  }
  std::memcpy(address, pick->ai_addr, pick->ai_addrlen);
  info->ai_flags = flags;
  info->ai_family = pick->ai_family;
  info->ai_qp_type = hints && hints->ai_qp_type ? hints->ai_qp_type : IBV_QPT_RC;
  info->ai_port_space = hints && hints->ai_port_space ? hints->ai_port_space : RDMA_PS_TCP;
  if (flags & RAI_PASSIVE) {
    info->ai_src_addr = address;
    info->ai_src_len = pick->ai_addrlen;
  } else {
    info->ai_dst_addr = address;
    info->ai_dst_len = pick->ai_addrlen;
    if (hints && hints->ai_src_addr) {
      auto* source = static_cast<sockaddr*>(std::calloc(1, sizeof(sockaddr_storage)));
      if (source) {
        std::memcpy(source, hints->ai_src_addr, hints->ai_src_len);
        info->ai_src_addr = source;
        info->ai_src_len = hints->ai_src_len;
      }
    }
  }
  ::freeaddrinfo(found);
  *result = info;
  return 0;
}

void freeaddrinfo(rdma_addrinfo* info) {
  while (info) {
    rdma_addrinfo* next = info->ai_next;
    std::free(info->ai_src_addr);
    std::free(info->ai_dst_addr);
    std::free(info->ai_src_canonname);
    std::free(info->ai_dst_canonname);
    std::free(info->ai_route);
    std::free(info->ai_connect);
    std::free(info);
    info = next;
  }
}

const char* event_str(rdma_cm_event_type event) {
  static const char* const kNames[] = {
      "RDMA_CM_EVENT_ADDR_RESOLVED",  "RDMA_CM_EVENT_ADDR_ERROR",      "RDMA_CM_EVENT_ROUTE_RESOLVED",
      "RDMA_CM_EVENT_ROUTE_ERROR",    "RDMA_CM_EVENT_CONNECT_REQUEST", "RDMA_CM_EVENT_CONNECT_RESPONSE",
      "RDMA_CM_EVENT_CONNECT_ERROR",  "RDMA_CM_EVENT_UNREACHABLE",     "RDMA_CM_EVENT_REJECTED",
      "RDMA_CM_EVENT_ESTABLISHED",    "RDMA_CM_EVENT_DISCONNECTED",    "RDMA_CM_EVENT_DEVICE_REMOVAL",
      "RDMA_CM_EVENT_MULTICAST_JOIN", "RDMA_CM_EVENT_MULTICAST_ERROR", "RDMA_CM_EVENT_ADDR_CHANGE",
      "RDMA_CM_EVENT_TIMEWAIT_EXIT"};
  auto index = static_cast<size_t>(event);
  return index < std::size(kNames) ? kNames[index] : "UNKNOWN EVENT";
}

}  // namespace softverbs::cm
