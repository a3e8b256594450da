#include "udp/transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <pthread.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "device/multicast_table.h"
#include "host/netdev.h"
#include "support/debug_log.h"
#include "support/process_id.h"
#include "udp/coalesced_read.h"
#include "udp/gso.h"
#include "udp/internal.h"
#include "udp/parameters.h"
#include "wire/icrc.h"
#include "wire/pcap_file.h"

namespace softverbs {

namespace {

using namespace wire;
using udp::Clock;

using namespace udp::parameters;

// A file descriptor that closes itself.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = other.release();
    }
    return *this;
  }
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

struct SocketAddressStorage {
  sockaddr_storage storage{};
  socklen_t length = 0;
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};

SocketAddressStorage to_sockaddr(const IpAddress& address, uint16_t port, uint32_t scope_id) {
  SocketAddressStorage out;
  if (is_ipv4_mapped(address)) {
    auto* in = reinterpret_cast<sockaddr_in*>(&out.storage);
    in->sin_family = AF_INET;
    in->sin_port = htons(port);
    std::memcpy(&in->sin_addr, address.data() + 12, 4);
    out.length = sizeof(sockaddr_in);
  } else {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&out.storage);
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(port);
    std::memcpy(&in6->sin6_addr, address.data(), 16);
    in6->sin6_scope_id = scope_id;
    out.length = sizeof(sockaddr_in6);
  }
  return out;
}

bool from_sockaddr(const sockaddr_storage& storage, IpAddress& address, uint16_t& port) {
  if (storage.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&storage);
    address = {};
    address[10] = address[11] = 0xff;
    std::memcpy(address.data() + 12, &in->sin_addr, 4);
    port = ntohs(in->sin_port);
    return true;
  }
  if (storage.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&storage);
    std::memcpy(address.data(), &in6->sin6_addr, 16);
    port = ntohs(in6->sin6_port);
    return true;
  }
  return false;
}

bool is_link_local(const IpAddress& address) { return address[0] == 0xfe && (address[1] & 0xc0) == 0x80; }

void set_buffer(int fd, int option, int force_option, int bytes) {
  // Root may exceed net.core.[rw]mem_max; others get what the limit allows.
  if (setsockopt(fd, SOL_SOCKET, force_option, &bytes, sizeof bytes) != 0)
    setsockopt(fd, SOL_SOCKET, option, &bytes, sizeof bytes);
}

// A UDP socket bound to (address, port) with SO_REUSEPORT; -1 and errno set
// on failure.
int bind_udp(const IpAddress& address, uint16_t port, uint32_t scope_id) {
  const bool v4 = is_ipv4_mapped(address);
  int fd = ::socket(v4 ? AF_INET : AF_INET6, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
  // An IPv6 address still in duplicate address detection cannot be bound
  // otherwise; the device's addresses are ours to use.
  setsockopt(fd, SOL_IP, IP_FREEBIND, &one, sizeof one);
  if (v4) {
    int pmtu = IP_PMTUDISC_DO;  // DF set, identification 0 (see roce_packet.h)
    setsockopt(fd, IPPROTO_IP, IP_MTU_DISCOVER, &pmtu, sizeof pmtu);
  } else {
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    int pmtu = IPV6_PMTUDISC_DO;
    setsockopt(fd, IPPROTO_IPV6, IPV6_MTU_DISCOVER, &pmtu, sizeof pmtu);
  }
  // Multicast leaves with the hop limit unicast has (64, the kernel's
  // default and what rdma_cm puts in a RoCE v2 group's address handle),
  // not the socket default of 1.
  int hops = 64;
  if (v4)
    setsockopt(fd, IPPROTO_IP, IP_MULTICAST_TTL, &hops, sizeof hops);
  else
    setsockopt(fd, IPPROTO_IPV6, IPV6_MULTICAST_HOPS, &hops, sizeof hops);
  set_buffer(fd, SO_RCVBUF, SO_RCVBUFFORCE, kSocketBuffer);
  set_buffer(fd, SO_SNDBUF, SO_SNDBUFFORCE, kSocketBuffer);
  // Datagrams of one flow may arrive together (see drain()).
  setsockopt(fd, SOL_UDP, UDP_GRO, &one, sizeof one);
  SocketAddressStorage where = to_sockaddr(address, port, is_link_local(address) ? scope_id : 0);
  if (::bind(fd, where.get(), where.length) != 0) {
    int saved = errno;
    ::close(fd);
    errno = saved;
    return -1;
  }
  return fd;
}

sockaddr_un abstract_address(const std::string& name, socklen_t& length) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  size_t size = std::min(name.size(), sizeof address.sun_path - 1);
  std::memcpy(address.sun_path + 1, name.data(), size);  // sun_path[0] = 0: abstract
  length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + size);
  return address;
}

std::string hex(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}

std::string address_claim_prefix(const IpAddress& address) {
  return "softverbs-roce-addr/" + format_address(address) + "/";
}

// Abstract socket names in this network namespace that start with `prefix`.
std::vector<std::string> abstract_names_with_prefix(const std::string& prefix) {
  std::vector<std::string> names;
  std::ifstream table("/proc/net/unix");
  std::string line;
  std::getline(table, line);  // header
  while (std::getline(table, line)) {
    size_t at = line.find(" @");
    if (at == std::string::npos) continue;
    std::string name = line.substr(at + 2);
    if (name.compare(0, prefix.size(), prefix) == 0) names.push_back(name);
  }
  return names;
}

}  // namespace

// ---- the engine ------------------------------------------------------------------

class UdpTransport::Engine : public udp::TransportPort {
 public:
  Engine(std::shared_ptr<DeviceMemory> memory, DeviceConfig config, std::vector<GidEntry> gids)
      : memory_(std::move(memory)),
        config_(std::move(config)),
        gids_(std::move(gids)),
        work_(boost::asio::make_work_guard(io_)) {
    if (const char* text = std::getenv("SOFTVERBS_FAULTS")) {
      std::string error;
      fault_override_ = FaultSettings::parse(text, &error);
      if (!fault_override_) std::fprintf(stderr, "softverbs: SOFTVERBS_FAULTS ignored: %s\n", error.c_str());
    }
  }

  ~Engine() override {
    work_.reset();
    io_.stop();
    if (thread_.joinable()) thread_.join();
    {
      // ACKs still held go out: the peers' requests completed here.
      std::lock_guard guard(mutex_);
      flush_sends();
      while (!acks_held_.empty()) send_held_ack_locked(acks_held_.front().qpn);
    }
    ready_waiter_.reset();
    timer_waiter_.reset();
    busy_watcher_ = nullptr;
    watchers_.clear();
    if (capture_fd_ >= 0) ::close(capture_fd_);
  }

  bool start(std::string* error);

  // TransportPort
  DeviceMemory& memory() override { return *memory_; }
  // The time of the application's pass (a post or a poll) once it holds
  // mutex_: reading the clock costs ~60 TSC cycles on the CI VM, and a post
  // read it five times. Deadlines set or checked against it are at most one
  // pass (a few microseconds) off, against timers of 10 us and more.
  Clock::time_point now() const override { return pass_clock_set_ ? pass_now_ : Clock::now(); }
  uint64_t application_calls() const override { return drive_count_.load(std::memory_order_relaxed); }
  void transmit(udp::UdpQp& qp, const udp::Path& path, uint32_t destination_qpn, const TransportPacket& packet,
                std::span<const iovec> payload) override;

  bool is_local_address(const IpAddress& address) const {
    return std::find(local_addresses_.begin(), local_addresses_.end(), address) != local_addresses_.end();
  }
  bool is_local_gid(const Gid& gid) const {
    for (const GidEntry& entry : gids_)
      if (!entry.gid.is_zero() && entry.gid == gid) return true;
    return false;
  }
  bool source_gid_set(int sgid_index, std::string* error) const;
  bool usable_source_gid(int sgid_index, std::string* error) const;
  std::optional<udp::Path> resolve_path(int sgid_index, const Gid& dgid, uint8_t traffic_class, uint8_t hop_limit,
                                        uint32_t flow_label, std::string* error) const;
  int sync_qp(int qp_index);
  void forget_qp(uint32_t qpn);
  int join_group(const Gid& group, uint32_t qpn);
  void leave_group(const Gid& group, uint32_t qpn);
  void leave_groups(uint32_t qpn);
  bool carries(uint32_t qpn) {
    std::lock_guard guard(mutex_);
    return qps_.count(qpn) != 0;
  }
  int post_send(uint32_t qpn, const udp::SendWqe& wqe);
  void drive();
  void receive_posted() {
    if (awaiting_receive_count_.load(std::memory_order_relaxed) == 0) return;
    DeferredChannelWakeups wakeups;  // sent once the lock is free
    std::lock_guard guard(mutex_);
    PassClock clock(*this, Clock::now());
    after_work(app_waits_for_events() ? Acks::Send : Acks::Hold);
  }
  void application_waits() {
    app_uses_events_.store(true, std::memory_order_relaxed);
    last_drive_.store(0, std::memory_order_relaxed);
    wake_io_thread();
  }
  void hold_data_paths(const std::function<void()>& change) {
    std::lock_guard guard(mutex_);
    change();
  }
  // (drive() after application_waits() counts one call: still idle.)

 private:
  // A socket the engine reads (a member of ready_set_ but while a polling
  // application reads it on every pass: see leave_ready_set_locked).
  struct Watcher {
    Fd fd;
    uint64_t id = 0;
    IpAddress local{};
    bool forward = false;
    bool in_ready_set = false;
    uint32_t busy_reads = 0;  // reads that found something since it last joined the set
    // A socket connected to one flow receives only from its peer: reads
    // need not ask the kernel for the source address.
    bool connected = false;
    IpAddress peer{};
    uint16_t peer_port = 0;
    // A connected socket's packets are all for one QP; the polling path
    // tells them apart without the kernel's help (read_connected), unless
    // that took a search lately: then its reads ask for the GRO size.
    wire::FlowReceiver receiver;
    uint32_t reads_with_gro_size = 0;
  };
  uint64_t add_watcher_locked(Fd fd, const IpAddress& local, bool forward);
  void connect_flow_locked(const udp::UdpQp& qp);
  void forget_locked(uint32_t qpn);
  void retire_watcher_locked(uint64_t id);
  // How much one pass reads from each socket with something to read.
  enum class Reads : uint8_t {
    // One datagram (or one UDP GRO batch): a polling application comes back
    // for the rest, and one read is ~0.3 us cheaper than a batched one that
    // finds nothing more (recvmmsg's last try).
    One,
    // Until the socket is empty: the io thread is woken only by new packets.
    All,
  };
  void drain_all_locked(Reads reads);
  // A polling application's pass: reads the socket that last had something,
  // and asks the epoll set which sockets to read only every
  // kLookAroundEvery passes (so that the others are not starved by a busy
  // one, and a new flow is found within a few passes), or on every pass
  // where several sockets have been busy (kSeveralFlowsPasses). An epoll_wait that
  // finds a socket ready costs about 0.4 us more than one that finds
  // nothing, and one after every empty read doubled the time of a pass
  // (each ~0.3 us), which a packet that arrives waits half of on average.
  void drain_polling_locked();
  // The socket a polling application reads on every pass leaves the epoll
  // set, and is in it again before the io thread watches or another socket
  // becomes the busy one (only the busy one is read without asking the set).
  void make_busy_locked(Watcher* watcher);
  void leave_ready_set_locked(Watcher& watcher);
  void join_ready_set_locked(Watcher& watcher);
  struct Delayed {
    Clock::time_point due;
    int fd;
    SocketAddressStorage to;
    std::vector<uint8_t> bytes;
    FlowAddress flow;
  };

