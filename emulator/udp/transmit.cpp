// Building outgoing packets: headers, payload, pad and ICRC written straight
// into the send batch (udp/send_batch.cpp), fault injection, and capture.
#include <cstring>

#include "udp/engine.h"
#include "wire/crc32_fold.h"
#include "wire/icrc.h"

namespace softverbs::udp {

using namespace wire;
using namespace parameters;

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
  // one read of the application's memory instead of two (see crc32_fold.h).
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

void PortEngine::transmit(UdpQp& qp, const Path& path, uint32_t destination_qpn, const TransportPacket& packet,
                          std::span<const iovec> payload) {
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

  const SendTarget& target = send_target(path, flow.source_port);
  flow.source_port = target.leaves_from;
  // The ICRC: IP/UDP headers (cached per flow and length) and BTH masked,
  // then the rest.
  const uint32_t headers_crc = icrc_headers_.headers_crc(flow, total);
  const int fd = target.fd;
  const SocketAddressStorage& to = target.to;
  const bool capturing = memory_->shared().capture.active.load(std::memory_order_relaxed);
  FaultSettings settings = fault_settings_for(qp);
  FaultDecision decision = qp.faults.decide(settings);
  if (adversarial_faults_ && !fault_override_ && decision.action == FaultAction::Drop &&
      wire::opcode_info(packet.bth.opcode).response()) [[unlikely]]
    // A lost answer to a program's last request is retried into a peer that
    // may have finished (rdma-core's pingpongs exit on their last
    // completion): adversarial mode loses requests only.
    decision.action = FaultAction::Deliver;
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
    HeldPacket item{Clock::now(), fd, to, std::vector<uint8_t>(total), flow, qp.qpn};
    write_packet(item.bytes.data(), std::span(header.data(), header_length), payload, payload_length, pad, headers_crc);
    if (inject_fault(qp, settings, decision, capturing, std::move(item)))
      return;  // released after this QP's next packet
  }
  // A packet held back for reordering goes out after the one that overtook it.
  auto& reordered = fault_delays_.reordered;
  if (auto held = reordered.empty() ? reordered.end() : reordered.find(qp.qpn); held != reordered.end()) {
    HeldPacket item = std::move(held->second);
    reordered.erase(held);
    send_bytes(item.fd, item.to, item.bytes);
  }
}

bool PortEngine::inject_fault(UdpQp& qp, const FaultSettings& settings, const FaultDecision& decision, bool capturing,
                              HeldPacket item) {
  if (decision.corrupt) {
    item.bytes[decision.corrupt_offset_seed % item.bytes.size()] ^= 0x5a;
    counters().add(Counter::FaultsCorrupted);
  }
  if (capturing) capture(item.flow, item.bytes);
  switch (decision.action) {
    case FaultAction::Duplicate:
      counters().add(Counter::FaultsDuplicated);
      send_bytes(item.fd, item.to, item.bytes);
      send_bytes(item.fd, item.to, item.bytes);
      break;
    case FaultAction::Delay:
      counters().add(Counter::FaultsDelayed);
      item.due = Clock::now() + std::chrono::microseconds(settings.delay_us);
      fault_delays_.delayed.push_back(std::move(item));
      break;
    case FaultAction::Reorder:
      if (fault_delays_.reordered.count(qp.qpn) == 0) {
        counters().add(Counter::FaultsReordered);
        item.due = Clock::now() + kReorderHold;
        fault_delays_.reordered.emplace(qp.qpn, std::move(item));
        return true;
      }
      send_bytes(item.fd, item.to, item.bytes);
      break;
    default:
      send_bytes(item.fd, item.to, item.bytes);
      break;
  }
  return false;
}

void PortEngine::send_cm_answer(const FlowAddress& arrived, std::span<const uint8_t> mad) {
  TransportPacket packet;
  packet.bth.opcode = opcode(Service::Ud, op::kSendOnly);
  packet.bth.dest_qp = kGsiQpn;
  packet.deth = {wire::cm::kGsiQkey, kGsiQpn};
  std::array<uint8_t, kMaxHeaderBytes> header;
  const size_t header_length = build_headers(packet, mad.size(), header);
  const size_t total = header_length + mad.size() + pad_bytes(mad.size()) + kIcrcBytes;
  Path path;
  path.local = arrived.destination;
  path.remote = arrived.source;
  FlowAddress flow;
  flow.source = path.local;
  flow.destination = path.remote;
  flow.source_port = flow_source_port(kGsiQpn, kGsiQpn);
  flow.destination_port = kRoceV2Port;
  const SendTarget& target = send_target(path, flow.source_port);
  flow.source_port = target.leaves_from;
  const uint32_t headers_crc = icrc_headers_.headers_crc(flow, total);
  uint8_t* const bytes = batch_room(target.fd, target.to, total);
  const iovec payload{const_cast<uint8_t*>(mad.data()), mad.size()};
  write_packet(bytes, std::span(header.data(), header_length), std::span(&payload, 1), mad.size(),
               pad_bytes(mad.size()), headers_crc);
  if (memory_->shared().capture.active.load(std::memory_order_relaxed)) {
    capture(flow, std::span<const uint8_t>(bytes, total));
  }
}

}  // namespace softverbs::udp
