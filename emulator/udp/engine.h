// The engine behind UdpTransport (udp/transport.h): one per device and
// process. It owns the sockets, the io thread, the QPs' protocol state, and
// implements the TransportPort that the requester, responder and completer
// send through. Internal to the UDP transport; its members live in files by
// concern:
//   engine.cpp           start and stop, the verbs calls' entry points, and
//                        after_work(): what every pass ends with
//   io_thread.cpp        the background thread and when it takes over from
//                        the application
//   receive_sockets.cpp  which sockets a pass reads (the epoll ready set, the
//                        busy socket of a polling application)
//   receive.cpp          reading them: GRO batches split, ICRC checked,
//                        packets dispatched or forwarded to their QP's owner
//   ack_policy.cpp       which answers leave now and which ACKs wait, and
//                        request packets that wait for a receive
//   transmit.cpp         packets built, checksummed, fault-injected, captured
//   send_batch.cpp       send sockets, UDP GSO batching, the sendmsg itself
//   qp_table.cpp         QPs attached, updated and forgotten; multicast groups
//   path.cpp             source GIDs and paths to peers
#pragma once

#include <array>
#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "device/device_attributes.h"
#include "device/device_memory.h"
#include "device/queues.h"
#include "host/device_config.h"
#include "host/gid.h"
#include "udp/ack_policy.h"
#include "udp/capture.h"
#include "udp/coalesced_read.h"
#include "udp/fault_delays.h"
#include "udp/parameters.h"
#include "udp/qp.h"
#include "udp/socket_util.h"
#include "wire/roce_packet.h"

namespace softverbs::udp {

class PortEngine : public TransportPort {
 public:
  PortEngine(std::shared_ptr<DeviceMemory> memory, DeviceConfig config, std::vector<GidEntry> gids);
  ~PortEngine() override;
  PortEngine(const PortEngine&) = delete;
  PortEngine& operator=(const PortEngine&) = delete;

  bool start(std::string* error);
  // The process is leaving (exit() or _exit()) with this engine's device
  // open: what an HCA would already have put on the wire goes now, chiefly
  // the ACKs held for the application's next request, which a process that
  // exits right after its last completion never makes. Only in the process
  // that started the engine (a forked child inherits its state), and not if
  // the engine's lock stays taken (an exit from a signal handler).
  void send_what_is_owed_before_exit();
  // False in a forked child: the engine's thread is the parent's, and its
  // epoll set and sockets are shared with the parent.
  bool started_here() const;

  // TransportPort
  DeviceMemory& memory() override { return *memory_; }
  // The time of the application's pass (a post or a poll) once it holds
  // mutex_: the clock is read once per pass, not at every use. Deadlines
  // set or checked against it are at most one pass (a few microseconds)
  // off, against timers of 10 us and more.
  Clock::time_point now() const override { return pass_clock_set_ ? pass_now_ : Clock::now(); }
  uint64_t application_calls() const override { return drive_count_.load(std::memory_order_relaxed); }
  // An equal share of kInFlightBytes for each QP with requests outstanding.
  int32_t window(const UdpQp& qp) const override;
  void transmit(UdpQp& qp, const Path& path, uint32_t destination_qpn, const wire::TransportPacket& packet,
                std::span<const iovec> payload) override;

  // path.cpp
  bool is_local_gid(const Gid& gid) const {
    for (const GidEntry& entry : gids_)
      if (!entry.gid.is_zero() && entry.gid == gid) return true;
    return false;
  }
  bool usable_source_gid(int sgid_index, std::string* error) const;
  std::optional<Path> resolve_path(int sgid_index, const Gid& dgid, uint8_t traffic_class, uint8_t hop_limit,
                                   uint32_t flow_label, std::string* error) const;