  void run_thread();
  // The background thread's side (run on the io thread only).
  void io_check();
  void start_watching();
  void stop_watching();
  void watch();
  // Makes sure the io thread looks again by `when` (from any thread; other
  // threads only for deadlines kArmedFromAnyThread off). A timer already
  // due earlier is left as it is: that look re-arms it.
  void arm_timer(Clock::time_point when);
  void wait_for_timer();
  // Asks the io thread for an io_check() (from any thread).
  void wake_io_thread();
  // Did the io thread leave reading every socket to this verbs call (see
  // reads_left_to_call_)? Then the call reads them all before its answers.
  bool reads_left_to_this_call() {
    return reads_left_to_call_.load(std::memory_order_relaxed) && reads_left_to_call_.exchange(false);
  }
  // Is the application polling (many verbs calls since the last look, the
  // latest just now)? An application that waits for events makes a call
  // or two per event and counts as idle. io thread only.
  bool app_active(Clock::time_point now) {
    uint64_t count = drive_count_.load(std::memory_order_relaxed);
    uint64_t calls = count - seen_drives_;
    seen_drives_ = count;
    return calls >= kBusyPollCalls &&
           now.time_since_epoch().count() - last_drive_.load(std::memory_order_relaxed) < app_idle_after_.count();
  }
  // Does the application sleep until CQ events (it arms CQs and has not
  // polled busily since)? Then it posts nothing soon after a packet
  // arrives, and an ACK held for its next request only waits.
  bool app_waits_for_events() const { return app_uses_events_.load(std::memory_order_relaxed); }
  Clock::time_point note_app_active() {
    const Clock::time_point now = Clock::now();
    last_drive_.store(now.time_since_epoch().count(), std::memory_order_relaxed);
    drive_count_.fetch_add(1, std::memory_order_relaxed);
    return now;
  }
  // now()'s time for one pass, set and cleared under mutex_.
  class PassClock {
   public:
    PassClock(Engine& engine, Clock::time_point now) : engine_(engine) {
      engine_.pass_now_ = now;
      engine_.pass_clock_set_ = true;
    }
    ~PassClock() { engine_.pass_clock_set_ = false; }
    PassClock(const PassClock&) = delete;
    PassClock& operator=(const PassClock&) = delete;

   private:
    Engine& engine_;
  };
  Clock::time_point earliest_deadline_locked() const;
  // Reads what waits on `watcher` (one datagram or all, as `reads` says) and
  // handles it; mutex_ held. Returns whether anything was read.
  bool drain(Watcher& watcher, Reads reads);
  // One read of a connected socket with recv (see coalesced_read.h).
  bool read_connected(Watcher& watcher);
  // The addresses of what arrives on `watcher`: its connected peer's as the
  // source, if it has one, and its own local address on port 4791.
  static FlowAddress arriving_flow(const Watcher& watcher);
  // Handles the packets of one read, `packet_bytes` each but the last (the
  // first's ICRC already found good if `first_checked`); returns how many.
  uint64_t handle_read(const FlowAddress& flow, std::span<const uint8_t> read, size_t packet_bytes, bool first_checked);
  // `icrc_checked`: the datagram's ICRC was already found good.
  void handle_datagram(const FlowAddress& flow, std::span<const uint8_t> datagram, bool forwarded,
                       bool icrc_checked = false);
  // A packet for QP1: the QPN of the CM agent it belongs to, or 0 where the
  // device answered it (from QP1, back to the sender) or dropped it.
  uint32_t route_to_cm_agent(const FlowAddress& flow, const TransportPacket& packet, bool forwarded);
  void send_cm_answer(const FlowAddress& arrived, std::span<const uint8_t> mad);
  // A request packet for an RC or UC QP (`bytes`: the packet without its
  // ICRC), which may wait for a receive (see kReceiveGrace).
  void take_request_locked(udp::UdpQp& qp, const TransportPacket& packet, std::span<const uint8_t> bytes);
  // Hands the QP's waiting request packets in again, in order; they go on
  // waiting only if `may_wait`.
  void retry_awaiting_locked(udp::UdpQp& qp, bool may_wait);
  void note_awaiting_count_locked() {
    awaiting_receive_count_.store(awaiting_receive_qps_.size(), std::memory_order_relaxed);
  }
  void forward(uint16_t port, const FlowAddress& flow, std::span<const uint8_t> datagram);
  // mutex_ held: answers, due timers. A pass that may hold ACKs back is one
  // that did not post a request (see kAckHold).
  enum class Acks : uint8_t { Hold, Send };
  // Whether the pass's packets leave now or may wait in the send batch for
  // the next post to join them (a post in a burst: see kBurstGap).
  enum class Sends : uint8_t { Now, MayWait };
  // Returns whether the pass answered a short READ or an atomic (see
  // kAnswerSpin).
  bool after_work(Acks acks = Acks::Send, Sends sends = Sends::Now);
  Clock::time_point earliest_held_ack_locked() const;
  Clock::time_point earliest_receive_wait_locked() const;
  // Sends the ACK held for `qpn` now, if any (the QP going away or to ERR,
  // the engine stopping).
  void send_held_ack_locked(uint32_t qpn);
  // Retransmission, RNR and fault-injection timers: all but held ACKs.
  Clock::time_point earliest_protocol_deadline_locked() const;
  int send_socket(const IpAddress& local, uint16_t port);
  // Where a packet of `path` from `source_port` leaves from and goes to.
  struct SendTarget {
    IpAddress local{};
    IpAddress remote{};
    uint16_t source_port = 0;
    uint32_t scope_id = 0;
    int fd = -1;
    SocketAddressStorage to;
    bool same_flow(const udp::Path& path, uint16_t port) const {
      return fd >= 0 && source_port == port && scope_id == path.scope_id && local == path.local &&
             remote == path.remote;
    }
  };
  const SendTarget& send_target(const udp::Path& path, uint16_t source_port);
  // Queues a datagram for sending (a copy of its bytes); consecutive
  // datagrams of one flow and one size leave together in one UDP GSO send
  // (flush_sends(), at the end of every engine pass).
  void send_bytes(int fd, const SocketAddressStorage& to, std::span<const uint8_t> datagram);
  // The room for a datagram of `total` bytes at the end of the send batch,
  // which the caller fills (send_bytes copies into it; transmit writes a
  // long packet there itself, copying its payload as it computes the ICRC).
  uint8_t* batch_room(int fd, const SocketAddressStorage& to, size_t total);
  void flush_sends();
  void send_now(int fd, const SocketAddressStorage& to, std::span<const iovec> parts, size_t total, size_t segment);
  void capture(const FlowAddress& flow, std::span<const uint8_t> datagram);
  FaultSettings fault_settings() const { return fault_override_ ? *fault_override_ : memory_->shared().faults.load(); }
  udp::UdpQp* find(uint32_t qpn) {
    auto it = qps_.find(qpn);
    return it == qps_.end() ? nullptr : &it->second;
  }

  std::shared_ptr<DeviceMemory> memory_;
  DeviceConfig config_;
  std::vector<GidEntry> gids_;
  std::vector<IpAddress> local_addresses_;
  unsigned ifindex_ = 0;
  // The netdev's addresses, read again when a GID is not among them. The
  // table starts with the link-local GID of the MAC, as rxe's does, which a
  // netdev may lack as an address (lo has no link-local address): packets
  // from or to it go nowhere, and a QP on it saw only IBV_WC_RETRY_EXC_ERR.
  mutable std::mutex netdev_addresses_mutex_;
  mutable std::vector<IpAddress> netdev_addresses_;
  bool netdev_has_address(const IpAddress& address) const;
  std::optional<FaultSettings> fault_override_;
  uint64_t instance_ = 0;

  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
  // The io thread's timer: a timerfd of our own, which Asio watches like a
  // socket. (An Asio timer re-arms its timerfd at every expires_at() and
  // again after every expiry. Re-arming a CPU's earliest timer reprograms
  // the timer hardware, which on a virtual machine traps to the hypervisor:
  // 15-20 us per call on the 2-core CI VM, more than a third of the time of
  // a receiving io thread that holds an ACK every few packets.)
  std::optional<boost::asio::posix::stream_descriptor> timer_waiter_;
  std::thread thread_;
  // Receive sockets: one per device address (the SO_REUSEPORT group), the
  // forward socket, and one per connected RC/UC QP (bound to the same
  // address and port 4791 but connected to the peer's flow, so that the
  // kernel hands that flow to this process directly). The map changes under
  // mutex_.
  std::map<uint64_t, std::unique_ptr<Watcher>> watchers_;
  Watcher* busy_watcher_ = nullptr;  // the last one read from (see drain_polling_locked)
  uint32_t passes_on_busy_watcher_ = 0;
  uint64_t polling_passes_ = 0;
  uint64_t several_flows_until_pass_ = 0;               // see kSeveralFlowsPasses
  std::unordered_map<uint32_t, uint64_t> qp_watchers_;  // QPN -> its connected socket
  uint64_t next_watcher_ = 0;
  std::vector<Fd> claims_;  // abstract names announcing our addresses
  // An epoll set of every watcher's socket (level-triggered): polling
  // threads ask it which sockets to read, and the io thread, while it
  // watches, waits on it through one Asio descriptor (a duplicate, which
  // Asio owns and closes) made and destroyed on the io thread only.
  Fd ready_set_;
  std::optional<boost::asio::posix::stream_descriptor> ready_waiter_;
  std::map<std::pair<IpAddress, uint16_t>, Fd> send_sockets_;
  // The last flow transmit() sent on: a QP's requests, and the ACKs and
  // responses it sends back, take the same way packet after packet, and the
  // socket lookup and address build cost ~100 ns per packet (a map keyed by
  // 16-byte addresses). Send sockets are never closed while the engine runs.
  SendTarget last_target_;
  SendTarget fallback_target_;
  struct SendPeer {
    SocketAddressStorage address;  // what the socket is connected to (length 0: nothing yet)
    // The GSO segment size set on the socket (the UDP_SEGMENT option): a
    // send of one piece in datagrams of that size, or of one datagram no
    // longer, is then a plain send(), which costs ~500 cycles less than a
    // sendmsg with the size in a control message. Set once a run of GSO
    // sends asks for one size (a latency test sends one WRITE and one ACK,
    // back to back, per round trip), cleared after a run of single
    // datagrams: a single datagram sent on a socket with a size set takes
    // the kernel's GSO path, ~200 cycles dearer than without.
    uint16_t segment = 0;
    uint16_t run_size = 0;  // what the GSO sends of the current run ask for
    uint8_t run = 0;        // how many GSO sends of that size in a row
    uint8_t singles = 0;    // single datagrams in a row while `segment` is set
  };
  // Keeps the socket's GSO size in step with its sends (see SendPeer).
  void note_send(int fd, SendPeer& peer, size_t segment);
  // Sets `size` (0: none) as the GSO size of `peer`'s socket `fd`.
  static void set_socket_segment(int fd, SendPeer& peer, uint16_t size);
  // What each send socket is connected to and sends with.
  std::unordered_map<int, SendPeer> send_peers_;
  int last_peer_fd_ = -1;  // and its entry in send_peers_ (nodes stay put)
  SendPeer* last_peer_ = nullptr;
  // Sends one contiguous piece as a plain send() where `peer`'s socket
  // setting allows (see SendPeer): Sent, Failed (errno says why), or
  // NotPlain for a sendmsg to do.
  enum class PlainSend : uint8_t { Sent, Failed, NotPlain };
  PlainSend send_plain(int fd, SendPeer& peer, const iovec& piece, size_t total, size_t segment);
  std::map<IpAddress, int> receive_fd_by_address_;
  int forward_fd_ = -1;
  // Multicast groups this process's UD QPs are attached to: one socket per
  // group, bound to the group's address and port 4791 and a member of the
  // group on the netdev. Every such socket on the host gets its own copy
  // (the kernel does not spread multicast over a SO_REUSEPORT group), so
  // each process delivers to its own QPs, and the sender's host, its own
  // processes included, gets its copy through the kernel's multicast loopback.
  struct GroupMembers {
    uint64_t watcher = 0;
    std::vector<uint32_t> qpns;
  };
  std::map<IpAddress, GroupMembers> groups_;
  void leave_group_locked(std::map<IpAddress, GroupMembers>::iterator group, uint32_t qpn);
  void deliver_to_group_locked(const FlowAddress& flow, const TransportPacket& packet);
  struct SendBatch {
    int fd = -1;
    SocketAddressStorage to;
    size_t segment = 0;
    size_t count = 0;
    bool closed = false;
    size_t used = 0;  // bytes in all its datagrams
    // The datagrams, copied back to back into `copies` (its first `used`
    // bytes): one piece for the kernel to copy. (Long payloads were once
    // sent from where they lay, the application's registered memory, as
    // pieces of their own between each packet's header and trailer pieces.
    // The kernel copied those three pieces a datagram slower than it
    // copies one, more than the copy into the batch costs: copying, udp
    // ib_write_bw 64 KiB moved 9% more, higher in 10 of 10 alternated
    // pairs; 4 KiB 17%, 4 of 4; ib_send_bw 64 KiB 9-47%, 3 of 3.)
    std::vector<uint8_t> copies = std::vector<uint8_t>(kMaxGsoBytes + kMaxDatagramForBatch);
  };
  SendBatch batch_;
  // Whether another datagram of the batch's size could join it.
  bool batch_can_grow() const {
    const SendBatch& b = batch_;
    return b.count > 0 && !b.closed && b.count < kMaxGsoSegments && b.used + b.segment <= kMaxGsoBytes && gso_ok_;
  }
  // Did a post in a burst leave the batch for the next one (see
  // kBurstGap)? Every other pass sends its batch before it ends, so outside
  // a pass a batch with packets in it is one a post left.
  bool sends_waiting() const { return batch_.count > 0; }
  // io thread, mutex_ held: sends what a post left waiting. An application
  // that has made no call since for kAppIdleAfterFirst was waiting for it
  // (see kDeferralPause), unless its posting thread was only kept from its
  // core; one that made its last call just now is in the middle of a burst,
  // whether or not the io thread counts it as polling.
  void send_what_posts_left_locked(Clock::time_point now, Clock::time_point last_call) {
    if (!sends_waiting()) return;
    if (now - last_call >= kAppIdleAfterFirst && !thread_waits_for_this_cpu(last_poster_)) {
      deferral_pause_ = now - deferral_paused_until_ < kDeferralPause
                            ? std::min<Clock::duration>(2 * deferral_pause_, kDeferralPause)
                            : Clock::duration(kFirstDeferralPause);
      deferral_paused_until_ = now + deferral_pause_;
    }
    flush_sends();
  }
  uint32_t posts_since_drive_ = 0;
  pid_t last_poster_ = 0;  // the thread of the last post, which a batch may wait for
  Clock::time_point last_post_returned_{};
  Clock::time_point deferral_paused_until_{};
  Clock::duration deferral_pause_ = kFirstDeferralPause;  // the last pause's length
  bool gso_ok_ = true;
  uint16_t forward_port_ = 0;

