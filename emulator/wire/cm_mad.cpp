#include "wire/cm_mad.h"

#include <algorithm>
#include <cstring>

namespace softverbs::wire::cm {

namespace {

// Big-endian fields at byte offsets of the message (after the MAD header).
class Writer {
 public:
  explicit Writer(std::span<uint8_t> message) : m_(message) {}
  void u8(size_t at, uint8_t value) { m_[at] = value; }
  void u16(size_t at, uint16_t value) { put(at, value, 2); }
  void u24(size_t at, uint32_t value) { put(at, value & 0xffffff, 3); }
  void u32(size_t at, uint32_t value) { put(at, value, 4); }
  void u64(size_t at, uint64_t value) { put(at, value, 8); }
  template <size_t N>
  void bytes(size_t at, const std::array<uint8_t, N>& value) {
    std::copy(value.begin(), value.end(), m_.begin() + static_cast<std::ptrdiff_t>(at));
  }

 private:
  void put(size_t at, uint64_t value, size_t width) {
    for (size_t i = 0; i < width; ++i) m_[at + i] = static_cast<uint8_t>(value >> (8 * (width - 1 - i)));
  }
  std::span<uint8_t> m_;
};

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> message) : m_(message) {}
  uint8_t u8(size_t at) const { return m_[at]; }
  uint16_t u16(size_t at) const { return static_cast<uint16_t>(get(at, 2)); }
  uint32_t u24(size_t at) const { return static_cast<uint32_t>(get(at, 3)); }
  uint32_t u32(size_t at) const { return static_cast<uint32_t>(get(at, 4)); }
  uint64_t u64(size_t at) const { return get(at, 8); }
  template <size_t N>
  void bytes(size_t at, std::array<uint8_t, N>& out) const {
    std::copy_n(m_.begin() + static_cast<std::ptrdiff_t>(at), N, out.begin());
  }

 private:
  uint64_t get(size_t at, size_t width) const {
    uint64_t value = 0;
    for (size_t i = 0; i < width; ++i) value = value << 8 | m_[at + i];
    return value;
  }
  std::span<const uint8_t> m_;
};

constexpr size_t kPathBytes = 44;
constexpr size_t kReqPrimaryPath = 52;
constexpr size_t kReqAlternatePath = kReqPrimaryPath + kPathBytes;
constexpr size_t kReqPrivateAt = kReqAlternatePath + kPathBytes;

void write_path(Writer& w, size_t at, const Path& path) {
  w.u16(at, path.local_lid);
  w.u16(at + 2, path.remote_lid);
  w.bytes(at + 4, path.local_gid);
  w.bytes(at + 20, path.remote_gid);
  w.u32(at + 36, (path.flow_label & 0xfffff) << 12 | (path.packet_rate & 0x3f));
  w.u8(at + 40, path.traffic_class);
  w.u8(at + 41, path.hop_limit);
  w.u8(at + 42, static_cast<uint8_t>((path.sl & 0xf) << 4 | (path.subnet_local ? 0x08 : 0)));
  w.u8(at + 43, static_cast<uint8_t>((path.local_ack_timeout & 0x1f) << 3));
}

Path read_path(const Reader& r, size_t at) {
  Path path;
  path.local_lid = r.u16(at);
  path.remote_lid = r.u16(at + 2);
  r.bytes(at + 4, path.local_gid);
  r.bytes(at + 20, path.remote_gid);
  const uint32_t word = r.u32(at + 36);
  path.flow_label = word >> 12;
  path.packet_rate = word & 0x3f;
  path.traffic_class = r.u8(at + 40);
  path.hop_limit = r.u8(at + 41);
  path.sl = r.u8(at + 42) >> 4;
  path.subnet_local = (r.u8(at + 42) & 0x08) != 0;
  path.local_ack_timeout = r.u8(at + 43) >> 3;
  return path;
}