  // qp_table.cpp
  int sync_qp(int qp_index);
  void forget_qp(uint32_t qpn);
  bool carries(uint32_t qpn) {
    std::lock_guard guard(mutex_);
    return qps_.count(qpn) != 0;
  }
  size_t outstanding_sends(uint32_t qpn) {
    std::lock_guard guard(mutex_);
    const UdpQp* qp = find(qpn);
    return qp == nullptr ? 0 : qp->requester.queue.size();
  }
  int join_group(const Gid& group, uint32_t qpn);
  void leave_group(const Gid& group, uint32_t qpn);
  void leave_groups(uint32_t qpn);

  // engine.cpp
  int post_send(uint32_t qpn, const SendWqe& wqe);
  void drive();
  void receive_posted() {
    if (awaiting_receive_count_.load(std::memory_order_relaxed) == 0) return;
    DeferredChannelWakeups wakeups;  // sent once the lock is free
    std::lock_guard guard(mutex_);
    PassClock clock(*this, Clock::now());
    after_work(idle_app_acks());
  }
  // (drive() after application_waits() counts one call: still idle.)
  void application_waits() {
    app_uses_events_.store(true, std::memory_order_relaxed);
    last_drive_.store(0, std::memory_order_relaxed);
    // One that sleeps in ibv_get_cq_event reads the sockets there itself.
    if (!app_sleeps_in_channel_.load(std::memory_order_relaxed)) wake_io_thread();
  }
  // event_wait.cpp
  uint64_t wait_for_channel(int channel_fd, const SocketAddress& channel);
  // Sends the pending events (see pending_events_) as datagrams: those at
  // least `age` old.
  void send_pending_events(Clock::duration age);
  void send_stale_pending_events() {
    if (pending_event_count_.load(std::memory_order_relaxed) != 0) send_pending_events(parameters::kPendingEventHold);
  }
  // Does a thread of the application read the sockets in ibv_get_cq_event
  // (now, or its last wait ended less than kAppIdleAfter ago)? io thread.
  bool app_reads_in_channel_waits(Clock::time_point now) const;
  // io_check() then: runs only what fell due, and looks again once the
  // application may have stopped waiting.
  void look_while_app_reads(std::unique_lock<std::mutex>& guard, Clock::time_point now);
  void hold_data_paths(const std::function<void()>& change) {
    std::lock_guard guard(mutex_);
    change();
  }

 private:
  // ---- start (engine.cpp) ----------------------------------------------------------

  bool listen_on_addresses(std::string* error);
  bool open_forward_socket(std::string* error);
  bool start_timer(std::string* error);

  // ---- a pass's end (engine.cpp) ----------------------------------------------------

  // mutex_ held: answers, due timers. A pass that may hold ACKs back is one
  // that did not post a request (see kAckHold).
  enum class Acks : uint8_t { Hold, Send };
  // Whether the pass's packets leave now or may wait in the send batch for
  // the next post to join them (a post in a burst: see kBurstGap).
  enum class Sends : uint8_t { Now, MayWait };
  // Returns whether the pass answered a short READ or an atomic (see
  // kAnswerSpin).
  bool after_work(Acks acks = Acks::Send, Sends sends = Sends::Now);
  // after_work's steps.
  inline void run_due_timers_locked(Clock::time_point now);
  // A role may have started the QP's retransmission or RNR timer: the QP
  // joins timed_qps_ if it is not there. (Called after requester_post,
  // requester_run and completer_receive, the entry points that set timers;
  // completer_tick runs on listed QPs only.)
  void note_timer_locked(UdpQp& qp) {
    if (!qp.timer_listed && next_deadline(qp) != Clock::time_point::max()) list_timer_locked(qp);
  }
  void list_timer_locked(UdpQp& qp);
  inline void schedule_remaining_answers_locked();
  inline void arm_for_deadlines_locked(Clock::time_point now);
  Clock::time_point earliest_deadline_locked() const;
  // Retransmission, RNR and fault-injection timers, and receive waits: all
  // but held ACKs.
  Clock::time_point earliest_protocol_deadline_locked() const;

  // now()'s time for one pass, set and cleared under mutex_.
  class PassClock {
   public:
    PassClock(PortEngine& engine, Clock::time_point now) : engine_(engine) {
      engine_.pass_now_ = now;
      engine_.pass_clock_set_ = true;
    }
    ~PassClock() { engine_.pass_clock_set_ = false; }
    PassClock(const PassClock&) = delete;
    PassClock& operator=(const PassClock&) = delete;

