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

#include "debug_log.h"
#include "device_registry.h"
#include "listener_directory.h"
#include "multicast_table.h"
#include "random_bits.h"

namespace softverbs::cm {

namespace {

constexpr int kConnectTimeoutMs = 5000;
// What the kernel's IB CM gives an RC QP at RTR, and so what rdma_cm
// applications get on hardware: 0, the longest RNR NAK delay (655.36 ms).
// A receive posted a little late then costs one long wait, not an
// IBV_WC_RNR_RETRY_EXC_ERR after a few short ones.
constexpr uint8_t kMinRnrTimer = 0;
constexpr uint8_t kHopLimit = 64;

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

// One context and one PD per device, shared by all ids, as librdmacm keeps.
class Devices {
 public:
  // The device whose GID table holds `local` (as RoCE resolves an address
  // to the netdev that has it), else the first softverbs device.
  ibv_context* context_for(const sockaddr_storage& local) {
    open_all();
    const ibv_gid wanted = gid_of(local);
    for (ibv_context* context : contexts_) {
      ibv_port_attr port{};
      if (ibv_query_port(context, 1, &port) != 0) continue;
      for (int index = 0; index < port.gid_tbl_len; ++index) {
        ibv_gid gid;
        if (ibv_query_gid(context, 1, index, &gid) == 0 && std::memcmp(gid.raw, wanted.raw, 16) == 0) return context;
      }
    }
    for (ibv_context* context : contexts_)
      if (std::strncmp(context->device->name, "softverbs", 9) == 0) return context;
    return contexts_.empty() ? nullptr : contexts_.front();
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
  std::condition_variable_any events_acked;  // with `mutex`
  Devices devices;
  std::set<CmId*> ids;
  std::unique_ptr<ListenerDirectory> directory = std::make_unique<ListenerDirectory>(default_runtime_dir());

  // Passive connections accepted but not yet carrying a REQ.
  struct Incoming {
    int fd;
    CmId* listener;
    std::vector<uint8_t> inbox;
  };
  std::vector<Incoming> incoming;
  // Event channels the application destroyed, kept: see destroy_event_channel.
  std::vector<std::unique_ptr<EventChannel>> retired_channels;

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

bool send_message(int fd, const Message& message) {
  std::vector<uint8_t> bytes = encode(message);
  size_t sent = 0;
  while (sent < bytes.size()) {
    ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

void close_connection(CmId* id) {
  if (id->connection_fd >= 0) close(id->connection_fd);
  id->connection_fd = -1;
  id->inbox.clear();
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
  ah.grh.dgid = gid_of(id->id.route.addr.dst_storage);
  // The source GID's index: the RoCE v2 entry of our address.
  ibv_gid wanted = gid_of(id->id.route.addr.src_storage);
  ibv_port_attr port{};
  if (id->id.verbs && ibv_query_port(id->id.verbs, 1, &port) == 0) {
    for (int index = 0; index < port.gid_tbl_len; ++index) {
      ibv_gid_entry entry;
      if (ibv_query_gid_ex(id->id.verbs, 1, index, &entry, 0) == 0 && entry.gid_type == IBV_GID_TYPE_ROCE_V2 &&
          std::memcmp(entry.gid.raw, wanted.raw, 16) == 0) {
        ah.grh.sgid_index = static_cast<uint8_t>(index);
        break;
      }
    }
  }
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

void on_request(Engine& engine, Engine::Incoming& in, const Message& message) {
  CmId* listener = in.listener;
  bool ud = message.type == MessageType::SidrReq;
  CmId* id = new_id(listener->own_channel ? nullptr : listener->channel, listener->id.context, listener->id.ps,
                    listener->id.qp_type);
  if (id == nullptr) return;
  id->listener = listener;
  id->connection_fd = in.fd;
  in.fd = -1;
  id->state = IdState::RequestReceived;
  id->local_psn = engine.random_psn();
  const WireAddress& source = ud ? message.sidr_req.source : message.req.source;
  const WireAddress& destination = ud ? message.sidr_req.destination : message.req.destination;
  id->id.route.addr.src_storage = from_wire(destination);
  id->id.route.addr.dst_storage = from_wire(source);
  id->id.route.addr.addr.ibaddr.sgid = gid_of(id->id.route.addr.src_storage);
  id->id.route.addr.addr.ibaddr.dgid = gid_of(id->id.route.addr.dst_storage);
  attach_device(id, engine.devices, id->id.route.addr.src_storage);
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
        send_message(id->connection_fd, rej);
        close_connection(id);
        move_qp_to_error(id);
        id->state = IdState::Disconnected;
        deliver(id, RDMA_CM_EVENT_CONNECT_ERROR, -EINVAL);
        return;
      }
      Message rtu;
      rtu.type = MessageType::Rtu;
      send_message(id->connection_fd, rtu);
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
      close_connection(id);
      move_qp_to_error(id);
      id->state = IdState::Disconnected;
      deliver(id, RDMA_CM_EVENT_REJECTED, message.rej.reason, std::move(event));
      return;
    }
    case MessageType::SidrRep: {
      if (id->state != IdState::RequestSent) return;
      const SidrReply& rep = message.sidr_rep;
      close_connection(id);
      if (rep.status != 0) {
        id->state = IdState::Disconnected;
        deliver(id, RDMA_CM_EVENT_REJECTED, static_cast<int>(rep.status),
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
      send_message(id->connection_fd, drep);
      close_connection(id);
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
      close_connection(id);
      return;
    case MessageType::Req:
    case MessageType::SidrReq:
      return;  // only on a listener's fresh connection
  }
  (void)engine;
}

// The peer's shim went away (closed the connection, or sent garbage).
void on_connection_lost(CmId* id) {
  close_connection(id);
  switch (id->state) {
    case IdState::Connected:
    case IdState::ReplySent:
      // (The QP stays as it is: see MessageType::Dreq.)
      id->state = IdState::Disconnected;
      deliver(id, RDMA_CM_EVENT_DISCONNECTED, 0);
      break;
    case IdState::RequestSent:
      id->state = IdState::Disconnected;
      deliver(id, RDMA_CM_EVENT_UNREACHABLE, -ETIMEDOUT);
      break;
    default:
      break;
  }
}

// Reads what is there; returns false when the connection is finished.
bool pump(int fd, std::vector<uint8_t>& inbox, std::vector<Message>& messages) {
  uint8_t buffer[1024];
  ssize_t n = recv(fd, buffer, sizeof buffer, MSG_DONTWAIT);
  if (n == 0) return false;
  if (n < 0) return errno == EAGAIN || errno == EINTR;
  inbox.insert(inbox.end(), buffer, buffer + n);
  for (;;) {
    auto needed = framed_length(inbox);
    if (!needed) return false;  // not ours: drop the connection
    if (inbox.size() < *needed) return true;
    auto message = decode(std::span(inbox.data(), *needed));
    if (!message) return false;
    messages.push_back(*message);
    inbox.erase(inbox.begin(), inbox.begin() + static_cast<std::ptrdiff_t>(*needed));
  }
}

void Engine::run() {
  for (;;) {
    std::vector<pollfd> fds;
    fds.push_back({wake_read_, POLLIN, 0});
    {
      std::lock_guard guard(mutex);
      for (CmId* id : ids) {
        if (id->listen_fd >= 0) fds.push_back({id->listen_fd, POLLIN, 0});
        if (id->connection_fd >= 0) fds.push_back({id->connection_fd, POLLIN, 0});
      }
      for (const Incoming& in : incoming) fds.push_back({in.fd, POLLIN, 0});
    }
    if (poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) continue;
    if (fds[0].revents) {
      char drain[64];
      while (read(wake_read_, drain, sizeof drain) > 0) {
      }
    }
    std::lock_guard guard(mutex);
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      int fd = fds[i].fd;
      // Listeners: a new connection, to read its REQ from.
      for (CmId* id : ids) {
        if (id->listen_fd != fd) continue;
        int accepted = ::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (accepted >= 0) incoming.push_back({accepted, id, {}});
      }
      for (auto it = incoming.begin(); it != incoming.end();) {
        if (it->fd != fd) {
          ++it;
          continue;
        }
        std::vector<Message> messages;
        bool open = pump(it->fd, it->inbox, messages);
        for (const Message& message : messages) {
          if ((message.type == MessageType::Req || message.type == MessageType::SidrReq) && ids.count(it->listener) &&
              it->listener->state == IdState::Listening) {
            on_request(*this, *it, message);
            break;
          }
        }
        if (it->fd < 0) {
          it = incoming.erase(it);  // handed to a new id
        } else if (!open || !messages.empty()) {
          close(it->fd);  // malformed, or not a request: dropped without harm
          it = incoming.erase(it);
        } else {
          ++it;
        }
      }
      for (CmId* id : std::vector<CmId*>(ids.begin(), ids.end())) {
        if (!ids.count(id) || id->connection_fd != fd) continue;
        std::vector<Message> messages;
        bool open = pump(fd, id->inbox, messages);
        for (const Message& message : messages) {
          if (id->connection_fd < 0) break;
          on_message(*this, id, message);
        }
        if (!open && id->connection_fd == fd) on_connection_lost(id);
      }
    }
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

int connect_to_listener(const sockaddr_storage& destination, uint16_t tcp_port, int& fd_out) {
  sockaddr_storage target = destination;
  if (target.ss_family == AF_INET)
    reinterpret_cast<sockaddr_in&>(target).sin_port = htons(tcp_port);
  else
    reinterpret_cast<sockaddr_in6&>(target).sin6_port = htons(tcp_port);
  int fd = socket(target.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return errno;
  int result =
      ::connect(fd, reinterpret_cast<sockaddr*>(&target), sockaddr_length(reinterpret_cast<sockaddr*>(&target)));
  if (result != 0 && errno == EINPROGRESS) {
    pollfd waiting{fd, POLLOUT, 0};
    if (poll(&waiting, 1, kConnectTimeoutMs) != 1) {
      close(fd);
      return ETIMEDOUT;
    }
    int error = 0;
    socklen_t length = sizeof error;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) {
      close(fd);
      return error;
    }
  } else if (result != 0) {
    int error = errno;
    close(fd);
    return error;
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, 1 /* TCP_NODELAY */, &one, sizeof one);
  fd_out = fd;
  return 0;
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
    if (id->connection_fd >= 0 && (id->state == IdState::Connected || id->state == IdState::ReplySent)) {
      Message dreq;
      dreq.type = MessageType::Dreq;
      send_message(id->connection_fd, dreq);
    }
    close_connection(id.get());
    if (id->listen_fd >= 0) close(id->listen_fd);
    if (id->listed) engine.directory->release(id->id.route.addr.src_storage);
    for (CmId* other : engine.ids)
      if (other->listener == id.get()) other->listener = nullptr;
    for (auto it = engine.incoming.begin(); it != engine.incoming.end();) {
      if (it->listener == id.get()) {
        close(it->fd);
        it = engine.incoming.erase(it);
      } else {
        ++it;
      }
    }
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

// The TCP port of the listener for `destination`. A listener may be a moment
// away (a server re-listening between two connections, as perftest does):
// look for up to 50 ms, about what a REQ would spend on a wire, before the
// caller rejects. Called without the engine's lock.
static std::optional<uint16_t> find_listener(Engine& engine, const sockaddr_storage& destination) {
  std::optional<uint16_t> tcp_port = engine.directory->find(destination);
  for (int attempt = 0; !tcp_port && attempt < 10; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    tcp_port = engine.directory->find(destination);
  }
  return tcp_port;
}

int connect(rdma_cm_id* public_id, const rdma_conn_param* param) {
  if (public_id == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  CmId* id = priv(public_id);
  sockaddr_storage peer;
  {
    std::lock_guard guard(engine.mutex);
    if (id->state != IdState::RouteResolved) return fail(EINVAL);
    peer = id->id.route.addr.dst_storage;
  }
  std::optional<uint16_t> tcp_port = find_listener(engine, peer);
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
    int fd = -1;
    int error = tcp_port ? connect_to_listener(destination, *tcp_port, fd) : ECONNREFUSED;
    if (error != 0)
      debug_log("rdma_connect to %s: %s", address_key(destination).c_str(),
                tcp_port ? strerror(error) : "no listener there");
    if (error != 0) {
      // No listener answers: the IB CM rejects with "invalid service ID";
      // no shim at all behind the address: unreachable.
      id->state = IdState::Disconnected;
      if (error == ECONNREFUSED)
        deliver(id, RDMA_CM_EVENT_REJECTED, kRejectInvalidServiceId);
      else
        deliver(id, RDMA_CM_EVENT_UNREACHABLE, -error);
    } else {
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
        if (param && param->private_data_len) {
          req.private_data_length = param->private_data_len;
          std::memcpy(req.private_data, param->private_data, param->private_data_len);
        }
      }
      id->connection_fd = fd;
      id->state = IdState::RequestSent;
      engine.start_thread();
      if (!send_message(fd, message)) {
        close_connection(id);
        id->state = IdState::Disconnected;
        deliver(id, RDMA_CM_EVENT_UNREACHABLE, -ECONNRESET);
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
  if (!send_message(id->connection_fd, rtu)) return fail(ECONNRESET);
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
    sockaddr_storage tcp = local;
    if (tcp.ss_family == AF_INET)
      reinterpret_cast<sockaddr_in&>(tcp).sin_port = 0;
    else
      reinterpret_cast<sockaddr_in6&>(tcp).sin6_port = 0;
    int fd = socket(tcp.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    socklen_t length = sizeof tcp;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&tcp), sockaddr_length(reinterpret_cast<sockaddr*>(&tcp))) != 0 ||
        ::listen(fd, 128) != 0 || getsockname(fd, reinterpret_cast<sockaddr*>(&tcp), &length) != 0) {
      int error = errno;
      close(fd);
      return fail(error);
    }
    if (int error = engine.directory->claim(local, port_of(tcp))) {
      close(fd);
      return fail(error);
    }
    id->listen_fd = fd;
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
    if (id->state != IdState::RequestReceived || id->connection_fd < 0) return fail(EINVAL);
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
      bool sent = send_message(id->connection_fd, message);
      close_connection(id);
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
    if (!send_message(id->connection_fd, message)) return fail(ECONNRESET);
    id->state = IdState::ReplySent;
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
  if (id->state != IdState::RequestReceived || id->connection_fd < 0) return fail(EINVAL);
  size_t limit = is_ud(id) ? kSidrRepPrivateData : kRejPrivateData;
  if (length > limit || (length && private_data == nullptr)) return fail(EINVAL);
  Message message;
  if (is_ud(id)) {
    message.type = MessageType::SidrRep;
    message.sidr_rep.status = reason;
    message.sidr_rep.private_data_length = length;
    if (length) std::memcpy(message.sidr_rep.private_data, private_data, length);
  } else {
    message.type = MessageType::Rej;
    message.rej.reason = reason;
    message.rej.private_data_length = length;
    if (length) std::memcpy(message.rej.private_data, private_data, length);
  }
  send_message(id->connection_fd, message);
  close_connection(id);
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
  if (id->connection_fd >= 0) {
    Message dreq;
    dreq.type = MessageType::Dreq;
    send_message(id->connection_fd, dreq);
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
  // RoCE's group GID: the IPv4-mapped address, or the IPv6 address itself.
  membership.mgid = gid_of(membership.address);
  if (membership.mgid.raw[0] != 0xff &&
      !(address->sa_family == AF_INET && membership.mgid.raw[12] >= 224 && membership.mgid.raw[12] <= 239))
    return fail(EINVAL);  // not a multicast address
  if (address->sa_family == AF_INET) {
    // IPv4 multicast becomes an IB multicast GID as the kernel's RoCE code
    // builds it: ff0e::ffff:a.b.c.d.
    membership.mgid.raw[0] = 0xff;
    membership.mgid.raw[1] = 0x0e;
  }
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