void write_req(Writer& w, const Req& m) {
  w.u32(0, m.local_comm_id);
  w.u24(4, m.vendor_id);
  w.u64(8, m.service_id);
  w.u64(16, m.local_ca_guid);
  w.u32(28, m.local_qkey);
  w.u24(32, m.local_qpn);
  w.u8(35, m.responder_resources);
  w.u24(36, m.local_eecn);
  w.u8(39, m.initiator_depth);
  w.u24(40, m.remote_eecn);
  w.u8(43, static_cast<uint8_t>((m.remote_cm_response_timeout & 0x1f) << 3 | (m.transport_service_type & 3) << 1 |
                                (m.end_to_end_flow_control ? 1 : 0)));
  w.u24(44, m.starting_psn);
  w.u8(47, static_cast<uint8_t>((m.local_cm_response_timeout & 0x1f) << 3 | (m.retry_count & 7)));
  w.u16(48, m.pkey);
  w.u8(50, static_cast<uint8_t>((m.path_mtu & 0xf) << 4 | (m.rdc_exists ? 0x08 : 0) | (m.rnr_retry_count & 7)));
  w.u8(51, static_cast<uint8_t>((m.max_cm_retries & 0xf) << 4 | (m.srq ? 0x08 : 0) | (m.extended_transport_type & 7)));
  write_path(w, kReqPrimaryPath, m.primary);
  write_path(w, kReqAlternatePath, m.alternate);
  w.bytes(kReqPrivateAt, m.private_data);
}

Req read_req(const Reader& r) {
  Req m;
  m.local_comm_id = r.u32(0);
  m.vendor_id = r.u24(4);
  m.service_id = r.u64(8);
  m.local_ca_guid = r.u64(16);
  m.local_qkey = r.u32(28);
  m.local_qpn = r.u24(32);
  m.responder_resources = r.u8(35);
  m.local_eecn = r.u24(36);
  m.initiator_depth = r.u8(39);
  m.remote_eecn = r.u24(40);
  m.remote_cm_response_timeout = r.u8(43) >> 3;
  m.transport_service_type = (r.u8(43) >> 1) & 3;
  m.end_to_end_flow_control = (r.u8(43) & 1) != 0;
  m.starting_psn = r.u24(44);
  m.local_cm_response_timeout = r.u8(47) >> 3;
  m.retry_count = r.u8(47) & 7;
  m.pkey = r.u16(48);
  m.path_mtu = r.u8(50) >> 4;
  m.rdc_exists = (r.u8(50) & 0x08) != 0;
  m.rnr_retry_count = r.u8(50) & 7;
  m.max_cm_retries = r.u8(51) >> 4;
  m.srq = (r.u8(51) & 0x08) != 0;
  m.extended_transport_type = r.u8(51) & 7;
  m.primary = read_path(r, kReqPrimaryPath);
  m.alternate = read_path(r, kReqAlternatePath);
  r.bytes(kReqPrivateAt, m.private_data);
  return m;
}

void write_rep(Writer& w, const Rep& m) {
  w.u32(0, m.local_comm_id);
  w.u32(4, m.remote_comm_id);
  w.u32(8, m.local_qkey);
  w.u24(12, m.local_qpn);
  w.u24(16, m.local_eecn);
  w.u24(20, m.starting_psn);
  w.u8(24, m.responder_resources);
  w.u8(25, m.initiator_depth);
  w.u8(26, static_cast<uint8_t>((m.target_ack_delay & 0x1f) << 3 | (m.failover_accepted & 3) << 1 |
                                (m.end_to_end_flow_control ? 1 : 0)));
  w.u8(27, static_cast<uint8_t>((m.rnr_retry_count & 7) << 5 | (m.srq ? 0x10 : 0)));
  w.u64(28, m.local_ca_guid);
  w.bytes(36, m.private_data);
}

