// The UDP transport's per-QP protocol state and the three roles that work on
// it, split as the kernel's rxe splits them:
//   requester (udp/requester.cpp): walks the send queue, builds packets;
//   completer (udp/completer.cpp): consumes ACKs, NAKs and responses,
//     retires work requests in order, retransmits (go-back-N);
//   responder (udp/responder.cpp): executes incoming requests and answers.
// A QP's state lives in the process that owns the QP; every packet for the
// QP reaches that process (see udp/transport.h). All of it is guarded by the
// transport's mutex.
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "device/completion_ring.h"
#include "device/device_memory.h"
#include "device/queues.h"
#include "device/transport_counters.h"
#include "device/work_request.h"
#include "support/process_id.h"
#include "support/small_vector.h"
#include "udp/fault_injection.h"
#include "wire/roce_headers.h"
#include "wire/roce_packet.h"

namespace softverbs::udp {

using Clock = std::chrono::steady_clock;

// ---- PSN arithmetic (24 bits, modulo 2^24) ----------------------------------

inline constexpr uint32_t kPsnMask = 0xffffff;
inline uint32_t psn_add(uint32_t psn, uint32_t count) { return (psn + count) & kPsnMask; }
// a - b as a signed distance in (-2^23, 2^23].
inline int32_t psn_distance(uint32_t a, uint32_t b) { return static_cast<int32_t>((a - b) << 8) >> 8; }

// ---- AETH syndromes (IBA 9.7.5.1) -------------------------------------------

namespace aeth {
inline constexpr uint8_t kAck = 0x1f;     // ACK, credit count "invalid": no end-to-end flow control
inline constexpr uint8_t kRnrNak = 0x20;  // | encoded timer
inline constexpr uint8_t kNak = 0x60;     // | code
inline constexpr uint8_t kNakSequenceError = 0;
inline constexpr uint8_t kNakInvalidRequest = 1;
inline constexpr uint8_t kNakRemoteAccessError = 2;
inline constexpr uint8_t kNakRemoteOperationalError = 3;
inline constexpr uint8_t kNakInvalidRdRequest = 4;
inline uint8_t kind(uint8_t syndrome) { return syndrome & 0x60; }
inline uint8_t value(uint8_t syndrome) { return syndrome & 0x1f; }
}  // namespace aeth

// A QP's or a datagram's path, and the send work request the requester and
// completer track: the device's own (device/work_request.h).
using Path = NetworkPath;
using SendWqe = softverbs::SendWqe;

// A FIFO of work requests whose slots outlive their entries: a new entry is
// copied into a retired slot, whose vectors (SGEs, inline bytes) keep their
// buffers, so a steady stream of posts makes no heap allocation. (A deque
// of SendWqe allocated a node every third post and freed it again, and each
// WQE's own vectors were allocated afresh: two malloc/free pairs, ~250
// instructions, per 2-byte post over UDP.)
class SendQueue {
 public:
  size_t size() const { return count_; }
  bool empty() const { return count_ == 0; }
  SendWqe& operator[](size_t index) { return slots_[(head_ + index) & (slots_.size() - 1)]; }
  const SendWqe& operator[](size_t index) const { return slots_[(head_ + index) & (slots_.size() - 1)]; }
  SendWqe& front() { return slots_[head_]; }
  const SendWqe& front() const { return slots_[head_]; }
  void push_back(const SendWqe& wqe) {
    if (count_ == slots_.size()) grow();
    slots_[(head_ + count_) & (slots_.size() - 1)] = wqe;  // vector copy-assignment reuses the slot's buffers
    ++count_;
  }
  void pop_front() {
    head_ = (head_ + 1) & (slots_.size() - 1);
    --count_;
  }
  void clear() {
    head_ = 0;
    count_ = 0;
  }

 private:
  void grow() {
    std::vector<SendWqe> larger(std::max<size_t>(8, slots_.size() * 2));  // a power of two
    for (size_t i = 0; i < count_; ++i) larger[i] = std::move((*this)[i]);
    slots_ = std::move(larger);
    head_ = 0;
  }