   private:
    PortEngine& engine_;
  };

  // ---- ACKs held and receives awaited (ack_policy.cpp) ------------------------------

  // Sends the touched QPs' answers, holding back an ACK that may leave with
  // the QP's next request. Sets `more` if READ responses remain and
  // `answered_short_request` as after_work() returns it.
  void send_answers_locked(Acks acks, Clock::time_point now, bool& more, bool& answered_short_request);
  // Sends the ACK held for `qpn` now, if any (the QP going away or to ERR,
  // the engine stopping).
  void send_held_ack_locked(uint32_t qpn);
  // A request packet for an RC or UC QP (`bytes`: the packet without its
  // ICRC), which may wait for a receive (see kReceiveGrace).
  void take_request_locked(UdpQp& qp, const wire::TransportPacket& packet, std::span<const uint8_t> bytes);
  // Hands the QP's waiting request packets in again, in order; they go on
  // waiting only if `may_wait`.
  void retry_awaiting_locked(UdpQp& qp, bool may_wait);
  // Every QP's waiting packets: a receive may have been posted, or their
  // time is up (an RNR NAK then).
  void retry_all_awaiting_locked(Clock::time_point now);
  void note_awaiting_count_locked() {
    awaiting_receive_count_.store(awaiting_receive_qps_.size(), std::memory_order_relaxed);
  }
  Clock::time_point earliest_receive_wait_locked() const;

  // ---- the io thread (io_thread.cpp) ------------------------------------------------

  void run_thread();
  // The background thread's side (run on the io thread only).
  void io_check();
  // io_check() when the application is at work: stays out of its way.
  void step_aside(std::unique_lock<std::mutex>& guard, Clock::time_point now, Clock::time_point last_call, bool polling,
                  bool in_call);
  // io_check() for an idle application after a pass that answered a short
  // request: keeps reading for the peer's next one (see kAnswerSpin).
  void spin_for_requests(std::unique_lock<std::mutex>& guard, DeferredChannelWakeups& wakeups);
  // Has every runnable thread of the machine a CPU of its own (/proc/loadavg's
  // count of runnable threads, this one among them, against the CPUs this
  // process may run on)? If not, a spinning thread may keep the one it
  // waits for from running.
  bool cpus_to_spare();
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
    return calls >= parameters::kBusyPollCalls &&
           now.time_since_epoch().count() - last_drive_.load(std::memory_order_relaxed) < app_idle_after_.count();
  }
  // Does the application sleep until CQ events (it arms CQs and has not
  // polled busily since)? Then it posts nothing soon after a packet
  // arrives, and an ACK held for its next request only waits.
  bool app_waits_for_events() const { return app_uses_events_.load(std::memory_order_relaxed); }
  // The ACKs of an application's pass that posts nothing: held for a
  // request the application may post in answer, unless it sleeps in CQ
  // events where no pass of its own would send them soon (one that sleeps
  // in ibv_get_cq_event reading the sockets sends them there when due).
  Acks idle_app_acks() const {
    // (Not while a thread sleeps in a wait: its timeout would not cover them.)
    const bool waits_read =
        app_sleeps_in_channel_.load(std::memory_order_relaxed) && channel_waiters_.load(std::memory_order_relaxed) == 0;
    return app_waits_for_events() && !waits_read ? Acks::Send : Acks::Hold;
  }
  Clock::time_point note_app_active() {
    const Clock::time_point now = Clock::now();
    last_drive_.store(now.time_since_epoch().count(), std::memory_order_relaxed);
    drive_count_.fetch_add(1, std::memory_order_relaxed);
    return now;
  }
  // io thread, mutex_ held: sends what a post left waiting (see kBurstGap
  // and kDeferralPause).
  void send_what_posts_left_locked(Clock::time_point now, Clock::time_point last_call);