Rep read_rep(const Reader& r) {
  Rep m;
  m.local_comm_id = r.u32(0);
  m.remote_comm_id = r.u32(4);
  m.local_qkey = r.u32(8);
  m.local_qpn = r.u24(12);
  m.local_eecn = r.u24(16);
  m.starting_psn = r.u24(20);
  m.responder_resources = r.u8(24);
  m.initiator_depth = r.u8(25);
  m.target_ack_delay = r.u8(26) >> 3;
  m.failover_accepted = (r.u8(26) >> 1) & 3;
  m.end_to_end_flow_control = (r.u8(26) & 1) != 0;
  m.rnr_retry_count = r.u8(27) >> 5;
  m.srq = (r.u8(27) & 0x10) != 0;
  m.local_ca_guid = r.u64(28);
  r.bytes(36, m.private_data);
  return m;
}

// A message that refers to another by its 2-bit code: REJ, MRA.
std::optional<MessageRejected> message_code(uint8_t byte) {
  const uint8_t code = byte >> 6;
  if (code > 2) return std::nullopt;
  return static_cast<MessageRejected>(code);
}

}  // namespace

std::array<uint8_t, kMadBytes> build_dreq(uint64_t transaction_id, uint32_t local_comm_id, uint32_t remote_comm_id,
                                          uint32_t remote_qpn) {
  Mad out;
  out.transaction_id = transaction_id;
  out.attribute = Attribute::Dreq;
  out.dreq.local_comm_id = local_comm_id;
  out.dreq.remote_comm_id = remote_comm_id;
  out.dreq.remote_qpn = remote_qpn;
  return build_cm_mad(out);
}

std::array<uint8_t, kMadBytes> build_cm_mad(const Mad& mad) {
  std::array<uint8_t, kMadBytes> out{};
  Writer h(out);
  h.u8(0, 1);  // base version
  h.u8(1, kCmClass);
  h.u8(2, kCmClassVersion);
  h.u8(3, kMethodSend);
  h.u64(8, mad.transaction_id);
  h.u16(16, static_cast<uint16_t>(mad.attribute));
  Writer w(std::span<uint8_t>(out).subspan(kMadHeaderBytes));
  switch (mad.attribute) {
    case Attribute::Req:
      write_req(w, mad.req);
      break;
    case Attribute::Mra:
      w.u32(0, mad.mra.local_comm_id);
      w.u32(4, mad.mra.remote_comm_id);
      w.u8(8, static_cast<uint8_t>(static_cast<uint8_t>(mad.mra.message) << 6));
      w.u8(9, static_cast<uint8_t>((mad.mra.service_timeout & 0x1f) << 3));
      w.bytes(10, mad.mra.private_data);
      break;
    case Attribute::Rej:
      w.u32(0, mad.rej.local_comm_id);
      w.u32(4, mad.rej.remote_comm_id);
      w.u8(8, static_cast<uint8_t>(static_cast<uint8_t>(mad.rej.message) << 6));
      w.u8(9, static_cast<uint8_t>((mad.rej.reject_info_length & 0x7f) << 1));
      w.u16(10, mad.rej.reason);
      w.bytes(12, mad.rej.ari);
      w.bytes(84, mad.rej.private_data);
      break;
    case Attribute::Rep:
      write_rep(w, mad.rep);
      break;
    case Attribute::Rtu:
      w.u32(0, mad.rtu.local_comm_id);
      w.u32(4, mad.rtu.remote_comm_id);
      w.bytes(8, mad.rtu.private_data);
      break;
    case Attribute::Dreq:
      w.u32(0, mad.dreq.local_comm_id);
      w.u32(4, mad.dreq.remote_comm_id);
      w.u24(8, mad.dreq.remote_qpn);
      w.bytes(12, mad.dreq.private_data);
      break;
    case Attribute::Drep:
      w.u32(0, mad.drep.local_comm_id);
      w.u32(4, mad.drep.remote_comm_id);
      w.bytes(8, mad.drep.private_data);
      break;
    case Attribute::SidrReq:
      w.u32(0, mad.sidr_req.request_id);
      w.u16(4, mad.sidr_req.pkey);
      w.u64(8, mad.sidr_req.service_id);
      w.bytes(16, mad.sidr_req.private_data);
      break;
    case Attribute::SidrRep:
      w.u32(0, mad.sidr_rep.request_id);
      w.u8(4, mad.sidr_rep.status);
      w.u8(5, mad.sidr_rep.additional_info_length);
      w.u24(8, mad.sidr_rep.qpn);
      w.u64(12, mad.sidr_rep.service_id);
      w.u32(20, mad.sidr_rep.qkey);
      w.bytes(24, mad.sidr_rep.class_port_info);
      w.bytes(96, mad.sidr_rep.private_data);
      break;
    case Attribute::Lap:
    case Attribute::Apr:
      break;  // never sent: path migration is refused
  }
  return out;
}