  std::vector<SendWqe> slots_;
  size_t head_ = 0;
  size_t count_ = 0;
};

struct RequesterState {
  SendQueue queue;                // posted and not completed, in order
  size_t cursor = 0;              // the first WQE with packets left to send
  uint32_t next_psn = 0;          // first PSN of the next WQE to be assigned
  uint32_t acked_psn = 0;         // every request PSN up to this one is acknowledged
  uint32_t highest_sent_psn = 0;  // for counting retransmissions
  bool sent_any = false;
  uint32_t rd_atomic_in_flight = 0;
  Clock::time_point ack_deadline = Clock::time_point::max();  // retransmission timer
  Clock::time_point resume_at = Clock::time_point::min();     // after an RNR NAK
  int retries_left = 0;
  int rnr_retries_left = 0;  // -1: infinite (rnr_retry 7)
  // A READ re-requested from this PSN; later responses of the old stream are
  // ignored until it arrives or the timer fires.
  bool rerequest_pending = false;
  uint32_t rerequest_psn = 0;
  // When a WQE last completed, and the application's verbs calls made by
  // then (TransportPort::application_calls): an answer to it may follow at
  // once (see ResponderState::awaiting_receive).
  Clock::time_point last_completion = Clock::time_point::min();
  uint64_t completed_at_call = UINT64_MAX;
};

// An answer queued by the responder, sent in order (a READ's responses, then
// an ACK for what followed it, never the other way round).
struct Response {
  enum class Kind : uint8_t { Ack, Nak, ReadData, AtomicAck } kind = Kind::Ack;
  uint32_t psn = 0;
  uint8_t syndrome = aeth::kAck;
  uint32_t msn = 0;
  // Ack: a packet it acknowledges set AckReq (see PortEngine::send_answers_locked).
  bool requested = false;
  // ReadData
  uint64_t address = 0;  // in this process, resolved at request time
  uint32_t rkey = 0;
  uint64_t iova = 0;  // as requested, for the key check before each packet
  uint64_t length = 0;
  uint64_t sent = 0;
  uint32_t packets = 0;
  uint32_t packets_sent = 0;
  // AtomicAck
  uint64_t original = 0;
};

// A READ or atomic request remembered for duplicate detection: a repeated
// READ is answered again from memory, a repeated atomic with the saved result.
struct ReplayEntry {
  uint32_t psn = 0;
  uint32_t psn_count = 0;
  bool atomic = false;
  uint64_t original = 0;
};

enum class MessageKind : uint8_t { None, Send, Write };

struct ResponderState {
  uint32_t expected_psn = 0;
  uint32_t msn = 0;
  bool sequence_nak_sent = false;  // one NAK per gap, until the expected PSN arrives
  // The message in progress (multi-packet SEND or WRITE).
  MessageKind in_message = MessageKind::None;
  bool have_receive = false;
  uint64_t receive_wr_id = 0;
  SmallVector<Sge, limits::kMaxSge> receive_sges;  // checked again before each packet lands
  uint64_t receive_capacity = 0;
  int receive_cq = -1;  // where the receive completes: an XRC SRQ's CQ; -1: the QP's recv_cq
  uint64_t received = 0;
  bool receive_too_small = false;
  uint64_t write_iova = 0;
  uint32_t write_rkey = 0;
  uint64_t write_length = 0;
  uint64_t written = 0;
  bool drop_until_first = false;  // UC: the rest of a message whose packet was lost
  uint32_t unacknowledged = 0;    // packets since the last ACK was queued
  std::deque<Response> outbox;
  std::deque<ReplayEntry> replay;
  // A SEND that found no receive posted while it may answer a request of
  // this QP, and the request packets that arrived behind it (each without
  // its ICRC, checked on arrival): they wait, until `await_until`, for the
  // receive that the application may be posting once it sees that request
  // complete (see kReceiveGrace in udp/parameters.h).
  std::deque<std::vector<uint8_t>> awaiting_receive;
  Clock::time_point await_until = Clock::time_point::max();
};

struct UdpQp {
  int index = -1;  // QP record index in device memory
  uint32_t qpn = 0;
  QpType type = QpType::Rc;
  XrcRole xrc = XrcRole::None;  // an XRC QP speaks the XRC service (opcodes 0xa0.., XRCETH)
  bool cm_agent = false;        // sends as QP1 (cm_routing.h)
  uint32_t pd_handle = 0;
  int send_cq = -1;
  int recv_cq = -1;
  bool connected = false;  // RC/UC: path and PSNs set (RTR reached)
  bool sending = false;    // RTS reached
  bool failed = false;     // ERR entered: what is posted now is flushed
  uint32_t dest_qpn = 0;
  Path path;
  uint32_t mtu = 1024;
  QpAttributes attributes;    // qkey, access flags, timeout, retry counts, RD/atomic limits, as last set
  bool draining = false;      // SQD: sends queue but do not start
  bool timer_listed = false;  // in the transport's list of QPs whose timer runs
  FaultGenerator faults{1, 0};
  RequesterState requester;
  ResponderState responder;
};

// What the roles need from the transport that carries their packets.
class TransportPort {
 public:
  virtual ~TransportPort() = default;
  virtual DeviceMemory& memory() = 0;
  // This process's slot of the device's counters (claimed on first use).
  CounterSlot& counters() {
    if (counter_slot_ == nullptr) counter_slot_ = &memory().shared().counters.claim(current_pid());
    return *counter_slot_;
  }
  virtual Clock::time_point now() const = 0;
  // How many posts and polls the application has made on the device.
  virtual uint64_t application_calls() const = 0;
  // The PSNs this RC QP may have unacknowledged now (window_packets of its
  // path MTU unless the port shares its bytes in flight among its QPs: see
  // kInFlightBytes).
  virtual int32_t window(const UdpQp& qp) const;
  // Sends a transport packet whose payload is the bytes of `payload` (local
  // buffers, already checked); the port adds pad and ICRC and applies
  // fault injection and capture.
  virtual void transmit(UdpQp& qp, const Path& path, uint32_t destination_qpn, const wire::TransportPacket& packet,
                        std::span<const iovec> payload) = 0;