  // ---- the sockets a pass reads (receive_sockets.cpp) ------------------------------

  // A socket the engine reads (a member of ready_set_ but while a polling
  // application reads it on every pass: see leave_ready_set_locked).
  struct Watcher {
    Fd fd;
    uint64_t id = 0;
    wire::IpAddress local{};
    bool forward = false;
    bool in_ready_set = false;
    uint32_t busy_reads = 0;  // reads that found something since it last joined the set
    // A socket connected to one flow receives only from its peer: reads
    // need not ask the kernel for the source address.
    bool connected = false;
    // Until the socket was once read empty: it took any packet to the port
    // between its bind() and its connect(), which may be another flow's.
    bool sources_unknown = false;
    wire::IpAddress peer{};
    uint16_t peer_port = 0;
    // A connected socket's packets are all for one QP; the polling path
    // tells them apart without the kernel's help (read_connected), unless
    // that took a search lately: then its reads ask for the GRO size.
    wire::FlowReceiver receiver;
    uint32_t reads_with_gro_size = 0;
  };
  uint64_t add_watcher_locked(Fd fd, const wire::IpAddress& local, bool forward);
  // A socket of its own for a connected QP's flow (see receive_sockets.cpp).
  void connect_flow_locked(const UdpQp& qp);
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
  // where several sockets have been busy (kSeveralFlowsPasses). Asking the
  // set costs more than a read that finds nothing, and a packet that
  // arrives waits half a pass on average.
  void drain_polling_locked();
  // The socket a polling application reads on every pass leaves the epoll
  // set, and is in it again before the io thread watches or another socket
  // becomes the busy one (only the busy one is read without asking the set).
  void make_busy_locked(Watcher* watcher);
  void leave_ready_set_locked(Watcher& watcher);
  void join_ready_set_locked(Watcher& watcher);

  // ---- the receive path (receive.cpp) ------------------------------------------------

  // Reads what waits on `watcher` (one datagram or all, as `reads` says) and
  // handles it; mutex_ held. Returns whether anything was read.
  bool drain(Watcher& watcher, Reads reads);
  // One read of a connected socket with recv (see coalesced_read.h).
  bool read_connected(Watcher& watcher);
  // A datagram that another process of the device passed on, behind its
  // ForwardHeader.
  void take_forwarded(std::span<const uint8_t> bytes);
  // The addresses of what arrives on `watcher`: its connected peer's as the
  // source, if it has one, and its own local address on port 4791.
  static wire::FlowAddress arriving_flow(const Watcher& watcher);
  // Handles the packets of one read, `packet_bytes` each but the last (the
  // first's ICRC already found good if `first_checked`); returns how many.
  uint64_t handle_read(const wire::FlowAddress& flow, std::span<const uint8_t> read, size_t packet_bytes,
                       bool first_checked);
  // `icrc_checked`: the datagram's ICRC was already found good.
  void handle_datagram(const wire::FlowAddress& flow, std::span<const uint8_t> datagram, bool forwarded,
                       bool icrc_checked = false);
  // The QP of this process that packet `qpn` is for; nullptr if there is
  // none (counted) or another process owns it (the packet passed on).
  // This and dispatch_locked are handle_datagram's own steps, per packet:
  // always inlined, as they were when they were one function.
  [[gnu::always_inline]] inline UdpQp* owned_qp_locked(uint32_t qpn, const wire::FlowAddress& flow,
                                                       std::span<const uint8_t> datagram, bool forwarded);
  // A packet for one of this process's QPs, to its role.
  [[gnu::always_inline]] inline void dispatch_locked(UdpQp& qp, const wire::FlowAddress& flow,
                                                     const wire::TransportPacket& packet,
                                                     std::span<const uint8_t> datagram);
  // A packet for QP1: the QPN of the CM agent it belongs to, or 0 where the
  // device answered it (from QP1, back to the sender) or dropped it.
  uint32_t route_to_cm_agent(const wire::FlowAddress& flow, const wire::TransportPacket& packet, bool forwarded);
  void forward(uint16_t port, const wire::FlowAddress& flow, std::span<const uint8_t> datagram);
  bool is_local_address(const wire::IpAddress& address) const {
    return std::find(local_addresses_.begin(), local_addresses_.end(), address) != local_addresses_.end();
  }