  std::mutex mutex_;              // everything below, and all protocol state
  Clock::time_point pass_now_{};  // see now()
  bool pass_clock_set_ = false;
  IcrcHeaderCache icrc_headers_;  // for the packets sent and received
  std::unordered_map<uint32_t, udp::UdpQp> qps_;
  // QPs with answers to send after this batch, duplicates allowed until
  // after_work sorts them out. (Flat, as acks_held_: a tree allocated a
  // node per packet on the latency path.)
  std::vector<uint32_t> touched_;
  // QPs whose outbox holds only an ACK, held back since then: it leaves with
  // the next packets of a pass that posts a request (the same flow, often
  // the same UDP GSO send), or at kAckHold.
  struct HeldAck {
    uint32_t qpn;
    Clock::time_point since;
  };
  std::vector<HeldAck> acks_held_;  // a few at a time: each QP holds one ACK at most
  std::vector<HeldAck>::iterator find_held_ack(uint32_t qpn) {
    return std::find_if(acks_held_.begin(), acks_held_.end(), [qpn](const HeldAck& held) { return held.qpn == qpn; });
  }
  // How long each QP holds ACKs, where it differs from kAckHold (learned
  // from how soon its application posts after taking a request in).
  struct AckPacing {
    Clock::duration hold = kAckHold;
    Clock::time_point left_alone_since = Clock::time_point::max();  // its last ACK expired
  };
  std::unordered_map<uint32_t, AckPacing> ack_pacing_;
  Clock::duration ack_hold(uint32_t qpn) const {
    auto it = ack_pacing_.find(qpn);
    return it == ack_pacing_.end() ? Clock::duration(kAckHold) : it->second.hold;
  }
  Clock::time_point held_ack_due(const HeldAck& held) const { return held.since + ack_hold(held.qpn); }
  bool app_left_last_ack_alone(uint32_t qpn) const {
    auto it = ack_pacing_.find(qpn);
    return it != ack_pacing_.end() && it->second.left_alone_since != Clock::time_point::max();
  }
  void learn_ack_hold_locked(uint32_t qpn, Clock::time_point now);
  std::vector<Delayed> delayed_;
  std::unordered_map<uint32_t, Delayed> held_;  // reordering: one packet held back per QP
  // QPs whose responder has request packets waiting for a receive (see
  // kReceiveGrace), and how many (read by receive_posted() without the lock).
  std::vector<uint32_t> awaiting_receive_qps_;
  std::atomic<size_t> awaiting_receive_count_{0};
  // While the application is in verbs calls (drive() within
  // app_idle_after_) it does the work; the io thread stops watching the
  // sockets, so packets do not wake it, and checks back when the
  // application may have gone.
  std::atomic<Clock::rep> last_drive_{0};
  std::atomic<uint64_t> drive_count_{0};
  std::atomic<bool> app_uses_events_{false};
  uint64_t seen_drives_ = 0;                                                            // io thread only
  Clock::duration app_idle_after_ = kAppIdleAfterFirst;                                 // io thread only
  std::atomic<Clock::rep> armed_{Clock::time_point::max().time_since_epoch().count()};  // io timer
  std::mutex timer_mutex_;  // armed_ and the timerfd change together (any thread sets the timer)
  std::atomic<bool> wake_pending_{false};
  std::atomic<bool> watching_{false};  // changed by the io thread only
  // The io thread, watching, found a verbs call at work and stepped aside:
  // that call reads the sockets before it returns (see io_check).
  std::atomic<bool> reads_left_to_call_{false};
  uint64_t watch_generation_ = 0;  // io thread only
  uint32_t capture_generation_ = 0;
  int capture_fd_ = -1;
  // Receive buffers, reused.
  std::vector<std::array<uint8_t, kMaxDatagram>> buffers_ =
      std::vector<std::array<uint8_t, kMaxDatagram>>(kReceiveBatch);
};

bool UdpTransport::Engine::start(std::string* error) {
  instance_ = memory_->shared().instance_id;
  ready_set_ = Fd(::epoll_create1(EPOLL_CLOEXEC));
  if (ready_set_.get() < 0) {
    *error = std::string("epoll_create1: ") + std::strerror(errno);
    return false;
  }
  auto netdev = query_netdev(config_.netdev);
  if (netdev) ifindex_ = netdev->ifindex;
  // The addresses to listen on: the IP GIDs of the table.
  for (const GidEntry& entry : gids_) {
    if (entry.gid.is_zero() || entry.type != GidType::RoceV2) continue;
    if (std::find(local_addresses_.begin(), local_addresses_.end(), entry.gid.raw) == local_addresses_.end())
      local_addresses_.push_back(entry.gid.raw);
  }
  if (local_addresses_.empty()) {
    *error = "device " + config_.name + " has no IP address (no RoCE v2 GID) on " + config_.netdev +
             " to send UDP from; give the netdev an address and run `softverbs up` again";
    return false;
  }
  // One device per address and network namespace, as with rxe: another
  // device's claim on one of our addresses is an error, not a silent mix.
  for (const IpAddress& address : local_addresses_) {
    for (const std::string& name : abstract_names_with_prefix(address_claim_prefix(address))) {
      std::string rest = name.substr(address_claim_prefix(address).size());
      if (rest.compare(0, 16, hex(instance_)) == 0) continue;
      *error = "the address " + format_address(address) + " of " + config_.netdev +
               " already carries the UDP transport of another softverbs device (" + name +
               "); one device per address and network namespace";
      return false;
    }
  }
  for (const IpAddress& address : local_addresses_) {
    int fd = bind_udp(address, kRoceV2Port, ifindex_);
    if (fd < 0) {
      int saved = errno;
      *error = "cannot bind UDP port " + std::to_string(kRoceV2Port) + " on " + format_address(address) + ": " +
               std::strerror(saved);
      if (saved == EADDRINUSE)
        *error += " (another program owns it: a kernel rxe device, or softverbs running as another user)";
      return false;
    }
    receive_fd_by_address_[address] = fd;
    add_watcher_locked(Fd(fd), address, false);
    socklen_t length;
    sockaddr_un claim =
        abstract_address(address_claim_prefix(address) + hex(instance_) + "/" + std::to_string(current_pid()), length);
    Fd claim_fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (claim_fd.get() >= 0 && ::bind(claim_fd.get(), reinterpret_cast<sockaddr*>(&claim), length) == 0)
      claims_.push_back(std::move(claim_fd));
  }
  // Packets for our QPs that other processes of the device received reach
  // us on a loopback UDP socket (a local datagram socket would queue only
  // net.unix.max_dgram_qlen of them).
  IpAddress loopback{};
  loopback[10] = loopback[11] = 0xff;
  loopback[12] = 127;
  loopback[15] = 1;
  int forward_fd = bind_udp(loopback, 0, 0);
  if (forward_fd < 0) {
    *error = std::string("cannot bind the UDP transport's forwarding socket on 127.0.0.1 (is lo up?): ") +
             std::strerror(errno);
    return false;
  }
  sockaddr_in bound{};
  socklen_t bound_length = sizeof bound;
  getsockname(forward_fd, reinterpret_cast<sockaddr*>(&bound), &bound_length);
  forward_port_ = ntohs(bound.sin_port);
  forward_fd_ = forward_fd;
  add_watcher_locked(Fd(forward_fd), {}, true);
  int timer_fd = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (timer_fd < 0) {
    *error = std::string("timerfd_create: ") + std::strerror(errno);
    return false;
  }
  timer_waiter_.emplace(io_, timer_fd);
  wait_for_timer();
  boost::asio::post(io_, [this] { io_check(); });
  thread_ = std::thread([this] { run_thread(); });
  return true;
}

void UdpTransport::Engine::run_thread() {
  // Signals are the application's business, on its own threads.
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  pthread_setname_np(pthread_self(), "softverbs-udp");
  // Its timers are microseconds apart (takeover, held ACKs): without this
  // the kernel may fire them up to 50 us late (the default timer slack).
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  io_.run();
}

uint64_t UdpTransport::Engine::add_watcher_locked(Fd fd, const IpAddress& local, bool forward) {
  uint64_t id = next_watcher_++;
  auto watcher = std::make_unique<Watcher>();
  watcher->fd = std::move(fd);
  watcher->id = id;
  watcher->local = local;
  watcher->forward = forward;
  join_ready_set_locked(*watcher);
  watchers_.emplace(id, std::move(watcher));
  return id;
}

void UdpTransport::Engine::join_ready_set_locked(Watcher& watcher) {
  watcher.busy_reads = 0;
  if (watcher.in_ready_set) return;
  epoll_event interest{};
  interest.events = EPOLLIN;
  interest.data.u64 = watcher.id;
  // Level-triggered: what waits in the socket already makes it ready.
  watcher.in_ready_set = ::epoll_ctl(ready_set_.get(), EPOLL_CTL_ADD, watcher.fd.get(), &interest) == 0;
}

void UdpTransport::Engine::leave_ready_set_locked(Watcher& watcher) {
  if (watcher.in_ready_set && ::epoll_ctl(ready_set_.get(), EPOLL_CTL_DEL, watcher.fd.get(), nullptr) == 0)
    watcher.in_ready_set = false;
}

void UdpTransport::Engine::make_busy_locked(Watcher* watcher) {
  if (watcher == busy_watcher_) return;
  if (busy_watcher_ != nullptr) join_ready_set_locked(*busy_watcher_);
  busy_watcher_ = watcher;
  if (watcher != nullptr) watcher->busy_reads = 0;
}

void UdpTransport::Engine::connect_flow_locked(const udp::UdpQp& qp) {
  // The peer sends from the port of its flow to us (see flow_source_port);
  // a socket connected to that address and port gets exactly that flow.
  int fd = bind_udp(qp.path.local, kRoceV2Port, qp.path.scope_id);
  if (fd < 0) return;  // the reuseport group and forwarding still deliver
  SocketAddressStorage peer = to_sockaddr(qp.path.remote, flow_source_port(qp.dest_qpn, qp.qpn), qp.path.scope_id);
  if (::connect(fd, peer.get(), peer.length) != 0) {
    ::close(fd);
    return;
  }
  const uint64_t id = add_watcher_locked(Fd(fd), qp.path.local, false);
  Watcher& watcher = *watchers_.at(id);
  watcher.connected = true;
  watcher.peer = qp.path.remote;
  watcher.peer_port = flow_source_port(qp.dest_qpn, qp.qpn);
  watcher.receiver = {qp.qpn, qp.mtu};
  qp_watchers_[qp.qpn] = id;
}