 private:
  CounterSlot* counter_slot_ = nullptr;
};

// ---- requester ----------------------------------------------------------------

// Queues a send work request (already checked against the QP's limits by
// the caller). UD and UC complete once sent; RC when acknowledged.
void requester_post(TransportPort& port, UdpQp& qp, const SendWqe& wqe);
// Sends what the window, the RD/atomic limit, fences and RNR waits allow.
void requester_run(TransportPort& port, UdpQp& qp);

// ---- completer ----------------------------------------------------------------

void completer_receive(TransportPort& port, UdpQp& qp, const wire::TransportPacket& packet);
// The retransmission timer and RNR waits: acts on what is due.
void completer_tick(TransportPort& port, UdpQp& qp);
// Retires finished WQEs from the front of the send queue, in order.
void complete_in_order(TransportPort& port, UdpQp& qp);
// Restarts sending from `psn` (go-back-N).
void go_back(TransportPort& port, UdpQp& qp, uint32_t psn);

// ---- responder ----------------------------------------------------------------

// A request packet for an RC or UC QP. If `may_await_receive`, an RC SEND
// that finds no receive posted is left as it is (no RNR NAK, no state
// changed) and the call returns AwaitsReceive: the caller keeps the packet
// and hands it in again later.
enum class Taken : uint8_t { Done, AwaitsReceive };
Taken responder_receive(TransportPort& port, UdpQp& qp, const wire::TransportPacket& packet,
                        bool may_await_receive = false);
// A UD SEND; `flow` is where it came from (for the GRH in the receive buffer).
void ud_receive(TransportPort& port, UdpQp& qp, const wire::TransportPacket& packet, const wire::FlowAddress& flow);
// Sends queued responses in order; a READ's data at most `budget` packets
// per call. True if responses remain.
bool responder_send(TransportPort& port, UdpQp& qp, uint32_t budget);

// ---- both ---------------------------------------------------------------------

// The QP goes to ERR: its record's state, its receive queue flushed, every
// send WQE completed with IBV_WC_WR_FLUSH_ERR.
void enter_error(TransportPort& port, UdpQp& qp);
// A request posted to a QP in ERR completes with IBV_WC_WR_FLUSH_ERR. (The
// provider checks the state before posting, but the io thread may move the
// QP to ERR in between, on a NAK or a retry count running out.)
void flush_posted(TransportPort& port, const UdpQp& qp, const SendWqe& wqe);
// The earliest time completer_tick() has something to do.
Clock::time_point next_deadline(const UdpQp& qp);
// 4.096 us * 2^timeout, with a floor (see docs/udp-transport.md).
Clock::duration ack_timeout(const UdpQp& qp);

}  // namespace softverbs::udp