  // ---- building packets (transmit.cpp) ----------------------------------------------

  // Where a packet of `path` from `source_port` leaves from and goes to.
  struct SendTarget {
    wire::IpAddress local{};
    wire::IpAddress remote{};
    uint16_t source_port = 0;
    // The port it really leaves from, which its ICRC covers: port 4791
    // where another program holds `source_port`.
    uint16_t leaves_from = 0;
    uint32_t scope_id = 0;
    int fd = -1;
    SocketAddressStorage to;
    bool same_flow(const Path& path, uint16_t port) const {
      return fd >= 0 && source_port == port && scope_id == path.scope_id && local == path.local &&
             remote == path.remote;
    }
  };
  // A packet that fault injection does not deliver as built (`item`: the
  // packet written out, due now): corrupted, duplicated, delayed or held
  // for reordering. True if it was held for reordering.
  bool inject_fault(UdpQp& qp, const FaultSettings& settings, const FaultDecision& decision, bool capturing,
                    HeldPacket item);
  void send_cm_answer(const wire::FlowAddress& arrived, std::span<const uint8_t> mad);
  void capture(const wire::FlowAddress& flow, std::span<const uint8_t> datagram) {
    capture_.record(memory_->shared().capture, flow, datagram);
  }
  FaultSettings fault_settings() const { return fault_override_ ? *fault_override_ : memory_->shared().faults.load(); }
  // Adversarial mode's faults go to the reliable QPs only, whose PSNs make
  // a duplicate or a loss invisible to a correct program.
  FaultSettings fault_settings_for(const UdpQp& qp) const {
    return adversarial_faults_ && !fault_override_ && qp.type == QpType::Rc ? *adversarial_faults_ : fault_settings();
  }

  // ---- sending (send_batch.cpp; batch_room and send_bytes below) --------------------

