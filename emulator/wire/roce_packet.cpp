#include "wire/roce_packet.h"

#include <arpa/inet.h>

#include <cstring>

#include "wire/icrc.h"
#include "wire/roce_headers.h"

namespace softverbs::wire {

namespace {

void put16(uint8_t* out, uint16_t value) {
  out[0] = static_cast<uint8_t>(value >> 8);
  out[1] = static_cast<uint8_t>(value);
}

// One's-complement sum of 16-bit big-endian words.
uint32_t add_words(uint32_t sum, std::span<const uint8_t> bytes) {
  size_t i = 0;
  for (; i + 1 < bytes.size(); i += 2) sum += static_cast<uint32_t>(bytes[i] << 8 | bytes[i + 1]);
  if (i < bytes.size()) sum += static_cast<uint32_t>(bytes[i] << 8);
  return sum;
}

uint16_t fold(uint32_t sum) {
  while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
  return static_cast<uint16_t>(~sum);
}

}  // namespace

bool is_ipv4_mapped(const IpAddress& address) {
  static constexpr uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(address.data(), kPrefix, sizeof kPrefix) == 0;
}

std::string format_address(const IpAddress& address) {
  char text[INET6_ADDRSTRLEN] = {};
  if (is_ipv4_mapped(address))
    inet_ntop(AF_INET, address.data() + 12, text, sizeof text);
  else
    inet_ntop(AF_INET6, address.data(), text, sizeof text);
  return text;
}

size_t write_ip_udp_headers(const FlowAddress& flow, size_t udp_payload, bool checksums, std::span<uint8_t> out,
                            std::span<const uint8_t> payload_for_checksum) {
  const size_t udp_length = 8 + udp_payload;
  size_t ip_length;
  uint32_t pseudo = 0;
  if (flow.ipv4()) {
    ip_length = 20;
    uint8_t* ip = out.data();
    std::memset(ip, 0, 20);
    ip[0] = 0x45;
    ip[1] = flow.traffic_class;
    put16(ip + 2, static_cast<uint16_t>(20 + udp_length));
    put16(ip + 4, 0);       // identification: 0 for DF packets of unconnected sockets
    put16(ip + 6, 0x4000);  // DF
    ip[8] = flow.hop_limit;
    ip[9] = 17;  // UDP
    std::memcpy(ip + 12, flow.source.data() + 12, 4);
    std::memcpy(ip + 16, flow.destination.data() + 12, 4);
    if (checksums) put16(ip + 10, fold(add_words(0, std::span<const uint8_t>(ip, 20))));
    pseudo = add_words(0, std::span<const uint8_t>(ip + 12, 8)) + 17 + static_cast<uint32_t>(udp_length);
  } else {
    ip_length = 40;
    uint8_t* ip = out.data();
    uint32_t first = (6u << 28) | (uint32_t{flow.traffic_class} << 20) | (flow.flow_label & 0xfffff);
    ip[0] = static_cast<uint8_t>(first >> 24);
    ip[1] = static_cast<uint8_t>(first >> 16);
    ip[2] = static_cast<uint8_t>(first >> 8);
    ip[3] = static_cast<uint8_t>(first);
    put16(ip + 4, static_cast<uint16_t>(udp_length));
    ip[6] = 17;
    ip[7] = flow.hop_limit;
    std::memcpy(ip + 8, flow.source.data(), 16);
    std::memcpy(ip + 24, flow.destination.data(), 16);
    pseudo = add_words(0, std::span<const uint8_t>(ip + 8, 32)) + 17 + static_cast<uint32_t>(udp_length);
  }
  uint8_t* udp = out.data() + ip_length;
  put16(udp, flow.source_port);
  put16(udp + 2, flow.destination_port);
  put16(udp + 4, static_cast<uint16_t>(udp_length));
  put16(udp + 6, 0);
  if (checksums) {
    uint32_t sum = add_words(pseudo, std::span<const uint8_t>(udp, 8));
    sum = add_words(sum, payload_for_checksum);
    uint16_t checksum = fold(sum);
    put16(udp + 6, checksum == 0 ? 0xffff : checksum);
  }
  return ip_length + 8;
}

void seal(const FlowAddress& flow, std::vector<uint8_t>& transport) {
  std::array<uint8_t, kMaxIpUdpHeaders> headers;
  size_t length = write_ip_udp_headers(flow, transport.size() + kIcrcBytes, false, headers);
  uint8_t bytes[kIcrcBytes];
  store_icrc(icrc(std::span(headers.data(), length), transport), bytes);
  transport.insert(transport.end(), bytes, bytes + kIcrcBytes);
}

bool check_icrc(const FlowAddress& flow, std::span<const uint8_t> datagram) {
  IcrcHeaderCache cache;
  return check_icrc(flow, datagram, cache);
}

IcrcFit icrc_fit(const FlowAddress& flow, std::span<const uint8_t> datagram, IcrcHeaderCache& cache) {
  if (datagram.size() < kBthBytes + kIcrcBytes) return IcrcFit::kNone;
  std::span<const uint8_t> transport = datagram.first(datagram.size() - kIcrcBytes);
  const uint32_t with_zero_id = icrc_from_headers(cache.headers_crc(flow, datagram.size()), transport);
  const uint32_t received = load_icrc(datagram.data() + transport.size());
  if (with_zero_id == received) return IcrcFit::kAsSent;
  // Sent with an IPv4 identification (a datagram of a GSO send; rxe, RoCE
  // NICs): the one it used is not seen here, but whether some
  // identification fits is. (IPv6's flow label is masked out of the ICRC.)
  if (!flow.ipv4()) return IcrcFit::kNone;
  const size_t bytes_after = bytes_after_ipv4_identification(datagram.size());
  const std::optional<uint16_t> id = cache.identification(with_zero_id ^ received, bytes_after);
  if (!id.has_value()) return IcrcFit::kNone;
  return *id < kSegmentIdentifications ? IcrcFit::kGsoPlace : IcrcFit::kSomeIdentification;
}

bool check_icrc(const FlowAddress& flow, std::span<const uint8_t> datagram, IcrcHeaderCache& cache) {
  const IcrcFit fit = icrc_fit(flow, datagram, cache);
  cache.learn(flow, fit);
  return cache.takes(flow, fit);
}

namespace {
// Three packets with identification 0 and none above 127 between do not
// come from a sender that counts its identifications up (it passes 0 once
// in 65,536); four in a row that fit only another identification do not
// come from damage to ours (1 in 2^64).
constexpr uint8_t kZeroIdentificationAfter = 3;
constexpr uint8_t kOtherIdentificationAfter = 4;
}  // namespace

IcrcHeaderCache::Sender& IcrcHeaderCache::sender(const FlowAddress& flow) {
  uint32_t low;
  std::memcpy(&low, flow.source.data() + 12, 4);
  const uint32_t hash = (low ^ uint32_t{flow.source[11]} << 24 ^ uint32_t{flow.source_port}) * 0x9e3779b1u;
  Sender& sender = senders_[(hash >> 16) % kSenders];
  if (sender.address != flow.source || sender.port != flow.source_port) {
    sender = Sender{};  // a sender not seen (or forgotten): what it sends is not known
    sender.address = flow.source;
    sender.port = flow.source_port;
  }
  return sender;
}

bool IcrcHeaderCache::takes(const FlowAddress& flow, IcrcFit fit) {
  switch (fit) {
    case IcrcFit::kNone:
      return false;
    case IcrcFit::kAsSent:
    case IcrcFit::kGsoPlace:
      return true;
    case IcrcFit::kSomeIdentification:
      return !sender(flow).sends_as_softverbs;
  }
  return false;
}

void IcrcHeaderCache::learn(const FlowAddress& flow, IcrcFit fit) {
  if (fit == IcrcFit::kNone || !flow.ipv4()) return;  // damage says nothing about the sender
  Sender& sender = this->sender(flow);
  if (fit == IcrcFit::kGsoPlace) {
    sender.other_run = 0;  // says nothing more: a counter passes these too
  } else if (fit == IcrcFit::kAsSent) {
    sender.other_run = 0;
    if (sender.as_sent_run < kZeroIdentificationAfter && ++sender.as_sent_run == kZeroIdentificationAfter)
      sender.sends_as_softverbs = true;
  } else {
    sender.as_sent_run = 0;
    if (sender.other_run < kOtherIdentificationAfter && ++sender.other_run == kOtherIdentificationAfter)
      sender.sends_as_softverbs = false;
  }
}

uint32_t IcrcHeaderCache::headers_crc(const FlowAddress& flow, size_t udp_payload) {
  uint32_t ends;  // the low bytes of both addresses: what differs most between flows
  std::memcpy(&ends, flow.destination.data() + 12, 4);
  ends ^= static_cast<uint32_t>(flow.source[15]) << 8;
  const uint32_t hash = (static_cast<uint32_t>(udp_payload) * 0x9e3779b1u) ^
                        ((uint32_t{flow.source_port} << 16 | flow.destination_port) * 0x85ebca6bu) ^ ends;
  Entry& entry = entries_[(hash ^ (hash >> 16)) % kEntries];
  if (entry.udp_payload != udp_payload || entry.source_port != flow.source_port ||
      entry.destination_port != flow.destination_port || entry.source != flow.source ||
      entry.destination != flow.destination) {
    std::array<uint8_t, kMaxIpUdpHeaders> headers;
    const size_t length = write_ip_udp_headers(flow, udp_payload, false, headers);
    entry.source = flow.source;
    entry.destination = flow.destination;
    entry.source_port = flow.source_port;
    entry.destination_port = flow.destination_port;
    entry.udp_payload = static_cast<uint32_t>(udp_payload);
    entry.crc = icrc_headers(std::span(headers.data(), length));
  }
  return entry.crc;
}

std::vector<uint8_t> ip_packet(const FlowAddress& flow, std::span<const uint8_t> datagram) {
  std::array<uint8_t, kMaxIpUdpHeaders> headers;
  size_t length = write_ip_udp_headers(flow, datagram.size(), true, headers, datagram);
  std::vector<uint8_t> packet(headers.begin(), headers.begin() + static_cast<std::ptrdiff_t>(length));
  packet.insert(packet.end(), datagram.begin(), datagram.end());
  return packet;
}

uint16_t flow_source_port(uint32_t source_qpn, uint32_t destination_qpn) {
  // The kernel's rxe hashes the QPN pair the same spirit: spread flows over
  // the top quarter of the port space, one port per pair.
  uint32_t hash = (source_qpn * 0x9e3779b1u) ^ (destination_qpn * 0x85ebca6bu);
  hash ^= hash >> 15;
  return static_cast<uint16_t>(0xc000 | (hash & 0x3fff));
}

}  // namespace softverbs::wire