void UdpTransport::Engine::send_held_ack_locked(uint32_t qpn) {
  auto held = find_held_ack(qpn);
  if (held == acks_held_.end()) return;
  acks_held_.erase(held);
  if (udp::UdpQp* qp = find(qpn)) udp::responder_send(*this, *qp, kReadBudgetPerPass);
  flush_sends();
}

void UdpTransport::Engine::learn_ack_hold_locked(uint32_t qpn, Clock::time_point now) {
  // How long after taking a request in did this application post? Its ACK
  // waited from then (held, or left alone when the hold ran out).
  Clock::time_point since;
  auto pacing = ack_pacing_.find(qpn);
  if (auto held = find_held_ack(qpn); held != acks_held_.end()) {
    since = held->since;
  } else if (pacing != ack_pacing_.end() && pacing->second.left_alone_since != Clock::time_point::max()) {
    since = pacing->second.left_alone_since;
    pacing->second.left_alone_since = Clock::time_point::max();
  } else {
    return;
  }
  const Clock::duration answer = now - since;
  const Clock::duration hold =
      answer <= kMaxAckHold ? std::clamp<Clock::duration>(answer * 2, kAckHold, kMaxAckHold) : kAckHold;
  if (pacing != ack_pacing_.end())
    pacing->second.hold = hold;
  else if (hold != Clock::duration(kAckHold))
    ack_pacing_[qpn].hold = hold;
}

void UdpTransport::Engine::forget_locked(uint32_t qpn) {
  // What this QP received was acknowledged by the time it went (by an HCA,
  // long before): a held ACK leaves now.
  send_held_ack_locked(qpn);
  ack_pacing_.erase(qpn);
  qps_.erase(qpn);
  held_.erase(qpn);
  std::erase(touched_, qpn);
  std::erase(awaiting_receive_qps_, qpn);
  note_awaiting_count_locked();
  if (auto it = qp_watchers_.find(qpn); it != qp_watchers_.end()) {
    retire_watcher_locked(it->second);
    qp_watchers_.erase(it);
  }
}

void UdpTransport::Engine::retire_watcher_locked(uint64_t id) {
  auto it = watchers_.find(id);
  if (it == watchers_.end()) return;
  leave_ready_set_locked(*it->second);
  if (busy_watcher_ == it->second.get()) busy_watcher_ = nullptr;
  watchers_.erase(it);
}

void UdpTransport::Engine::drain_all_locked(Reads reads) {
  // Reading everything is the watching io thread's way (or a poll's while it
  // watches): the socket a polling application took out of the set must be
  // in it again, as packets to it wake the io thread only through the set.
  if (reads == Reads::All && busy_watcher_ != nullptr) join_ready_set_locked(*busy_watcher_);
  // One system call finds the sockets with something to read; a pass that
  // finds nothing (most of a polling application's calls) costs only that.
  epoll_event ready[16];
  int count = ::epoll_wait(ready_set_.get(), ready, std::size(ready), 0);
  for (int i = 0; i < count; ++i) {
    auto it = watchers_.find(ready[i].data.u64);
    if (it == watchers_.end() || !drain(*it->second, reads)) continue;
    if (busy_watcher_ != nullptr && it->second.get() != busy_watcher_)
      several_flows_until_pass_ = polling_passes_ + kSeveralFlowsPasses;
    make_busy_locked(it->second.get());
  }
}

void UdpTransport::Engine::drain_polling_locked() {
  if (watching_.load(std::memory_order_relaxed)) {
    // A datagram left in a socket would not wake the io thread (only new
    // ones do): if the application stops calling now, it would wait there.
    drain_all_locked(Reads::All);
    return;
  }
  if (++polling_passes_ < several_flows_until_pass_) {
    // Every socket is read through the set now: the busy one, which may
    // have left it, joins it again.
    if (busy_watcher_ != nullptr) join_ready_set_locked(*busy_watcher_);
    drain_all_locked(Reads::One);
    return;
  }
  // Left behind, it waits at most until the io thread's next look.
  if (busy_watcher_ != nullptr && ++passes_on_busy_watcher_ < kLookAroundEvery) {
    if (drain(*busy_watcher_, Reads::One) && ++busy_watcher_->busy_reads == kBusyReadsBeforeLeavingSet)
      leave_ready_set_locked(*busy_watcher_);
    return;
  }
  passes_on_busy_watcher_ = 0;
  drain_all_locked(Reads::One);
}

void UdpTransport::Engine::start_watching() {
  if (!ready_waiter_) {
    int fd = ::dup(ready_set_.get());
    if (fd < 0) return;  // the timer still brings the io thread back
    ready_waiter_.emplace(io_, fd);
  }
  watching_.store(true, std::memory_order_relaxed);
  watch();
}

void UdpTransport::Engine::stop_watching() {
  watching_.store(false, std::memory_order_relaxed);
  ++watch_generation_;
  // Out of Asio's epoll set too: a registered descriptor wakes the io
  // thread on every packet, even with no wait queued.
  ready_waiter_.reset();
}

void UdpTransport::Engine::watch() {
  // One wait at a time: a completion that was already queued when watching
  // stopped (and started again) belongs to an old generation. The next
  // wait is queued before the sockets are read: Asio's registration is
  // edge-triggered, so a packet that arrived between the reading and a
  // later wait would not wake this thread.
  ready_waiter_->async_wait(boost::asio::posix::descriptor_base::wait_read,
                            [this, generation = watch_generation_](const boost::system::error_code& error) {
                              if (error || generation != watch_generation_) return;
                              watch();
                              io_check();
                            });
}