  struct SendSocket {
    int fd = -1;
    uint16_t leaves_from = 0;  // its port
  };
  // The socket a flow from `port` at `local` leaves from.
  SendSocket send_socket(const wire::IpAddress& local, uint16_t port);
  const SendTarget& send_target(const Path& path, uint16_t source_port);
  // Queues a datagram for sending (a copy of its bytes); consecutive
  // datagrams of one flow and one size leave together in one UDP GSO send
  // (flush_sends(), at the end of every engine pass).
  inline void send_bytes(int fd, const SocketAddressStorage& to, std::span<const uint8_t> datagram);
  // The room for a datagram of `total` bytes at the end of the send batch,
  // which the caller fills (send_bytes copies into it; transmit writes a
  // long packet there itself, copying its payload as it computes the ICRC).
  inline uint8_t* batch_room(int fd, const SocketAddressStorage& to, size_t total);
  void flush_sends();
  // Held ACKs and the packets fault injection delays leave, at once.
  void send_what_is_owed_locked();
  void send_now(int fd, const SocketAddressStorage& to, std::span<const iovec> parts, size_t total, size_t segment);
  struct SendPeer {
    SocketAddressStorage address;  // where the socket sends (length 0: nothing yet)
    bool connected = false;        // to `address` (IPv6 only, see send_now)
    // The GSO segment size set on the socket (the UDP_SEGMENT option): a
    // send of one piece in datagrams of that size, or of one datagram no
    // longer, is then a plain send(), cheaper than a sendmsg with the size
    // in a control message. Set once a run of GSO sends asks for one size
    // (a latency test sends one WRITE and one ACK, back to back, per round
    // trip), cleared after a run of single datagrams: a single datagram
    // sent on a socket with a size set takes the kernel's dearer GSO path.
    uint16_t segment = 0;
    uint16_t run_size = 0;  // what the GSO sends of the current run ask for
    uint8_t run = 0;        // how many GSO sends of that size in a row
    uint8_t singles = 0;    // single datagrams in a row while `segment` is set
  };
  // Keeps the socket's GSO size in step with its sends (see SendPeer).
  void note_send(int fd, SendPeer& peer, size_t segment);
  // Sets `size` (0: none) as the GSO size of `peer`'s socket `fd`.
  static void set_socket_segment(int fd, SendPeer& peer, uint16_t size);
  // Sends one contiguous piece as a plain send() where `peer`'s socket
  // setting allows (see SendPeer): Sent, Failed (errno says why), or
  // NotPlain for a sendmsg to do.
  enum class PlainSend : uint8_t { Sent, Failed, NotPlain };
  PlainSend send_plain(int fd, SendPeer& peer, const iovec& piece, size_t total, size_t segment);
  // Makes the ICRC of each datagram of a GSO send of `segment`-byte
  // datagrams, written for IPv4 identification 0, right for its place in
  // the send (1, 2, ...), or, called again, back.
  void number_datagrams(std::span<const iovec> parts, size_t total, size_t segment);
  struct SendBatch {
    int fd = -1;
    SocketAddressStorage to;
    size_t segment = 0;
    size_t count = 0;
    bool closed = false;
    size_t used = 0;  // bytes in all its datagrams
    // The QP whose posts left the batch waiting (see keeps_batch_for_acks),
    // 0 for none (QPN 0 never sends requests), and since when.
    uint32_t held_for_qpn = 0;
    Clock::time_point held_since{};
    // The datagrams, copied back to back into `copies` (its first `used`
    // bytes): one piece for the kernel to copy, which it does faster than
    // a header, payload and trailer piece per datagram, by more than the
    // copy into the batch costs (bench/NOTES.md).
    std::vector<uint8_t> copies = std::vector<uint8_t>(parameters::kMaxGsoBytes + parameters::kMaxDatagramForBatch);
  };
  // Whether another datagram of the batch's size could join it.
  bool batch_can_grow() const {
    const SendBatch& b = batch_;
    return b.count > 0 && !b.closed && b.count < max_gso_segments_ && b.used + b.segment <= parameters::kMaxGsoBytes &&
           gso_ok_;
  }
  // Did a post in a burst leave the batch for the next one (see
  // kBurstGap)? Every other pass sends its batch before it ends, so outside
  // a pass a batch with packets in it is one a post left.
  bool sends_waiting() const { return batch_.count > 0; }
  // Whether a poll may leave a posting burst's few packets waiting for more
  // (see kPacketsInFlightToHold).
  bool keeps_batch_for_acks(Clock::time_point now);
  // Whether anything would send a batch left waiting now: not while a
  // deferral pause runs, nor for a program that sleeps in CQ events, nor while
  // the io thread watches the sockets (no poll, and no look of the io
  // thread's within app_idle_after_, would follow).
  bool batch_may_wait(Clock::time_point now) const;
  // Whether `qp` has kPacketsInFlightToHold packets or more unacknowledged.
  bool many_in_flight(const UdpQp& qp) const;

  // ---- QPs and multicast groups (qp_table.cpp) ---------------------------------------

  // A QP's record as sync_qp reads it, under the record's lock.
  struct QpSnapshot {
    QpState state;
    QpType type;
    QpAttributes attributes;
    uint32_t qpn, pd_handle;
    int send_cq, recv_cq;
    bool cm_agent;
    XrcRole xrc = XrcRole::None;
  };
  // Attaches a QP that reached RTR (or a UD QP): nullptr if its path
  // cannot be resolved.
  UdpQp* attach_locked(int qp_index, const QpSnapshot& record);
  // What the record says now: CQs, MTU, attributes, RTS/SQD.
  void update_locked(UdpQp& qp, const QpSnapshot& record);
  void forget_locked(uint32_t qpn);
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
  // A socket that is a member of `group` on the netdev: an errno if not.
  int open_group_socket(const Gid& group, Fd& fd);
  void leave_group_locked(std::map<wire::IpAddress, GroupMembers>::iterator group, uint32_t qpn);
  void deliver_to_group_locked(const wire::FlowAddress& flow, const wire::TransportPacket& packet);
  UdpQp* find(uint32_t qpn) {
    auto it = qps_.find(qpn);
    return it == qps_.end() ? nullptr : &it->second;
  }