namespace {
bool is_cm_send(std::span<const uint8_t> bytes) {
  return bytes.size() == kMadBytes && bytes[0] == 1 && bytes[1] == kCmClass && bytes[2] == kCmClassVersion &&
         bytes[3] == kMethodSend;
}
}  // namespace

std::optional<Mad> parse_cm_mad(std::span<const uint8_t> bytes) {
  if (!is_cm_send(bytes)) return std::nullopt;
  Reader h(bytes);
  Mad mad;
  mad.transaction_id = h.u64(8);
  const Reader r(bytes.subspan(kMadHeaderBytes));
  switch (h.u16(16)) {
    case static_cast<uint16_t>(Attribute::Req):
      mad.attribute = Attribute::Req;
      mad.req = read_req(r);
      return mad;
    case static_cast<uint16_t>(Attribute::Mra): {
      mad.attribute = Attribute::Mra;
      auto message = message_code(r.u8(8));
      if (!message) return std::nullopt;
      mad.mra.local_comm_id = r.u32(0);
      mad.mra.remote_comm_id = r.u32(4);
      mad.mra.message = *message;
      mad.mra.service_timeout = r.u8(9) >> 3;
      r.bytes(10, mad.mra.private_data);
      return mad;
    }
    case static_cast<uint16_t>(Attribute::Rej): {
      mad.attribute = Attribute::Rej;
      auto message = message_code(r.u8(8));
      if (!message) return std::nullopt;
      mad.rej.local_comm_id = r.u32(0);
      mad.rej.remote_comm_id = r.u32(4);
      mad.rej.message = *message;
      mad.rej.reject_info_length = r.u8(9) >> 1;
      if (mad.rej.reject_info_length > kRejAriBytes) return std::nullopt;
      mad.rej.reason = r.u16(10);
      r.bytes(12, mad.rej.ari);
      r.bytes(84, mad.rej.private_data);
      return mad;
    }
    case static_cast<uint16_t>(Attribute::Rep):
      mad.attribute = Attribute::Rep;
      mad.rep = read_rep(r);
      return mad;
    case static_cast<uint16_t>(Attribute::Rtu):
      mad.attribute = Attribute::Rtu;
      mad.rtu.local_comm_id = r.u32(0);
      mad.rtu.remote_comm_id = r.u32(4);
      r.bytes(8, mad.rtu.private_data);
      return mad;
    case static_cast<uint16_t>(Attribute::Dreq):
      mad.attribute = Attribute::Dreq;
      mad.dreq.local_comm_id = r.u32(0);
      mad.dreq.remote_comm_id = r.u32(4);
      mad.dreq.remote_qpn = r.u24(8);
      r.bytes(12, mad.dreq.private_data);
      return mad;
    case static_cast<uint16_t>(Attribute::Drep):
      mad.attribute = Attribute::Drep;
      mad.drep.local_comm_id = r.u32(0);
      mad.drep.remote_comm_id = r.u32(4);
      r.bytes(8, mad.drep.private_data);
      return mad;
    case static_cast<uint16_t>(Attribute::SidrReq):
      mad.attribute = Attribute::SidrReq;
      mad.sidr_req.request_id = r.u32(0);
      mad.sidr_req.pkey = r.u16(4);
      mad.sidr_req.service_id = r.u64(8);
      r.bytes(16, mad.sidr_req.private_data);
      return mad;
    case static_cast<uint16_t>(Attribute::SidrRep):
      mad.attribute = Attribute::SidrRep;
      mad.sidr_rep.request_id = r.u32(0);
      mad.sidr_rep.status = r.u8(4);
      mad.sidr_rep.additional_info_length = r.u8(5);
      if (mad.sidr_rep.additional_info_length > mad.sidr_rep.class_port_info.size()) return std::nullopt;
      mad.sidr_rep.qpn = r.u24(8);
      mad.sidr_rep.service_id = r.u64(12);
      mad.sidr_rep.qkey = r.u32(20);
      r.bytes(24, mad.sidr_rep.class_port_info);
      r.bytes(96, mad.sidr_rep.private_data);
      return mad;
    default:
      return std::nullopt;  // LAP, APR and what is not CM
  }
}