void UdpTransport::Engine::arm_timer(Clock::time_point when) {
  std::lock_guard guard(timer_mutex_);
  if (when.time_since_epoch().count() >= armed_.load(std::memory_order_relaxed)) return;
  armed_.store(when.time_since_epoch().count(), std::memory_order_relaxed);
  const auto since_epoch = std::chrono::duration_cast<std::chrono::nanoseconds>(when.time_since_epoch()).count();
  itimerspec due{};
  // Zero would disarm it: a deadline at the clock's origin is long past.
  due.it_value.tv_sec = static_cast<time_t>(since_epoch / 1'000'000'000);
  due.it_value.tv_nsec = std::max<long>(1, static_cast<long>(since_epoch % 1'000'000'000));
  ::timerfd_settime(timer_waiter_->native_handle(), TFD_TIMER_ABSTIME, &due, nullptr);
}

void UdpTransport::Engine::wait_for_timer() {
  // Queued before the timerfd is read, as in watch(): Asio's registration
  // is edge-triggered.
  timer_waiter_->async_wait(
      boost::asio::posix::descriptor_base::wait_read, [this](const boost::system::error_code& error) {
        if (error) return;
        wait_for_timer();
        uint64_t expirations;
        if (::read(timer_waiter_->native_handle(), &expirations, sizeof expirations) < 0)
          return;  // nothing due (EAGAIN): re-armed for later since
        {
          std::lock_guard guard(timer_mutex_);
          armed_.store(Clock::time_point::max().time_since_epoch().count(), std::memory_order_relaxed);
        }
        io_check();
      });
}

void UdpTransport::Engine::wake_io_thread() {
  if (wake_pending_.exchange(true)) return;
  boost::asio::post(io_, [this] {
    wake_pending_.store(false);
    io_check();
  });
}

void UdpTransport::Engine::io_check() {
  const Clock::time_point now = Clock::now();
  DeferredChannelWakeups wakeups;  // sent once the lock is free
  std::unique_lock guard(mutex_, std::try_to_lock);
  const bool polling = app_active(now);
  const Clock::time_point last_call(Clock::duration(last_drive_.load(std::memory_order_relaxed)));
  // A polling application's thread inside a verbs call holds the lock: it
  // is at work even if it made few calls since the last look. ib_write_bw's
  // sender, whose posts of 64 KiB take ~10 us each (two sends of 32 KiB),
  // made fewer than kBusyPollCalls between two ACKs; its io thread, taken
  // for idle, watched and waited for the lock, and the two threads took it
  // in turns, each handing it over with a futex wake, the io thread taking
  // the ACKs and the sends they let go. (A program that polls now and then,
  // between long stretches of its own work, still counts as idle, and its
  // io thread answers for it at once.)
  const bool in_call = !guard.owns_lock() && !app_waits_for_events();
  if (polling || in_call) {
    app_uses_events_.store(false, std::memory_order_relaxed);
    // What woke a watching thread may wait in a socket, and the call may
    // be the application's last for a while (a post, then a spin on
    // memory): the call reads before it returns, as this thread would
    // have once it had the lock. (A call already past that point leaves
    // it to the next post or poll, or to this thread's next look.)
    if (in_call && watching_) reads_left_to_call_.store(true, std::memory_order_relaxed);
    if (watching_) stop_watching();
    // ACKs held past kAckHold leave now, whoever else is at work.
    // So do SENDs that waited out kReceiveGrace, as RNR NAKs.
    if (guard.owns_lock()) {
      send_what_posts_left_locked(now, last_call);
      if (std::min(earliest_held_ack_locked(), earliest_receive_wait_locked()) <= now) after_work(Acks::Hold);
      guard.unlock();
    }
    // The next look comes when the application may have stopped, not when
    // an ACK still held (or a SEND still waiting) falls due: the
    // application's own passes send those on time while it calls, and if
    // it stops, that look does. A look per held ACK came every 10-100 us
    // in ib_write_lat, whose ACKs are held about half the time.
    arm_timer((polling ? last_call : now) + app_idle_after_);
    // The wait doubles for an application found inside a call too. While
    // it stayed at kAppIdleAfterFirst, the io threads of udp ib_write_lat
    // on 2 cores could lock into looking every 20 us: each look took a
    // core from a polling thread for ~15 us, often the thread of its own
    // process, found it inside the call it had interrupted (holding the
    // lock) with fewer than kBusyPollCalls made since, and came back 20 us
    // later. Runs in that state made 2,000-7,000 looks per process instead
    // of ~600, and 10-30% of their iterations took over 15 us.
    app_idle_after_ = std::min<Clock::duration>(2 * app_idle_after_, kAppIdleAfter);
    return;
  }
  app_idle_after_ = kAppIdleAfterFirst;
  if (!watching_) start_watching();
  if (!guard.owns_lock()) guard.lock();
  send_what_posts_left_locked(now, last_call);
  const auto pass = [this] {
    drain_all_locked(Reads::All);
    return after_work(app_waits_for_events() ? Acks::Send : Acks::Hold);
  };
  if (pass()) {
    // A peer whose READ or atomic this thread answered for an idle
    // application waits for the answer and may send the next request a
    // round trip later: this thread keeps reading until kAnswerSpin passes
    // with no request to answer, rather than sleep and be woken for it.
    // (Back to Asio's loop now and then, for what else is queued there: a
    // packet that arrives meanwhile wakes the watch() handler again.)
    const uint64_t calls = drive_count_.load(std::memory_order_relaxed);
    const Clock::time_point started = Clock::now();
    Clock::time_point last_answer = started;
    for (;;) {
      guard.unlock();
      wakeups.flush();
      guard.lock();
      // The application is back (its calls read the sockets), or stopping.
      if (drive_count_.load(std::memory_order_relaxed) != calls || io_.stopped()) break;
      const bool answered = pass();
      const Clock::time_point t = Clock::now();
      if (answered) last_answer = t;
      if (t - last_answer > kAnswerSpin || t - started > kAnswerSpinPerLook) break;
    }
  }
  const Clock::time_point next = earliest_deadline_locked();
  guard.unlock();
  arm_timer(next);
}

bool UdpTransport::Engine::read_connected(Watcher& watcher) {
  std::span<uint8_t> buffer(buffers_[0]);
  const ssize_t length = ::recv(watcher.fd.get(), buffer.data(), buffer.size(), MSG_DONTWAIT | MSG_TRUNC);
  if (length < 0) return false;
  if (static_cast<size_t>(length) > buffer.size()) {
    counters().add(Counter::MalformedPackets);
    return true;
  }
  const std::span<const uint8_t> bytes = buffer.first(static_cast<size_t>(length));
  const FlowAddress flow = arriving_flow(watcher);
  const wire::FirstPacket first = wire::find_first_packet(flow, bytes, watcher.receiver, icrc_headers_);
  // A flow whose reads need searching (a stream of SENDs, an unusual mix
  // of lengths) pays the recvmsg rather than the search for a while.
  if (first.searched) watcher.reads_with_gro_size = kReadsWithGroSizeAfterSearch;
  const uint64_t packets = handle_read(flow, bytes, first.bytes, first.icrc_checked);
  if (packets != 0) {
    counters().add(Counter::RxPackets, packets);
    counters().add(Counter::RxBytes, bytes.size());
  }
  return true;
}

FlowAddress UdpTransport::Engine::arriving_flow(const Watcher& watcher) {
  FlowAddress flow;
  if (watcher.connected) {
    flow.source = watcher.peer;
    flow.source_port = watcher.peer_port;
  }
  flow.destination = watcher.local;
  flow.destination_port = kRoceV2Port;
  return flow;
}

uint64_t UdpTransport::Engine::handle_read(const FlowAddress& flow, std::span<const uint8_t> read, size_t packet_bytes,
                                           bool first_checked) {
  uint64_t packets = 0;
  for (size_t at = 0; at < read.size(); at += packet_bytes, ++packets)
    handle_datagram(flow, read.subspan(at, std::min(packet_bytes, read.size() - at)), false, at == 0 && first_checked);
  return packets;
}

bool UdpTransport::Engine::drain(Watcher& watcher, Reads reads) {
  if (reads == Reads::One && watcher.connected) {
    if (watcher.reads_with_gro_size == 0) return read_connected(watcher);
    --watcher.reads_with_gro_size;
  }
  const int fd = watcher.fd.get();
  const size_t batch = reads == Reads::One ? 1 : kReceiveBatch;
  bool any = false;
  for (;;) {
    mmsghdr messages[kReceiveBatch];
    iovec vectors[kReceiveBatch];
    sockaddr_storage sources[kReceiveBatch];
    UdpGroControl controls[kReceiveBatch];
    for (size_t i = 0; i < batch; ++i) {
      vectors[i] = {buffers_[i].data(), buffers_[i].size()};
      messages[i] = {};
      messages[i].msg_hdr.msg_iov = &vectors[i];
      messages[i].msg_hdr.msg_iovlen = 1;
      messages[i].msg_hdr.msg_control = controls[i].bytes;
      messages[i].msg_hdr.msg_controllen = sizeof controls[i].bytes;
      if (!watcher.forward && !watcher.connected) {
        messages[i].msg_hdr.msg_name = &sources[i];
        messages[i].msg_hdr.msg_namelen = sizeof sources[i];
      }
    }
    int count;
    if (batch == 1) {
      // recvmsg costs ~20 ns less than a recvmmsg of one, and a polling
      // application makes many reads that find nothing.
      const ssize_t length = ::recvmsg(fd, &messages[0].msg_hdr, MSG_DONTWAIT);
      count = length < 0 ? -1 : 1;
      if (length >= 0) messages[0].msg_len = static_cast<unsigned>(length);
    } else {
      count = ::recvmmsg(fd, messages, static_cast<unsigned>(batch), MSG_DONTWAIT, nullptr);
    }
    if (count <= 0) return any;
    any = true;
    uint64_t received_packets = 0, received_bytes = 0;
    for (int i = 0; i < count; ++i) {
      std::span<const uint8_t> bytes(buffers_[i].data(), messages[i].msg_len);
      if (messages[i].msg_hdr.msg_flags & MSG_TRUNC) {
        counters().add(Counter::MalformedPackets);
        continue;
      }
      const size_t segment = udp_gro_segment(messages[i].msg_hdr, bytes.size());
      FlowAddress flow;
      if (watcher.forward) {
        udp::ForwardHeader header;
        if (bytes.size() < sizeof header) continue;
        std::memcpy(&header, bytes.data(), sizeof header);
        if (header.magic != udp::kForwardMagic || header.secret != memory_->shared().forward_secret) {
          counters().add(Counter::MalformedPackets);
          continue;
        }
        std::memcpy(flow.source.data(), header.source, 16);
        std::memcpy(flow.destination.data(), header.destination, 16);
        flow.source_port = header.source_port;
        flow.destination_port = header.destination_port;
        handle_datagram(flow, bytes.subspan(sizeof header), true);
        continue;
      }
      flow = arriving_flow(watcher);
      if (!watcher.connected && !from_sockaddr(sources[i], flow.source, flow.source_port)) continue;
      received_packets += handle_read(flow, bytes, segment, false);
      received_bytes += bytes.size();
    }
    // Counted once per read, not per packet: the counters live in one cache
    // line of device memory that the sending process writes too, and a
    // locked add on a line the other core holds costs ~100 ns.
    if (received_packets != 0) {
      counters().add(Counter::RxPackets, received_packets);
      counters().add(Counter::RxBytes, received_bytes);
    }
    if (static_cast<size_t>(count) < batch || reads == Reads::One) return any;
  }
}

void UdpTransport::Engine::handle_datagram(const FlowAddress& flow, std::span<const uint8_t> datagram, bool forwarded,
                                           bool icrc_checked) {
  if (!forwarded) {
    // A packet from one of our own addresses was captured when it was sent.
    if (memory_->shared().capture.active.load(std::memory_order_relaxed) && !is_local_address(flow.source)) {
      capture(flow, datagram);
    }
  }
  if (datagram.size() < kBthBytes + kIcrcBytes) {
    counters().add(Counter::MalformedPackets);
    return;
  }
  if (!icrc_checked && !check_icrc(flow, datagram, icrc_headers_)) {
    counters().add(Counter::IcrcErrors);
    debug_log("packet from %s:%u dropped: bad ICRC", format_address(flow.source).c_str(), flow.source_port);
    return;
  }
  auto packet = parse(datagram.first(datagram.size() - kIcrcBytes));
  if (!packet) {
    counters().add(Counter::MalformedPackets);
    return;
  }
  uint32_t qpn = packet->bth.dest_qp;
  if (qpn == kMulticastQpn) {
    deliver_to_group_locked(flow, *packet);
    return;
  }
  if (qpn == kGsiQpn) {
    qpn = route_to_cm_agent(flow, *packet, forwarded);
    if (qpn == 0) return;
  }
  const QpRecord* record = memory_->qp_by_number(qpn);
  if (record == nullptr) {
    counters().add(Counter::UnknownQp);
    return;
  }
  const pid_t owner = record->owner_pid;
  if (owner != current_pid()) {
    // Read unlocked: a port that changes under us only misdirects one packet.
    const uint16_t port = record->forward_port;
    if (forwarded || port == 0) {
      counters().add(Counter::UnknownQp);  // its owner does not use UDP
      return;
    }
    forward(port, flow, datagram);
    return;
  }
  udp::UdpQp* qp = find(qpn);
  if (qp == nullptr) {
    counters().add(Counter::UnknownQp);
    return;
  }
  const uint8_t service = packet->bth.opcode & 0xe0;
  if (qp->type == QpType::Ud) {
    if (service != static_cast<uint8_t>(Service::Ud)) {
      counters().add(Counter::MalformedPackets);
      return;
    }
    udp::ud_receive(*this, *qp, *packet, flow);
    return;
  }
  // As rxe's check_addr: a connected QP takes packets only from its peer's
  // address to its own. RoCE authenticates nothing, but a local user who
  // guessed the QPN, PSN and rkey still cannot speak for a remote peer.
  if (flow.source != qp->path.remote || flow.destination != qp->path.local) {
    counters().add(Counter::WrongSourceDropped);
    debug_log("QP %#x: packet from %s dropped: its peer is %s", qpn, format_address(flow.source).c_str(),
              format_address(qp->path.remote).c_str());
    return;
  }
  if (opcode_info(packet->bth.opcode).response()) {
    udp::completer_receive(*this, *qp, *packet);
    touched_.push_back(qpn);
  } else {
    take_request_locked(*qp, *packet, datagram.first(datagram.size() - kIcrcBytes));
  }
}

uint32_t UdpTransport::Engine::route_to_cm_agent(const FlowAddress& flow, const TransportPacket& packet,
                                                 bool forwarded) {
  if (packet.bth.opcode != opcode(Service::Ud, op::kSendOnly) || packet.deth.qkey != wire::cm::kGsiQkey) {
    counters().add(Counter::UnknownQp);
    return 0;
  }
  const CmDelivery delivery = route_cm_mad(*memory_, packet.payload);
  // A forwarded packet was answered where it arrived.
  if (delivery.answer && !forwarded) send_cm_answer(flow, *delivery.answer);
  if (delivery.agent_qpn == 0 && !delivery.answer) counters().add(Counter::UnknownQp);
  return delivery.agent_qpn;
}

void UdpTransport::Engine::take_request_locked(udp::UdpQp& qp, const TransportPacket& packet,
                                               std::span<const uint8_t> bytes) {
  udp::ResponderState& s = qp.responder;
  touched_.push_back(qp.qpn);
  bool may_wait = true;
  if (!s.awaiting_receive.empty()) {
    if (s.awaiting_receive.size() < kMaxAwaitingPackets) {
      s.awaiting_receive.emplace_back(bytes.begin(), bytes.end());  // in order, behind the one that waits
      return;
    }
    // The requester goes on sending: waiting on would only buffer more.
    retry_awaiting_locked(qp, false);
    may_wait = false;
  }
  const Clock::time_point now = this->now();
  // The answer to a request may come before the request's ACK (in the same
  // UDP GSO send: see after_work), or after it while the application is
  // still on its way from the poll that can have returned the completion to
  // the receive it posts in answer (one call since, or none), or soon after.
  const udp::RequesterState& r = qp.requester;
  const bool calls_since_completion_at_most_one =
      r.completed_at_call != UINT64_MAX && application_calls() - r.completed_at_call <= 1;
  may_wait = may_wait && qp.type == QpType::Rc &&
             (!r.queue.empty() || calls_since_completion_at_most_one || r.last_completion > now - kReceiveGrace);
  if (udp::responder_receive(*this, qp, packet, may_wait) != udp::Taken::AwaitsReceive) return;
  s.awaiting_receive.emplace_back(bytes.begin(), bytes.end());
  debug_log("QP %#x: SEND at PSN %#x waits for a receive", qp.qpn, packet.bth.psn);
  s.await_until = now + kReceiveGrace;
  awaiting_receive_qps_.push_back(qp.qpn);
  note_awaiting_count_locked();
  counters().add(Counter::ReceiveWaits);
}

void UdpTransport::Engine::retry_awaiting_locked(udp::UdpQp& qp, bool may_wait) {
  udp::ResponderState& s = qp.responder;
  while (!s.awaiting_receive.empty()) {
    const auto packet = parse(s.awaiting_receive.front());  // parsed once already: cannot fail
    if (packet && udp::responder_receive(*this, qp, *packet, may_wait) == udp::Taken::AwaitsReceive) return;
    s.awaiting_receive.pop_front();
  }
  s.await_until = Clock::time_point::max();
  touched_.push_back(qp.qpn);
  std::erase(awaiting_receive_qps_, qp.qpn);
  note_awaiting_count_locked();
}

void UdpTransport::Engine::forward(uint16_t port, const FlowAddress& flow, std::span<const uint8_t> datagram) {
  udp::ForwardHeader header;
  header.secret = memory_->shared().forward_secret;
  header.source_port = flow.source_port;
  header.destination_port = flow.destination_port;
  std::memcpy(header.source, flow.source.data(), 16);
  std::memcpy(header.destination, flow.destination.data(), 16);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  iovec parts[2] = {{&header, sizeof header}, {const_cast<uint8_t*>(datagram.data()), datagram.size()}};
  msghdr message{};
  message.msg_name = &to;
  message.msg_namelen = sizeof to;
  message.msg_iov = parts;
  message.msg_iovlen = 2;
  if (::sendmsg(forward_fd_, &message, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
    counters().add(Counter::SendErrors);
    return;
  }
  counters().add(Counter::ForwardedPackets);
}

bool UdpTransport::Engine::after_work(Acks acks, Sends sends) {
  const Clock::time_point now = this->now();
  // Due timers first: a retransmission may add to the answers below.
  for (auto& [qpn, qp] : qps_) {
    if (udp::next_deadline(qp) <= now) udp::completer_tick(*this, qp);
  }
  for (size_t i = 0; i < delayed_.size();) {
    if (delayed_[i].due <= now) {
      Delayed item = std::move(delayed_[i]);
      delayed_.erase(delayed_.begin() + static_cast<std::ptrdiff_t>(i));
      send_bytes(item.fd, item.to, item.bytes);
    } else {
      ++i;
    }
  }
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->second.due <= now) {
      send_bytes(it->second.fd, it->second.to, it->second.bytes);
      it = held_.erase(it);
    } else {
      ++it;
    }
  }
  // SENDs that wait for a receive: one may have been posted since, or
  // their time is up (an RNR NAK then).
  if (!awaiting_receive_qps_.empty()) {
    const std::vector<uint32_t> waiting = awaiting_receive_qps_;  // retrying shortens the list
    for (uint32_t qpn : waiting)
      if (udp::UdpQp* qp = find(qpn)) retry_awaiting_locked(*qp, now < qp->responder.await_until);
  }
  // An ACK that left on its own would reach a peer that, having its
  // completion, stops polling and waits for the answer to its request some
  // other way (spinning on memory): then only the peer's background thread
  // could take that answer in, a thread wake-up later. Held until this
  // process's next request, the ACK arrives with it, and the peer, still
  // polling for its completion, takes in both. A pass that posted a request
  // sends every held ACK.
  bool more = false;
  bool answered_short_request = false;
  for (const HeldAck& held : acks_held_)
    if (acks == Acks::Send || held_ack_due(held) <= now) touched_.push_back(held.qpn);
  if (touched_.size() > 1) {
    std::sort(touched_.begin(), touched_.end());
    touched_.erase(std::unique(touched_.begin(), touched_.end()), touched_.end());
  }
  for (uint32_t qpn : touched_) {
    udp::UdpQp* qp = find(qpn);
    if (qp == nullptr) continue;
    const auto held = find_held_ack(qpn);
    const bool hold_ran_out = held != acks_held_.end() && held_ack_due(*held) <= now;
    const auto& outbox = qp->responder.outbox;
    // An ACK that its requester asked for, from a QP whose application let
    // the last hold run out without posting, leaves now: that application
    // takes requests in and does not answer them (a WRITE's target, a
    // receiver of SENDs), and a requester with nothing else in flight (see
    // udp/requester.cpp) would wait out the hold and a wake-up of this
    // thread for each request: udp ib_write_bw -t 1 2 B took 62 us per
    // WRITE (18 us per SEND with ib_send_bw, whose server polls).
    const bool only_ack = outbox.size() == 1 && outbox.front().kind == udp::Response::Kind::Ack;
    const bool ack_awaited = only_ack && outbox.front().requested && app_left_last_ack_alone(qpn);
    if (acks == Acks::Hold && only_ack && !hold_ran_out && !ack_awaited) {
      if (held == acks_held_.end()) acks_held_.push_back({qpn, now});
      continue;
    }
    if (ack_awaited) answered_short_request = true;  // see kAnswerSpin
    if (held != acks_held_.end()) {
      // Left alone because its hold ran out (see learn_ack_hold_locked).
      if (acks == Acks::Hold && hold_ran_out) ack_pacing_[qpn].left_alone_since = held->since;
      acks_held_.erase(held);
    }
    if (!outbox.empty() &&
        (outbox.front().kind == udp::Response::Kind::AtomicAck ||
         (outbox.front().kind == udp::Response::Kind::ReadData && outbox.front().packets <= kAnswerSpinAfterPackets)))
      answered_short_request = true;
    if (udp::responder_send(*this, *qp, kReadBudgetPerPass)) more = true;
  }
  touched_.clear();
  if (more) {
    // Long READ responses go out in slices, so that requests and ACKs
    // in the other direction are not starved; the rest on the next pass.
    for (auto& [qpn, qp] : qps_)
      if (!qp.responder.outbox.empty()) touched_.push_back(qpn);
    boost::asio::post(io_, [this] {
      DeferredChannelWakeups wakeups;  // sent once the lock is free
      std::lock_guard guard(mutex_);
      after_work(Acks::Hold);
    });
  }
  if (sends == Sends::Now || !batch_can_grow()) flush_sends();
  // The io thread must know of a new deadline if it would sleep past it:
  // on its own thread it re-arms its timer, from another it is woken (or,
  // for a distant deadline, the timer is set from here: kArmedFromAnyThread).
  // (Not for an ACK held while the io thread steps aside for the
  // application: the application's next call sends it, or the io thread
  // when its timer finds the application gone, within kAppIdleAfter; a
  // wake-up per ACK would cost more than the hold saves. While the io
  // thread watches the sockets it has no such timer to come back by.)
  const bool on_io_thread = std::this_thread::get_id() == thread_.get_id();
  const Clock::time_point earliest = on_io_thread || watching_.load(std::memory_order_relaxed)
                                         ? earliest_deadline_locked()
                                         : earliest_protocol_deadline_locked();
  if (earliest.time_since_epoch().count() < armed_.load(std::memory_order_relaxed)) {
    if (on_io_thread || earliest - now >= kArmedFromAnyThread)
      arm_timer(earliest);
    else
      wake_io_thread();
  }
  return answered_short_request;
}

Clock::time_point UdpTransport::Engine::earliest_held_ack_locked() const {
  Clock::time_point earliest = Clock::time_point::max();
  for (const HeldAck& held : acks_held_) earliest = std::min(earliest, held_ack_due(held));
  return earliest;
}

Clock::time_point UdpTransport::Engine::earliest_receive_wait_locked() const {
  Clock::time_point earliest = Clock::time_point::max();
  for (uint32_t qpn : awaiting_receive_qps_) {
    auto it = qps_.find(qpn);
    if (it != qps_.end()) earliest = std::min(earliest, it->second.responder.await_until);
  }
  return earliest;
}

Clock::time_point UdpTransport::Engine::earliest_deadline_locked() const {
  return std::min(earliest_protocol_deadline_locked(), earliest_held_ack_locked());
}

Clock::time_point UdpTransport::Engine::earliest_protocol_deadline_locked() const {
  Clock::time_point earliest = Clock::time_point::max();
  for (const auto& [qpn, qp] : qps_) earliest = std::min(earliest, udp::next_deadline(qp));
  for (const Delayed& item : delayed_) earliest = std::min(earliest, item.due);
  for (const auto& [qpn, item] : held_) earliest = std::min(earliest, item.due);
  return std::min(earliest, earliest_receive_wait_locked());
}

int UdpTransport::Engine::send_socket(const IpAddress& local, uint16_t port) {
  auto key = std::make_pair(local, port);
  auto it = send_sockets_.find(key);
  if (it != send_sockets_.end()) return it->second.get();
  int fd = bind_udp(local, port, ifindex_);
  if (fd < 0) {
    // The flow's port is taken by someone who is not us (another user):
    // send from port 4791, still a valid RoCEv2 packet.
    auto receive = receive_fd_by_address_.find(local);
    fd = receive != receive_fd_by_address_.end() ? receive->second : -1;
    if (fd >= 0) return fd;
    return -1;
  }
  send_sockets_.emplace(key, Fd(fd));
  send_peers_.emplace(fd, SendPeer{});
  last_peer_fd_ = -1;  // the number may be one a closed socket had
  return fd;
}

const UdpTransport::Engine::SendTarget& UdpTransport::Engine::send_target(const udp::Path& path, uint16_t source_port) {
  if (last_target_.same_flow(path, source_port)) return last_target_;
  SendTarget target{path.local,
                    path.remote,
                    source_port,
                    path.scope_id,
                    send_socket(path.local, source_port),
                    to_sockaddr(path.remote, kRoceV2Port, path.scope_id)};
  // A flow whose port another user holds goes out from port 4791 (see
  // send_socket); not remembered, so that its next packet tries the port again.
  if (send_sockets_.count({path.local, source_port}) == 0) {
    fallback_target_ = target;
    return fallback_target_;
  }
  last_target_ = target;
  return last_target_;
}

void UdpTransport::Engine::send_bytes(int fd, const SocketAddressStorage& to, std::span<const uint8_t> datagram) {
  std::memcpy(batch_room(fd, to, datagram.size()), datagram.data(), datagram.size());
}

uint8_t* UdpTransport::Engine::batch_room(int fd, const SocketAddressStorage& to, size_t total) {
  SendBatch& b = batch_;
  const bool joins = b.count > 0 && fd == b.fd && to.length == b.to.length &&
                     std::memcmp(&to.storage, &b.to.storage, to.length) == 0 && !b.closed && total <= b.segment &&
                     b.used + total <= kMaxGsoBytes && b.count < kMaxGsoSegments && gso_ok_ &&
                     b.used + total <= b.copies.size();
  if (!joins) flush_sends();
  if (b.count == 0) {
    b.fd = fd;
    b.to = to;
    b.segment = total;
    // Only a datagram longer than any path MTU makes could need more room.
    if (total > b.copies.size()) b.copies.resize(total);
  }
  uint8_t* const at = b.copies.data() + b.used;
  b.used += total;
  ++b.count;
  if (total < b.segment) b.closed = true;  // only the last segment may be shorter
  return at;
}

void UdpTransport::Engine::flush_sends() {
  SendBatch& b = batch_;
  if (b.count == 0) return;
  const iovec whole{b.copies.data(), b.used};
  send_now(b.fd, b.to, std::span(&whole, 1), b.used, b.count > 1 ? b.segment : 0);
  counters().add(Counter::TxPackets, b.count);
  counters().add(Counter::TxBytes, b.used);
  b.count = 0;
  b.closed = false;
  b.used = 0;
}

UdpTransport::Engine::PlainSend UdpTransport::Engine::send_plain(int fd, SendPeer& peer, const iovec& piece,
                                                                 size_t total, size_t segment) {
  const auto asked = static_cast<uint16_t>(segment);
  const bool plain = asked != 0 ? asked == peer.segment : peer.segment == 0 || total <= peer.segment;
  if (!plain) return PlainSend::NotPlain;
  return ::send(fd, piece.iov_base, piece.iov_len, MSG_DONTWAIT | MSG_NOSIGNAL) >= 0 ? PlainSend::Sent
                                                                                     : PlainSend::Failed;
}

void UdpTransport::Engine::set_socket_segment(int fd, SendPeer& peer, uint16_t size) {
  const int value = size;
  if (::setsockopt(fd, SOL_UDP, UDP_SEGMENT, &value, sizeof value) == 0) peer.segment = size;
}

void UdpTransport::Engine::note_send(int fd, SendPeer& peer, size_t segment) {
  const auto asked = static_cast<uint16_t>(segment);
  if (asked == 0) {
    peer.run = 0;
    if (peer.segment != 0 && ++peer.singles >= kSinglesBeforeSocketSizeGoes) {
      set_socket_segment(fd, peer, 0);
      peer.singles = 0;
    }
    return;
  }
  peer.singles = 0;
  if (asked != peer.run_size) {
    peer.run_size = asked;
    peer.run = 0;
  }
  if (peer.run < kGsoSendsBeforeSocketSize) ++peer.run;
  if (peer.run == kGsoSendsBeforeSocketSize && peer.segment != asked) set_socket_segment(fd, peer, asked);
}

namespace {
// A send's errno that says the kernel or the device cannot do GSO.
bool gso_refused(int error) { return error == EINVAL || error == EIO || error == ENOPROTOOPT || error == EOPNOTSUPP; }
}  // namespace

void UdpTransport::Engine::send_now(int fd, const SocketAddressStorage& to, std::span<const iovec> parts, size_t total,
                                    size_t segment) {
  msghdr message{};
  message.msg_name = const_cast<sockaddr*>(to.get());
  message.msg_namelen = to.length;
  if (fd != last_peer_fd_) {
    auto peer = send_peers_.find(fd);
    last_peer_fd_ = fd;
    last_peer_ = peer != send_peers_.end() ? &peer->second : nullptr;
  }
  SendPeer* const peer = last_peer_;
  if (peer != nullptr) {
    if (peer->address.length == 0 && ::connect(fd, to.get(), to.length) == 0) peer->address = to;
    if (peer->address.length == to.length && std::memcmp(&peer->address.storage, &to.storage, to.length) == 0) {
      if (gso_ok_) note_send(fd, *peer, segment);
      if (parts.size() == 1 && gso_ok_) {
        const PlainSend sent = send_plain(fd, *peer, parts[0], total, segment);
        if (sent == PlainSend::Sent) return;
        if (sent == PlainSend::Failed && !(segment != 0 && gso_refused(errno))) {
          counters().add(Counter::SendErrors);
          return;
        }
      }
      message.msg_name = nullptr;
      message.msg_namelen = 0;
    }
  }
  message.msg_iov = const_cast<iovec*>(parts.data());
  message.msg_iovlen = parts.size();
  UdpSegmentControl control;
  // The control message overrides the socket's setting, also with 0 (one datagram).
  if (segment != 0 || (peer != nullptr && peer->segment != 0))
    request_udp_segments(message, control, static_cast<uint16_t>(segment));
  if (fd >= 0 && ::sendmsg(fd, &message, MSG_DONTWAIT | MSG_NOSIGNAL) >= 0) return;
  if (segment != 0 && gso_refused(errno)) {
    // No GSO here (an old kernel, a device without checksum offload): one
    // datagram at a time from now on, and no socket sets a segment size.
    gso_ok_ = false;
    for (auto& [socket, settings] : send_peers_)
      if (settings.segment != 0) set_socket_segment(socket, settings, 0);
    for_each_datagram(parts, total, segment,
                      [&](std::span<const iovec> datagram, size_t length) { send_now(fd, to, datagram, length, 0); });
    return;
  }
  counters().add(Counter::SendErrors);
}

void UdpTransport::Engine::capture(const FlowAddress& flow, std::span<const uint8_t> datagram) {
  CaptureControl& control = memory_->shared().capture;
  uint32_t generation = control.generation.load(std::memory_order_acquire);
  if (generation != capture_generation_) {
    if (capture_fd_ >= 0) ::close(capture_fd_);
    capture_fd_ = -1;
    capture_generation_ = generation;
    if (control.active.load(std::memory_order_acquire)) {
      char path[sizeof control.path];
      std::memcpy(path, control.path, sizeof path);
      path[sizeof path - 1] = 0;
      capture_fd_ = ::open(path, O_WRONLY | O_APPEND | O_CLOEXEC);
    }
  }
  if (capture_fd_ < 0) return;
  append_pcap_record(capture_fd_, ip_packet(flow, datagram));
}

namespace {

// Writes a packet whole at `out` (its header, payload, pad and ICRC;
// `headers_crc` covers the masked IP and UDP headers).
void write_packet(uint8_t* out, std::span<const uint8_t> header, std::span<const iovec> payload, size_t payload_length,
                  size_t pad, uint32_t headers_crc) {
  std::memcpy(out, header.data(), header.size());
  uint8_t* at = out + header.size();
  if (payload_length <= kAssembledPayloadUpTo) {
    // A short packet (an ACK, ib_write_lat's WRITEs) is checksummed in one
    // pass over it once it is put together, where a call per piece and
    // each piece's tail of single bytes would cost more.
    for (const iovec& piece : payload) {
      if (piece.iov_len == 0) continue;  // its base may be null
      std::memcpy(at, piece.iov_base, piece.iov_len);
      at += piece.iov_len;
    }
    std::memset(at, 0, pad);
    at += pad;
    store_icrc(~icrc_add_transport(headers_crc, std::span<const uint8_t>(out, static_cast<size_t>(at - out))), at);
    return;
  }
  // A long payload is copied by the pass that computes the ICRC over it:
  // one read of the application's memory instead of two (udp ib_write_bw
  // 64 KiB on the 2-core VM, whose sender is the bound: see crc32_fold.h).
  uint32_t crc = icrc_add_transport(headers_crc, std::span<const uint8_t>(out, header.size()));
  for (const iovec& piece : payload) {
    if (piece.iov_len == 0) continue;  // its base may be null
    crc = crc32_copy(crc, at, std::span(static_cast<const uint8_t*>(piece.iov_base), piece.iov_len));
    at += piece.iov_len;
  }
  std::memset(at, 0, pad);
  crc = crc32(crc, std::span<const uint8_t>(at, pad));
  store_icrc(~crc, at + pad);
}

}  // namespace

void UdpTransport::Engine::send_cm_answer(const FlowAddress& arrived, std::span<const uint8_t> mad) {
  TransportPacket packet;
  packet.bth.opcode = opcode(Service::Ud, op::kSendOnly);
  packet.bth.dest_qp = kGsiQpn;
  packet.deth = {wire::cm::kGsiQkey, kGsiQpn};
  std::array<uint8_t, kMaxHeaderBytes> header;
  const size_t header_length = build_headers(packet, mad.size(), header);
  const size_t total = header_length + mad.size() + pad_bytes(mad.size()) + kIcrcBytes;
  udp::Path path;
  path.local = arrived.destination;
  path.remote = arrived.source;
  FlowAddress flow;
  flow.source = path.local;
  flow.destination = path.remote;
  flow.source_port = flow_source_port(kGsiQpn, kGsiQpn);
  flow.destination_port = kRoceV2Port;
  const uint32_t headers_crc = icrc_headers_.headers_crc(flow, total);
  const SendTarget& target = send_target(path, flow.source_port);
  uint8_t* const bytes = batch_room(target.fd, target.to, total);
  const iovec payload{const_cast<uint8_t*>(mad.data()), mad.size()};
  write_packet(bytes, std::span(header.data(), header_length), std::span(&payload, 1), mad.size(),
               pad_bytes(mad.size()), headers_crc);
  if (memory_->shared().capture.active.load(std::memory_order_relaxed)) {
    capture(flow, std::span<const uint8_t>(bytes, total));
  }
}

void UdpTransport::Engine::transmit(udp::UdpQp& qp, const udp::Path& path, uint32_t destination_qpn,
                                    const TransportPacket& packet, std::span<const iovec> payload) {
  size_t payload_length = 0;
  for (const iovec& piece : payload) payload_length += piece.iov_len;
  std::array<uint8_t, kMaxHeaderBytes> header;
  size_t header_length = build_headers(packet, payload_length, header);
  if (header_length == 0) return;
  const size_t pad = pad_bytes(payload_length);
  const size_t total = header_length + payload_length + pad + kIcrcBytes;

  FlowAddress flow;
  flow.source = path.local;
  flow.destination = path.remote;
  flow.source_port = flow_source_port(qp.qpn, destination_qpn);
  flow.destination_port = kRoceV2Port;
  flow.traffic_class = path.traffic_class;
  flow.hop_limit = path.hop_limit;
  flow.flow_label = path.flow_label;

  // The ICRC: IP/UDP headers (cached per flow and length) and BTH masked,
  // then the rest.
  const uint32_t headers_crc = icrc_headers_.headers_crc(flow, total);
  const SendTarget& target = send_target(path, flow.source_port);
  const int fd = target.fd;
  const SocketAddressStorage& to = target.to;
  const bool capturing = memory_->shared().capture.active.load(std::memory_order_relaxed);
  FaultSettings settings = fault_settings();
  FaultDecision decision = qp.faults.decide(settings);
  const bool as_built = !settings.any() || (decision.action == FaultAction::Deliver && !decision.corrupt);

  if (as_built) {
    // Written straight into the send batch.
    uint8_t* const bytes = batch_room(fd, to, total);
    write_packet(bytes, std::span(header.data(), header_length), payload, payload_length, pad, headers_crc);
    if (capturing) capture(flow, std::span<const uint8_t>(bytes, total));
  } else if (decision.action == FaultAction::Drop) {
    counters().add(Counter::FaultsDropped);
  } else {
    // A copy we own: it may be altered, sent twice or sent later.
    Delayed item{Clock::now(), fd, to, std::vector<uint8_t>(total), flow};
    write_packet(item.bytes.data(), std::span(header.data(), header_length), payload, payload_length, pad, headers_crc);
    if (decision.corrupt) {
      item.bytes[decision.corrupt_offset_seed % item.bytes.size()] ^= 0x5a;
      counters().add(Counter::FaultsCorrupted);
    }
    if (capturing) capture(flow, item.bytes);
    switch (decision.action) {
      case FaultAction::Duplicate:
        counters().add(Counter::FaultsDuplicated);
        send_bytes(fd, to, item.bytes);
        send_bytes(fd, to, item.bytes);
        break;
      case FaultAction::Delay:
        counters().add(Counter::FaultsDelayed);
        item.due = Clock::now() + std::chrono::microseconds(settings.delay_us);
        delayed_.push_back(std::move(item));
        break;
      case FaultAction::Reorder:
        if (held_.count(qp.qpn) == 0) {
          counters().add(Counter::FaultsReordered);
          item.due = Clock::now() + kReorderHold;
          held_.emplace(qp.qpn, std::move(item));
          return;  // released after this QP's next packet
        }
        send_bytes(fd, to, item.bytes);
        break;
      default:
        send_bytes(fd, to, item.bytes);
        break;
    }
  }
  // A packet held back for reordering goes out after the one that overtook it.
  if (auto held = held_.empty() ? held_.end() : held_.find(qp.qpn); held != held_.end()) {
    Delayed item = std::move(held->second);
    held_.erase(held);
    send_bytes(item.fd, item.to, item.bytes);
  }
}

bool UdpTransport::Engine::source_gid_set(int sgid_index, std::string* error) const {
  if (sgid_index >= 0 && static_cast<size_t>(sgid_index) < gids_.size() && !gids_[sgid_index].gid.is_zero())
    return true;
  *error = "source GID index " + std::to_string(sgid_index) + " is empty";
  return false;
}

bool UdpTransport::Engine::usable_source_gid(int sgid_index, std::string* error) const {
  if (!source_gid_set(sgid_index, error)) return false;
  const IpAddress& local = gids_[sgid_index].gid.raw;
  if (netdev_has_address(local)) return true;
  *error = "source GID index " + std::to_string(sgid_index) + " (" + format_address(local) + ") is not an address of " +
           config_.netdev +
           ": the UDP transport sends from and receives at the GID's IP address; the RoCE v2 GIDs of " +
           config_.netdev + "'s addresses are";
  const char* separator = " index ";
  for (size_t index = 0; index < gids_.size(); ++index) {
    if (gids_[index].type != GidType::RoceV2 || gids_[index].gid.is_zero() || !netdev_has_address(gids_[index].gid.raw))
      continue;
    *error += separator + std::to_string(index) + " (" + format_address(gids_[index].gid.raw) + ")";
    separator = ", ";
  }
  return false;
}

std::optional<udp::Path> UdpTransport::Engine::resolve_path(int sgid_index, const Gid& dgid, uint8_t traffic_class,
                                                            uint8_t hop_limit, uint32_t flow_label,
                                                            std::string* error) const {
  if (!source_gid_set(sgid_index, error)) return std::nullopt;
  const IpAddress& local = gids_[sgid_index].gid.raw;
  if (dgid.is_zero()) {
    *error = "the destination GID is zero";
    return std::nullopt;
  }
  if (is_ipv4_mapped(local) != is_ipv4_mapped(dgid.raw)) {
    *error = "source GID " + format_address(local) + " and destination GID " + format_address(dgid.raw) +
             " are of different IP families";
    return std::nullopt;
  }
  udp::Path path;
  path.local = local;
  path.remote = dgid.raw;
  path.scope_id = is_link_local(dgid.raw) ? ifindex_ : 0;
  path.traffic_class = traffic_class;
  path.hop_limit = hop_limit != 0 ? hop_limit : 64;
  path.flow_label = flow_label;
  return path;
}

bool UdpTransport::Engine::netdev_has_address(const IpAddress& address) const {
  std::lock_guard guard(netdev_addresses_mutex_);
  auto known = [&] {
    return std::find(netdev_addresses_.begin(), netdev_addresses_.end(), address) != netdev_addresses_.end();
  };
  if (known()) return true;
  auto netdev = query_netdev(config_.netdev);
  if (!netdev) return true;  // gone, or not readable here: sends will say
  netdev_addresses_.clear();
  for (const auto& v4 : netdev->ipv4_addresses) netdev_addresses_.push_back(Gid::from_ipv4(v4).raw);
  for (const auto& v6 : netdev->ipv6_addresses) netdev_addresses_.push_back(v6);
  return known();
}

int UdpTransport::Engine::sync_qp(int qp_index) {
  QpRecord& record = memory_->shared().qps[qp_index];
  QpState state;
  QpType type;
  QpAttributes attributes;
  uint32_t qpn, pd_handle;
  int send_cq, recv_cq;
  bool cm_agent;
  {
    SharedLock lock(record.lock);
    if (!record.live) return EINVAL;
    cm_agent = record.gsi_agent != 0;
    state = record.state;
    type = record.type;
    attributes = record.attributes;
    qpn = record.qpn;
    pd_handle = record.pd_handle;
    send_cq = record.send_cq;
    recv_cq = record.recv_cq;
  }
  std::lock_guard guard(mutex_);
  flush_sends();  // what a post left waiting goes before the QP changes
  if (state == QpState::Reset || state == QpState::Init) {
    forget_locked(qpn);
    return 0;
  }
  udp::UdpQp* qp = find(qpn);
  if (state == QpState::Error) {
    // An HCA acknowledged what the QP received long before the application
    // could move it to ERR: a held ACK leaves first.
    send_held_ack_locked(qpn);
    if (qp != nullptr && (qp->connected || qp->sending)) udp::enter_error(*this, *qp);
    return 0;
  }
  if (qp == nullptr) {
    udp::UdpQp fresh;
    fresh.index = qp_index;
    fresh.qpn = qpn;
    fresh.type = type;
    fresh.cm_agent = cm_agent;
    fresh.faults = FaultGenerator(fault_settings().seed, qpn);
    if (type != QpType::Ud) {
      Gid dgid;
      std::memcpy(dgid.raw.data(), attributes.dgid, 16);
      std::string error;
      auto path = attributes.is_global ? resolve_path(attributes.sgid_index, dgid, attributes.traffic_class,
                                                      attributes.hop_limit, attributes.flow_label, &error)
                                       : std::nullopt;
      if (!path) {
        if (!attributes.is_global) error = "RoCE needs a GRH (ah_attr.is_global = 1 and a destination GID)";
        std::fprintf(stderr, "softverbs: QP %#x cannot use the UDP transport: %s\n", qpn, error.c_str());
        return EINVAL;
      }
      fresh.path = *path;
      fresh.dest_qpn = attributes.dest_qpn;
      fresh.responder.expected_psn = attributes.rq_psn & udp::kPsnMask;
    }
    qp = &qps_.emplace(qpn, std::move(fresh)).first->second;
    qp->connected = true;
    if (type != QpType::Ud) connect_flow_locked(*qp);
    SharedLock lock(record.lock);
    if (record.live && record.qpn == qpn) record.forward_port = forward_port_;
  }
  qp->pd_handle = pd_handle;
  qp->send_cq = send_cq;
  qp->recv_cq = recv_cq;
  // Never above what the netdev carries (packets leave with DF set).
  const uint32_t port_mtu = mtu_bytes(port_attributes(config_).active_mtu);
  qp->mtu = std::min(attributes.path_mtu != 0 ? mtu_bytes(static_cast<Mtu>(attributes.path_mtu)) : 1024, port_mtu);
  if (auto flow = qp_watchers_.find(qpn); flow != qp_watchers_.end())
    watchers_.at(flow->second)->receiver.path_mtu = qp->mtu;
  qp->attributes = attributes;
  if ((state == QpState::Rts || state == QpState::Sqd) && !qp->sending) {
    qp->sending = true;
    udp::RequesterState& r = qp->requester;
    r.next_psn = attributes.sq_psn & udp::kPsnMask;
    r.acked_psn = udp::psn_add(r.next_psn, udp::kPsnMask);
    r.retries_left = qp->attributes.retry_count;
    r.rnr_retries_left = qp->attributes.rnr_retry == 7 ? -1 : qp->attributes.rnr_retry;
  }
  qp->draining = state == QpState::Sqd;
  if (qp->sending) udp::requester_run(*this, *qp);
  after_work();
  return 0;
}

void UdpTransport::Engine::forget_qp(uint32_t qpn) {
  std::lock_guard guard(mutex_);
  // An HCA acknowledged what the QP received long before it was destroyed:
  // a held ACK leaves first, or its sender would time out and retry.
  send_held_ack_locked(qpn);
  flush_sends();
  forget_locked(qpn);
}

int UdpTransport::Engine::join_group(const Gid& group, uint32_t qpn) {
  if (!group.is_multicast()) return EINVAL;
  std::lock_guard guard(mutex_);
  auto it = groups_.find(group.raw);
  if (it == groups_.end()) {
    const bool v4 = is_ipv4_mapped(group.raw);
    Fd fd(bind_udp(group.raw, kRoceV2Port, ifindex_));
    if (fd.get() < 0) return errno;
    int joined;
    if (v4) {
      ip_mreqn request{};
      std::memcpy(&request.imr_multiaddr, group.raw.data() + 12, 4);
      request.imr_ifindex = static_cast<int>(ifindex_);
      joined = setsockopt(fd.get(), IPPROTO_IP, IP_ADD_MEMBERSHIP, &request, sizeof request);
    } else {
      ipv6_mreq request{};
      std::memcpy(&request.ipv6mr_multiaddr, group.raw.data(), 16);
      request.ipv6mr_interface = ifindex_;
      joined = setsockopt(fd.get(), IPPROTO_IPV6, IPV6_ADD_MEMBERSHIP, &request, sizeof request);
    }
    if (joined != 0) {
      const int saved = errno;
      std::fprintf(stderr, "softverbs: cannot join multicast group %s on %s: %s\n", format_address(group.raw).c_str(),
                   config_.netdev.c_str(), std::strerror(saved));
      return saved;
    }
    it = groups_.emplace(group.raw, GroupMembers{add_watcher_locked(std::move(fd), group.raw, false), {}}).first;
  }
  if (std::find(it->second.qpns.begin(), it->second.qpns.end(), qpn) == it->second.qpns.end())
    it->second.qpns.push_back(qpn);
  return 0;
}

void UdpTransport::Engine::leave_group(const Gid& group, uint32_t qpn) {
  std::lock_guard guard(mutex_);
  if (auto it = groups_.find(group.raw); it != groups_.end()) leave_group_locked(it, qpn);
}

void UdpTransport::Engine::leave_groups(uint32_t qpn) {
  std::lock_guard guard(mutex_);
  for (auto it = groups_.begin(); it != groups_.end();) leave_group_locked(it++, qpn);
}

void UdpTransport::Engine::leave_group_locked(std::map<IpAddress, GroupMembers>::iterator group, uint32_t qpn) {
  std::erase(group->second.qpns, qpn);
  if (!group->second.qpns.empty()) return;
  retire_watcher_locked(group->second.watcher);  // closing the socket leaves the group
  groups_.erase(group);
}

// A packet to QPN 0xffffff: a copy for each of this process's QPs attached
// to the group it was sent to, as an HCA replicates it to every QP attached.
void UdpTransport::Engine::deliver_to_group_locked(const FlowAddress& flow, const TransportPacket& packet) {
  auto group = groups_.find(flow.destination);
  if (group == groups_.end() || (packet.bth.opcode & 0xe0) != static_cast<uint8_t>(Service::Ud)) {
    counters().add(Counter::UnknownQp);
    return;
  }
  for (uint32_t qpn : group->second.qpns)
    if (udp::UdpQp* qp = find(qpn); qp != nullptr && qp->type == QpType::Ud) udp::ud_receive(*this, *qp, packet, flow);
}

int UdpTransport::Engine::post_send(uint32_t qpn, const udp::SendWqe& wqe) {
  DeferredChannelWakeups wakeups;  // sent once the lock is free
  std::lock_guard guard(mutex_);
  // Read once the lock is ours: the io thread may have held it for a while.
  const Clock::time_point now = note_app_active();
  PassClock clock(*this, now);
  udp::UdpQp* qp = find(qpn);
  if (qp != nullptr && qp->failed) {
    udp::flush_posted(*this, *qp, wqe);
    return 0;
  }
  if (qp == nullptr || !qp->sending) return EINVAL;
  learn_ack_hold_locked(qpn, now);
  udp::requester_post(*this, *qp, wqe);
  if (reads_left_to_this_call()) drain_all_locked(Reads::All);
  // Not for a program that sleeps in CQ events, nor while the io thread
  // watches the sockets: then no poll, and no look of the io thread's
  // within app_idle_after_, would follow to send what waits.
  last_poster_ = current_thread_id();
  const bool in_burst = posts_since_drive_++ > 0 && now - last_post_returned_ < kBurstGap &&
                        now >= deferral_paused_until_ && !app_waits_for_events() &&
                        !watching_.load(std::memory_order_relaxed);
  after_work(Acks::Send, in_burst ? Sends::MayWait : Sends::Now);
  last_post_returned_ = Clock::now();
  return 0;
}

void UdpTransport::Engine::drive() {
  const Clock::time_point now = note_app_active();
  DeferredChannelWakeups wakeups;  // sent once the lock is free
  std::unique_lock guard(mutex_, std::try_to_lock);
  if (!guard.owns_lock()) return;  // the background thread is at it
  PassClock clock(*this, now);
  posts_since_drive_ = 0;
  if (reads_left_to_this_call())
    drain_all_locked(Reads::All);
  else
    drain_polling_locked();
  // An application that sleeps in CQ events posts nothing soon after a
  // packet arrives (see app_waits_for_events()).
  after_work(app_waits_for_events() ? Acks::Send : Acks::Hold);
}

// ---- the public face ---------------------------------------------------------------

UdpTransport::UdpTransport(std::unique_ptr<Engine> engine) : engine_(std::move(engine)) {}
UdpTransport::~UdpTransport() = default;

namespace {

// This process's transports, one per device memory.
struct TransportDirectory {
  std::mutex mutex;
  std::map<const DeviceMemory*, std::weak_ptr<UdpTransport>> transports;
};

TransportDirectory& transport_directory() {
  static TransportDirectory directory;
  return directory;
}

}  // namespace

std::shared_ptr<UdpTransport> UdpTransport::acquire(const std::shared_ptr<DeviceMemory>& memory,
                                                    const DeviceConfig& config, const std::vector<GidEntry>& gids,
                                                    std::string* error) {
  TransportDirectory& directory = transport_directory();
  std::lock_guard guard(directory.mutex);
  if (auto existing = directory.transports[memory.get()].lock()) return existing;
  auto engine = std::make_unique<Engine>(memory, config, gids);
  if (!engine->start(error)) return nullptr;
  std::shared_ptr<UdpTransport> transport(new UdpTransport(std::move(engine)));
  directory.transports[memory.get()] = transport;
  return transport;
}

void UdpTransport::hold_data_paths(const DeviceMemory& memory, const std::function<void()>& change) {
  std::shared_ptr<UdpTransport> transport;
  {
    TransportDirectory& directory = transport_directory();
    std::lock_guard guard(directory.mutex);
    auto it = directory.transports.find(&memory);
    if (it != directory.transports.end()) transport = it->second.lock();
  }
  if (!transport) {
    change();
    return;
  }
  transport->engine_->hold_data_paths(change);
}

bool UdpTransport::is_local_gid(const Gid& gid) const { return engine_->is_local_gid(gid); }

bool UdpTransport::usable_source_gid(int sgid_index, std::string* error) const {
  return engine_->usable_source_gid(sgid_index, error);
}

std::optional<udp::Path> UdpTransport::resolve_path(int sgid_index, const Gid& dgid, uint8_t traffic_class,
                                                    uint8_t hop_limit, uint32_t flow_label, std::string* error) const {
  return engine_->resolve_path(sgid_index, dgid, traffic_class, hop_limit, flow_label, error);
}

int UdpTransport::sync_qp(int qp_index) { return engine_->sync_qp(qp_index); }
void UdpTransport::forget_qp(uint32_t qpn) { engine_->forget_qp(qpn); }
bool UdpTransport::carries(uint32_t qpn) const { return engine_->carries(qpn); }
int UdpTransport::join_group(const Gid& group, uint32_t qpn) { return engine_->join_group(group, qpn); }
void UdpTransport::leave_group(const Gid& group, uint32_t qpn) { engine_->leave_group(group, qpn); }
void UdpTransport::leave_groups(uint32_t qpn) { engine_->leave_groups(qpn); }
int UdpTransport::post_send(uint32_t qpn, const udp::SendWqe& wqe) { return engine_->post_send(qpn, wqe); }
void UdpTransport::drive() { engine_->drive(); }
void UdpTransport::receive_posted() { engine_->receive_posted(); }
void UdpTransport::application_waits() { engine_->application_waits(); }

}  // namespace softverbs