  // ---- paths (path.cpp) --------------------------------------------------------------

  bool source_gid_set(int sgid_index, std::string* error) const;
  bool netdev_has_address(const wire::IpAddress& address) const;

  // ---- state ----------------------------------------------------------------------------

  std::shared_ptr<DeviceMemory> memory_;
  DeviceConfig config_;
  std::vector<GidEntry> gids_;
  std::vector<wire::IpAddress> local_addresses_;
  unsigned ifindex_ = 0;
  // The netdev's addresses, read again when a GID is not among them. The
  // table starts with the link-local GID of the MAC, as rxe's does, which a
  // netdev may lack as an address (lo has no link-local address): packets
  // from or to it go nowhere, and a QP on it saw only IBV_WC_RETRY_EXC_ERR.
  mutable std::mutex netdev_addresses_mutex_;
  mutable std::vector<wire::IpAddress> netdev_addresses_;
  std::optional<FaultSettings> fault_override_;
  std::optional<FaultSettings> adversarial_faults_;
  uint64_t instance_ = 0;
  pid_t started_by_ = 0;  // the process that started the engine

  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
  // The io thread's timer: a timerfd of our own, which Asio watches like a
  // socket. (An Asio timer re-arms its timerfd at every expires_at() and
  // again after every expiry. Re-arming a CPU's earliest timer reprograms
  // the timer hardware, which on a virtual machine traps to the hypervisor:
  // costly for an io thread that holds an ACK every few packets.)
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
  Fd load_average_;  // /proc/loadavg, read again at offset 0 (see cpus_to_spare)
  int usable_cpus_ = 1;
  std::optional<boost::asio::posix::stream_descriptor> ready_waiter_;
  std::map<std::pair<wire::IpAddress, uint16_t>, Fd> send_sockets_;
  // Flow ports another program held when we tried to bind them, and when
  // to try again (see send_socket).
  std::map<std::pair<wire::IpAddress, uint16_t>, Clock::time_point> ports_held_elsewhere_;
  // The last flow transmit() sent on: a QP's requests, and the ACKs and
  // responses it sends back, take the same way packet after packet, and the
  // socket lookup and address build cost (a map keyed by 16-byte addresses)
  // would be paid per packet. Send sockets are never closed while the
  // engine runs.
  SendTarget last_target_;
  SendTarget fallback_target_;
  // What each send socket is connected to and sends with.
  std::unordered_map<int, SendPeer> send_peers_;
  int last_peer_fd_ = -1;  // and its entry in send_peers_ (nodes stay put)
  SendPeer* last_peer_ = nullptr;
  std::map<wire::IpAddress, int> receive_fd_by_address_;
  int forward_fd_ = -1;
  std::map<wire::IpAddress, GroupMembers> groups_;
  SendBatch batch_;
  uint32_t posts_since_drive_ = 0;
  // Polls in a row whose next post began a burst (see post_send), up to
  // kBurstsBeforeFirstPostWaits, and when the last poll began.
  uint32_t bursts_after_polls_ = 0;
  Clock::time_point last_drive_at_{};
  pid_t last_poster_ = 0;  // the thread of the last post, which a batch may wait for
  Clock::time_point last_post_returned_{};
  uint32_t unsignaled_posts_in_row_ = 0;  // since the last signaled post (see kUnsignaledBeforeSignaledLeaves)
  Clock::time_point deferral_paused_until_{};
  Clock::duration deferral_pause_ = parameters::kFirstDeferralPause;  // the last pause's length
  bool gso_ok_ = true;
  // kMaxGsoSegmentsEverywhere once a send of more failed (in the byte
  // after gso_ok_ that was padding)
  uint8_t max_gso_segments_ = parameters::kMaxGsoSegments;
  uint16_t forward_port_ = 0;