std::optional<CmRoute> cm_route(std::span<const uint8_t> bytes) {
  if (!is_cm_send(bytes)) return std::nullopt;
  const Reader h(bytes);
  const Reader r(bytes.subspan(kMadHeaderBytes));
  CmRoute route;
  route.attribute = static_cast<Attribute>(h.u16(16));
  switch (route.attribute) {
    case Attribute::Req:
    case Attribute::SidrReq:
      route.service_id = r.u64(8);
      return route;
    case Attribute::SidrRep:
      route.receiver_id = r.u32(0);
      return route;
    case Attribute::Mra:
    case Attribute::Rej:
    case Attribute::Rep:
    case Attribute::Rtu:
    case Attribute::Dreq:
    case Attribute::Drep:
    case Attribute::Lap:
    case Attribute::Apr:
      route.receiver_id = r.u32(4);
      return route;
  }
  return std::nullopt;
}

void put_ip_header(const IpHeader& header, std::span<uint8_t> private_data) {
  if (private_data.size() < kIpHeaderBytes) return;
  std::fill_n(private_data.begin(), kIpHeaderBytes, uint8_t{0});
  private_data[0] = 0;  // rdma_cm's header version
  private_data[1] = static_cast<uint8_t>(header.ip_version << 4);
  private_data[2] = static_cast<uint8_t>(header.source_port >> 8);
  private_data[3] = static_cast<uint8_t>(header.source_port);
  // IPv4 sits in the last four bytes of each 16, the rest zero (not ::ffff:).
  const size_t skip = header.ip_version == 4 ? 12 : 0;
  std::copy(header.source.begin() + skip, header.source.end(), private_data.begin() + 4 + skip);
  std::copy(header.destination.begin() + skip, header.destination.end(), private_data.begin() + 20 + skip);
}

std::optional<IpHeader> get_ip_header(std::span<const uint8_t> private_data) {
  if (private_data.size() < kIpHeaderBytes || private_data[0] != 0) return std::nullopt;
  IpHeader header;
  header.ip_version = private_data[1] >> 4;
  if (header.ip_version != 4 && header.ip_version != 6) return std::nullopt;
  header.source_port = static_cast<uint16_t>(private_data[2] << 8 | private_data[3]);
  if (header.ip_version == 4) {
    header.source[10] = header.source[11] = 0xff;
    header.destination[10] = header.destination[11] = 0xff;
    std::copy_n(private_data.begin() + 16, 4, header.source.begin() + 12);
    std::copy_n(private_data.begin() + 32, 4, header.destination.begin() + 12);
  } else {
    std::copy_n(private_data.begin() + 4, 16, header.source.begin());
    std::copy_n(private_data.begin() + 20, 16, header.destination.begin());
  }
  return header;
}

}  // namespace softverbs::wire::cm
