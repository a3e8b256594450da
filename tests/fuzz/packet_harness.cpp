#include "packet_harness.h"

#include <unistd.h>

#include <cstring>
#include <random>

#include "device/queues.h"
#include "device/receive_queue.h"
#include "wire/roce_headers.h"

namespace softverbs::fuzz {

namespace {

constexpr uint32_t kResponderPsn = 0x100;
constexpr uint32_t kRequesterPsn = 0x200;
constexpr uint32_t kAllAccess =
    access::kLocalWrite | access::kRemoteWrite | access::kRemoteRead | access::kRemoteAtomic;

std::filesystem::path make_directory() {
  std::string pattern = (std::filesystem::temp_directory_path() / "softverbs-fuzz-XXXXXX").string();
  char* made = mkdtemp(pattern.data());
  return made ? std::filesystem::path(made) : std::filesystem::path();
}

}  // namespace

PacketHarness::PacketHarness() : directory_(make_directory()), arena_(2 * kGuardBytes + kRegisteredBytes, kGuardByte) {
  std::string error;
  memory_ = DeviceMemory::open(directory_ / "fuzz.mem", &error);
  if (!memory_) {
    failure_ = error;
    return;
  }
  uint8_t* registered = arena_.data() + kGuardBytes;
  std::memset(registered, 0, kRegisteredBytes);
  auto key =
      memory_->shared().mrs.register_region(pd_, getpid(), reinterpret_cast<uint64_t>(registered),
                                            reinterpret_cast<uint64_t>(registered), kRegisteredBytes, kAllAccess);
  key_ = key.value_or(0);
  cq_ = memory_->allocate_cq();
  if (cq_ < 0 || !memory_->allocate_completion_ring(memory_->shared().cqs[cq_], 1024)) {
    failure_ = "no room for the CQ in device memory";
    return;
  }
  for (QpType type : {QpType::Rc, QpType::Uc, QpType::Ud, QpType::Rc}) qp_indices_.push_back(make_qp(type));
  reset_qps();
}

PacketHarness::~PacketHarness() {
  memory_.reset();
  std::error_code ignored;
  std::filesystem::remove_all(directory_, ignored);
}

int PacketHarness::make_qp(QpType type) {
  int index = memory_->allocate_qp();
  QpRecord& record = memory_->shared().qps[index];
  record.type = type;
  record.state = QpState::Rts;
  record.pd_handle = pd_;
  record.send_cq = record.recv_cq = cq_;
  record.rq = allocate_receive_queue(*memory_, 8, 2);
  record.attributes.qkey = 0x11111111;
  return index;
}

void PacketHarness::fill_receive_queue(size_t role) {
  const uint64_t base = reinterpret_cast<uint64_t>(arena_.data() + kGuardBytes);
  QpRecord& record = memory_->shared().qps[qp_indices_[role]];
  // Receive WQEs of two SGEs each, inside the registered buffer. (None to a
  // QP in ERR, where each would complete at once, flushed.)
  while (record.state != QpState::Error && record.rq.posted - record.rq.consumed < record.rq.capacity) {
    Sge sges[2] = {{base + 1024 * role, 700, key_}, {base + 1024 * role + 4096, 3000, key_}};
    if (post_receive(*memory_, record, 42, sges) != 0) break;
  }
}

void PacketHarness::empty_receive_queue(size_t role) {
  QpRecord& record = memory_->shared().qps[qp_indices_[role]];
  SharedLock lock(record.lock);
  ReceivePlacement taken;
  while (take_receive(*memory_, record, taken)) {
  }
}

void PacketHarness::reset_qps() {
  qps_.clear();
  for (size_t role = 0; role < qp_indices_.size(); ++role) {
    QpRecord& record = memory_->shared().qps[qp_indices_[role]];
    record.state = QpState::Rts;
    fill_receive_queue(role);
    udp::UdpQp qp;
    qp.index = qp_indices_[role];
    qp.qpn = record.qpn;
    qp.type = record.type;
    qp.pd_handle = pd_;
    qp.send_cq = qp.recv_cq = cq_;
    qp.connected = true;
    qp.sending = true;
    qp.dest_qpn = 0x77;
    qp.mtu = 1024;
    qp.attributes.qkey = 0x11111111;
    qp.attributes.access_flags = kAllAccess;
    qp.attributes.timeout = 10;
    qp.attributes.retry_count = 3;
    qp.attributes.rnr_retry = 2;
    qp.attributes.max_rd_atomic = 4;
    qp.attributes.max_dest_rd_atomic = 4;
    qp.responder.expected_psn = kResponderPsn;
    qp.requester.next_psn = kRequesterPsn;
    qp.requester.acked_psn = kRequesterPsn - 1;
    qp.requester.retries_left = 3;
    qp.requester.rnr_retries_left = 2;
    qps_.push_back(std::move(qp));
  }
  // The requester has a READ, an atomic and a SEND outstanding.
  const uint64_t base = reinterpret_cast<uint64_t>(arena_.data() + kGuardBytes);
  udp::UdpQp& requester = qps_[3];
  udp::SendWqe read;
  read.opcode = SendOpcode::RdmaRead;
  read.signaled = true;
  read.sges = {{base + 8192, 5000, key_}};
  read.length = 5000;
  read.remote_address = 0x1000;
  read.rkey = 0x1234;
  udp::SendWqe atomic;
  atomic.opcode = SendOpcode::AtomicFetchAdd;
  atomic.signaled = true;
  atomic.sges = {{base + 16384, 8, key_}};
  atomic.length = 8;
  udp::SendWqe send;
  send.opcode = SendOpcode::Send;
  send.signaled = true;
  send.sges = {{base + 20000, 2500, key_}};
  send.length = 2500;
  udp::requester_post(*this, requester, std::move(read));
  udp::requester_post(*this, requester, std::move(atomic));
  udp::requester_post(*this, requester, std::move(send));
}

void PacketHarness::transmit(udp::UdpQp&, const udp::Path&, uint32_t, const wire::TransportPacket& packet,
                             std::span<const iovec> payload) {
  ++packets_sent_;
  const auto* registered = arena_.data() + kGuardBytes;
  size_t length = 0;
  for (const iovec& piece : payload) {
    const auto* start = static_cast<const uint8_t*>(piece.iov_base);
    if (start < registered || start + piece.iov_len > registered + kRegisteredBytes)
      failure_ = "a packet's payload was read from outside the registered buffer";
    length += piece.iov_len;
  }
  std::array<uint8_t, wire::kMaxHeaderBytes> headers;
  if (wire::build_headers(packet, length, headers) == 0) failure_ = "the transport built an invalid packet";
}

PacketHarness::ResponderSnapshot PacketHarness::snapshot(const udp::ResponderState& s) {
  return {s.expected_psn,
          s.msn,
          static_cast<uint8_t>(s.in_message),
          s.have_receive,
          s.sequence_nak_sent,
          s.received,
          s.written,
          s.unacknowledged,
          s.outbox.size(),
          s.replay.size()};
}

bool PacketHarness::guards_intact() {
  for (size_t i = 0; i < kGuardBytes; ++i) {
    if (arena_[i] != kGuardByte || arena_[kGuardBytes + kRegisteredBytes + i] != kGuardByte) {
      failure_ = "a byte outside the registered buffer changed";
      return false;
    }
  }
  return true;
}

bool PacketHarness::feed(std::span<const uint8_t> input) {
  if (!memory_ || qps_.empty()) return false;  // set-up failed: failure() says why
  if (input.size() < 2 + wire::kBthBytes) return true;
  const size_t role = input[0] % qps_.size();
  udp::UdpQp& qp = qps_[role];
  std::vector<uint8_t> bytes(input.begin() + 2, input.end());
  // Steer the packet at the QP, near the PSN it expects, so that the input
  // reaches the checks past PSN and QPN rather than stopping there.
  bytes[5] = static_cast<uint8_t>(qp.qpn >> 16);
  bytes[6] = static_cast<uint8_t>(qp.qpn >> 8);
  bytes[7] = static_cast<uint8_t>(qp.qpn);
  const uint32_t base = role == 3 ? kRequesterPsn : kResponderPsn;
  const uint32_t psn = udp::psn_add(base, static_cast<uint32_t>(static_cast<int8_t>(input[1])) & udp::kPsnMask);
  bytes[9] = static_cast<uint8_t>(psn >> 16);
  bytes[10] = static_cast<uint8_t>(psn >> 8);
  bytes[11] = static_cast<uint8_t>(psn);
  now_ += std::chrono::microseconds(100);
  if (auto packet = wire::parse(bytes)) {
    ++accepted_;
    const uint8_t operation = packet->bth.opcode & 0x1f;
    const bool response = (packet->bth.opcode & 0xe0) == 0 &&
                          ((operation >= wire::op::kReadResponseFirst && operation <= wire::op::kReadResponseOnly) ||
                           operation == wire::op::kAcknowledge || operation == wire::op::kAtomicAcknowledge);
    if (qp.type == QpType::Ud) {
      wire::FlowAddress flow;
      flow.source[10] = flow.source[11] = 0xff;
      flow.destination = flow.source;
      udp::ud_receive(*this, qp, *packet, flow);
    } else if (response) {
      udp::completer_receive(*this, qp, *packet);
    } else {
      // With the first byte's top bit, the packet may wait for a receive
      // (as the UDP engine lets an answer wait): then it must have changed
      // nothing, since the engine hands it in again later as it is. With
      // the next bit, the receive queue is empty for this packet.
      const bool may_wait = (input[0] & 0x80) != 0;
      const bool no_receives = (input[0] & 0x40) != 0;
      if (no_receives) empty_receive_queue(role);
      const ResponderSnapshot before = snapshot(qp.responder);
      if (udp::responder_receive(*this, qp, *packet, may_wait) == udp::Taken::AwaitsReceive) {
        ++awaited_;
        if (!may_wait) failure_ = "a packet waited for a receive that it was not allowed to wait for";
        if (snapshot(qp.responder) != before) failure_ = "a packet left waiting for a receive changed the responder";
      }
      if (no_receives) fill_receive_queue(role);
    }
    udp::responder_send(*this, qp, 1u << 20);
    now_ += std::chrono::seconds(1);  // past every timer
    udp::completer_tick(*this, qp);
  }
  // Consume the completions, and start over once a QP has failed.
  CompletionRing ring = memory_->completion_ring(memory_->shared().cqs[cq_]);
  Completion drained[64];
  while (ring.pop(drained) != 0) {
  }
  if (!qp.connected || !qp.sending) reset_qps();
  return guards_intact() && failure_.empty();
}

std::vector<std::vector<uint8_t>> seed_inputs() {
  using namespace wire;
  std::vector<std::vector<uint8_t>> out;
  std::vector<uint8_t> payload(4096);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i);
  for (int value = 0; value < 256; ++value) {
    if (!opcode_info(static_cast<uint8_t>(value)).valid) continue;
    for (size_t length : {0, 1, 8, 1000, 1024, 1500, 4096}) {
      for (int variant = 0; variant < 2; ++variant) {
        TransportPacket p;
        p.bth.opcode = static_cast<uint8_t>(value);
        p.bth.ack_request = true;
        // An unregistered key and address, or a small key at a small address.
        p.reth = {variant ? 0x1000u : 0xdeadbeef000ull, variant ? 0u : 0x1234u, static_cast<uint32_t>(length * 3)};
        p.atomic = {variant ? 0x1008u : 0x7ull, 0x1234, 1, 2};
        p.aeth = {static_cast<uint8_t>(variant ? 0x1f : 0x61), 0};
        p.deth = {0x11111111, 0x55};
        if (opcode_info(p.bth.opcode).headers & header::kPayload) p.payload = std::span(payload).first(length);
        std::vector<uint8_t> packet = build(p);
        for (uint8_t role = 0; role < 4; ++role)
          for (int8_t offset : {-3, -1, 0, 1, 2, 5, 9}) {
            std::vector<uint8_t> input(2 + packet.size());
            input[0] = role;
            input[1] = static_cast<uint8_t>(offset);
            std::copy(packet.begin(), packet.end(), input.begin() + 2);
            out.push_back(std::move(input));
          }
      }
    }
  }
  return out;
}

}  // namespace softverbs::fuzz