  std::mutex mutex_;              // everything below, and all protocol state
  Clock::time_point pass_now_{};  // see now()
  bool pass_clock_set_ = false;
  wire::IcrcHeaderCache icrc_headers_;  // for the packets sent and received
  std::unordered_map<uint32_t, UdpQp> qps_;
  // QPs with answers to send after this batch, duplicates allowed until
  // after_work sorts them out. (Flat, as held_acks_: a tree allocated a
  // node per packet on the latency path.)
  std::vector<uint32_t> touched_;
  // QPs whose outbox holds only an ACK, held back since then (udp/ack_policy.h).
  HeldAcks held_acks_;
  // The QPs whose timer runs (next_deadline() before time_point::max()),
  // the only ones a pass looks at for due timers, so that a process with
  // many idle QPs does not scan them all per pass; a QP leaves once its
  // timer has stopped. (Pointers into qps_, whose nodes stay put; a QP is
  // taken out before it is erased.)
  std::vector<UdpQp*> timed_qps_;
  // Packets that fault injection holds back (udp/fault_delays.h).
  FaultDelays fault_delays_;
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
  Clock::duration app_idle_after_ = parameters::kAppIdleAfterFirst;                     // io thread only
  std::atomic<Clock::rep> armed_{Clock::time_point::max().time_since_epoch().count()};  // io timer
  std::mutex timer_mutex_;  // armed_ and the timerfd change together (any thread sets the timer)
  std::atomic<bool> wake_pending_{false};
  std::atomic<bool> watching_{false};  // changed by the io thread only
  // Threads of the application in wait_for_channel: while there are any,
  // they read the sockets and the io thread does not watch them (a packet
  // would wake both). And whether the application waits that way, rather
  // than in its own poll of the channel fd (cleared once it polls busily).
  std::atomic<int> channel_waiters_{0};
  std::atomic<bool> app_sleeps_in_channel_{false};
  // Events a waiting thread's pass raised on its channel beyond the one it
  // returned, kept for the next wait on that channel to take without a
  // datagram to itself (sendto, then poll and recvmsg: a request's ACK
  // and the peer's answer arrive together and raise two events). Sent as
  // datagrams by the io thread's next look, or by a verbs call once they
  // are kPendingEventHold old. Under mutex_; the count read without it.
  struct PendingEvent {
    SocketAddress channel;
    uint64_t handle;
    Clock::time_point since;
  };
  std::vector<PendingEvent> pending_events_;
  std::atomic<size_t> pending_event_count_{0};
  std::atomic<Clock::rep> channel_wait_ended_{0};  // when the last one returned
  bool looking_for_channel_waiter_ = false;        // in look_while_app_reads (io thread only)
  // The io thread, watching, found a verbs call at work and stepped aside:
  // that call reads the sockets before it returns (see io_check).
  std::atomic<bool> reads_left_to_call_{false};
  uint64_t watch_generation_ = 0;  // io thread only
  PacketCapture capture_;
  // Receive buffers, reused.
  std::vector<std::array<uint8_t, parameters::kMaxDatagram>> buffers_ =
      std::vector<std::array<uint8_t, parameters::kMaxDatagram>>(parameters::kReceiveBatch);
};

// ---- the send batch's hot path: inline, as transmit() fills it per packet --------------

inline uint8_t* PortEngine::batch_room(int fd, const SocketAddressStorage& to, size_t total) {
  SendBatch& b = batch_;
  const bool joins = b.count > 0 && fd == b.fd && to.length == b.to.length &&
                     std::memcmp(&to.storage, &b.to.storage, to.length) == 0 && !b.closed && total <= b.segment &&
                     b.used + total <= parameters::kMaxGsoBytes && b.count < max_gso_segments_ && gso_ok_ &&
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

inline void PortEngine::send_bytes(int fd, const SocketAddressStorage& to, std::span<const uint8_t> datagram) {
  std::memcpy(batch_room(fd, to, datagram.size()), datagram.data(), datagram.size());
}

}  // namespace softverbs::udp
