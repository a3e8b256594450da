#include "wire/roce_headers.h"

#include <cstring>

namespace softverbs::wire {

namespace {

using namespace header;

constexpr std::array<OpcodeInfo, 256> build_table() {
  std::array<OpcodeInfo, 256> table{};
  struct Entry {
    uint8_t operation;
    uint8_t headers;
    const char* name;
    OpKind kind;
    OpPosition position;
  };
  using enum OpKind;
  using enum OpPosition;
  // Per operation; UD takes SEND ONLY (with immediate) and adds a DETH.
  constexpr Entry kConnected[] = {
      {op::kSendFirst, kPayload, "SEND_FIRST", Send, First},
      {op::kSendMiddle, kPayload, "SEND_MIDDLE", Send, Middle},
      {op::kSendLast, kPayload, "SEND_LAST", Send, Last},
      {op::kSendLastImm, kImmDt | kPayload, "SEND_LAST_WITH_IMMEDIATE", Send, Last},
      {op::kSendOnly, kPayload, "SEND_ONLY", Send, Only},
      {op::kSendOnlyImm, kImmDt | kPayload, "SEND_ONLY_WITH_IMMEDIATE", Send, Only},
      {op::kWriteFirst, kReth | kPayload, "RDMA_WRITE_FIRST", Write, First},
      {op::kWriteMiddle, kPayload, "RDMA_WRITE_MIDDLE", Write, Middle},
      {op::kWriteLast, kPayload, "RDMA_WRITE_LAST", Write, Last},
      {op::kWriteLastImm, kImmDt | kPayload, "RDMA_WRITE_LAST_WITH_IMMEDIATE", Write, Last},
      {op::kWriteOnly, kReth | kPayload, "RDMA_WRITE_ONLY", Write, Only},
      {op::kWriteOnlyImm, kReth | kImmDt | kPayload, "RDMA_WRITE_ONLY_WITH_IMMEDIATE", Write, Only},
  };
  constexpr Entry kReliableOnly[] = {
      {op::kReadRequest, kReth, "RDMA_READ_REQUEST", ReadRequest, Only},
      {op::kReadResponseFirst, kAeth | kPayload, "RDMA_READ_RESPONSE_FIRST", ReadResponse, First},
      {op::kReadResponseMiddle, kPayload, "RDMA_READ_RESPONSE_MIDDLE", ReadResponse, Middle},
      {op::kReadResponseLast, kAeth | kPayload, "RDMA_READ_RESPONSE_LAST", ReadResponse, Last},
      {op::kReadResponseOnly, kAeth | kPayload, "RDMA_READ_RESPONSE_ONLY", ReadResponse, Only},
      {op::kAcknowledge, kAeth, "ACKNOWLEDGE", Acknowledge, Only},
      {op::kAtomicAcknowledge, kAeth | kAtomicAckEth, "ATOMIC_ACKNOWLEDGE", AtomicAcknowledge, Only},
      {op::kCompareSwap, kAtomicEth, "COMPARE_SWAP", Atomic, Only},
      {op::kFetchAdd, kAtomicEth, "FETCH_ADD", Atomic, Only},
      {op::kSendLastInvalidate, kIeth | kPayload, "SEND_LAST_WITH_INVALIDATE", Send, Last},
      {op::kSendOnlyInvalidate, kIeth | kPayload, "SEND_ONLY_WITH_INVALIDATE", Send, Only},
      {op::kAtomicWrite, kReth | kPayload, "ATOMIC_WRITE", AtomicWrite, Only},
  };
  for (const Entry& e : kConnected) {
    table[opcode(Service::Rc, e.operation)] = {true, e.headers, e.name, e.kind, e.position};
    // UC has sends and writes, not the reliable-only operations.
    table[opcode(Service::Uc, e.operation)] = {true, e.headers, e.name, e.kind, e.position};
  }
  for (const Entry& e : kReliableOnly)
    table[opcode(Service::Rc, e.operation)] = {true, e.headers, e.name, e.kind, e.position};
  // XRC has RC's operations; its requests add the XRCETH (IBA 9.2, table 38).
  for (unsigned operation = 0; operation < 0x20; ++operation) {
    OpcodeInfo xrc = table[opcode(Service::Rc, static_cast<uint8_t>(operation))];
    xrc.xrceth = xrc.valid && !xrc.response();
    table[opcode(Service::Xrc, static_cast<uint8_t>(operation))] = xrc;
  }
  table[opcode(Service::Ud, op::kSendOnly)] = {true, kDeth | kPayload, "SEND_ONLY", Send, Only};
  table[opcode(Service::Ud, op::kSendOnlyImm)] = {true, kDeth | kImmDt | kPayload, "SEND_ONLY_WITH_IMMEDIATE", Send,
                                                  Only};
  return table;
}

constexpr std::array<OpcodeInfo, 256> kOpcodes = build_table();

class Writer {
 public:
  explicit Writer(std::span<uint8_t> out) : out_(out) {}
  void u8(uint8_t v) { out_[at_++] = v; }
  void u16(uint16_t v) {
    u8(static_cast<uint8_t>(v >> 8));
    u8(static_cast<uint8_t>(v));
  }
  void u24(uint32_t v) {
    u8(static_cast<uint8_t>(v >> 16));
    u16(static_cast<uint16_t>(v));
  }
  void u32(uint32_t v) {
    u16(static_cast<uint16_t>(v >> 16));
    u16(static_cast<uint16_t>(v));
  }
  void u64(uint64_t v) {
    u32(static_cast<uint32_t>(v >> 32));
    u32(static_cast<uint32_t>(v));
  }
  size_t length() const { return at_; }

 private:
  std::span<uint8_t> out_;
  size_t at_ = 0;
};

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> data) : data_(data) {}
  bool has(size_t n) const { return data_.size() - at_ >= n; }
  uint8_t u8() { return data_[at_++]; }
  uint16_t u16() { return static_cast<uint16_t>(u8() << 8 | u8()); }
  uint32_t u24() {
    uint32_t v = u8();
    v = v << 8 | u8();
    return v << 8 | u8();
  }
  uint32_t u32() { return static_cast<uint32_t>(u16()) << 16 | u16(); }
  uint64_t u64() { return static_cast<uint64_t>(u32()) << 32 | u32(); }
  std::span<const uint8_t> rest() const { return data_.subspan(at_); }

 private:
  std::span<const uint8_t> data_;
  size_t at_ = 0;
};

}  // namespace

const OpcodeInfo& opcode_info(uint8_t opcode) { return kOpcodes[opcode]; }

namespace {

// The operation (low five bits) of each (kind, position, immediate) among
// RC's opcodes, 0xff where none; built once from the table, so that the
// requester's per-packet choice is one lookup. The invalidate forms are
// chosen by no work request the device takes; the two atomics share a
// kind, and the work request says which; ATOMIC WRITE is the work
// request's own.
constexpr auto kOperations = [] {
  std::array<std::array<std::array<uint8_t, 2>, 4>, 7> operations{};
  for (auto& by_position : operations)
    for (auto& by_immediate : by_position) by_immediate = {0xff, 0xff};
  for (unsigned operation = 0; operation < 0x20; ++operation) {
    const OpcodeInfo& info = kOpcodes[operation];
    if (!info.valid || (info.headers & kIeth) || info.kind == OpKind::Atomic || info.kind == OpKind::AtomicWrite)
      continue;
    operations[static_cast<size_t>(info.kind)][static_cast<size_t>(info.position)][info.immediate()] =
        static_cast<uint8_t>(operation);
  }
  return operations;
}();

}  // namespace

uint8_t opcode_for(Service service, OpKind kind, OpPosition position, bool immediate) {
  if (static_cast<size_t>(kind) >= kOperations.size()) return 0xff;  // kinds the work request names
  const uint8_t operation = kOperations[static_cast<size_t>(kind)][static_cast<size_t>(position)][immediate];
  if (operation == 0xff || !kOpcodes[opcode(service, operation)].valid) return 0xff;
  return opcode(service, operation);
}

size_t header_bytes(const OpcodeInfo& info) {
  return kBthBytes + (info.xrceth ? 4 : 0) + ((info.headers & kDeth) ? 8 : 0) + ((info.headers & kReth) ? 16 : 0) +
         ((info.headers & kAtomicEth) ? 28 : 0) + ((info.headers & kAeth) ? 4 : 0) +
         ((info.headers & kAtomicAckEth) ? 8 : 0) + ((info.headers & kImmDt) ? 4 : 0) +
         ((info.headers & kIeth) ? 4 : 0);
}

size_t build_headers(const TransportPacket& packet, size_t payload_length, std::span<uint8_t, kMaxHeaderBytes> out) {
  const OpcodeInfo& info = opcode_info(packet.bth.opcode);
  if (!info.valid || (!(info.headers & kPayload) && payload_length != 0)) return 0;
  const Bth& bth = packet.bth;
  Writer w(out);
  w.u8(bth.opcode);
  w.u8(static_cast<uint8_t>((bth.solicited << 7) | (bth.migration << 6) | (pad_bytes(payload_length) << 4) |
                            (bth.transport_version & 0xf)));
  w.u16(bth.pkey);
  w.u8(static_cast<uint8_t>((bth.fecn << 7) | (bth.becn << 6)));
  w.u24(bth.dest_qp & 0xffffff);
  w.u8(static_cast<uint8_t>(bth.ack_request << 7));
  w.u24(bth.psn & 0xffffff);
  // Extension headers in the order IBA 9.2 gives them.
  if (info.xrceth) {
    w.u8(0);
    w.u24(packet.xrc_srqn & 0xffffff);
  }
  if (info.headers & kDeth) {
    w.u32(packet.deth.qkey);
    w.u8(0);
    w.u24(packet.deth.source_qp & 0xffffff);
  }
  if (info.headers & kReth) {
    w.u64(packet.reth.virtual_address);
    w.u32(packet.reth.rkey);
    w.u32(packet.reth.dma_length);
  }
  if (info.headers & kAtomicEth) {
    w.u64(packet.atomic.virtual_address);
    w.u32(packet.atomic.rkey);
    w.u64(packet.atomic.swap_add);
    w.u64(packet.atomic.compare);
  }
  if (info.headers & kAeth) {
    w.u8(packet.aeth.syndrome);
    w.u24(packet.aeth.msn & 0xffffff);
  }
  if (info.headers & kAtomicAckEth) w.u64(packet.atomic_ack_original);
  if (info.headers & kImmDt) w.u32(packet.immediate);
  if (info.headers & kIeth) w.u32(packet.invalidate_rkey);
  return w.length();
}

std::vector<uint8_t> build(const TransportPacket& packet) {
  std::array<uint8_t, kMaxHeaderBytes> headers;
  size_t length = build_headers(packet, packet.payload.size(), headers);
  if (length == 0) return {};
  std::vector<uint8_t> out(headers.begin(), headers.begin() + static_cast<std::ptrdiff_t>(length));
  out.insert(out.end(), packet.payload.begin(), packet.payload.end());
  out.insert(out.end(), pad_bytes(packet.payload.size()), 0);
  return out;
}

std::optional<TransportPacket> parse(std::span<const uint8_t> transport) {
  Reader in(transport);
  if (!in.has(kBthBytes)) return std::nullopt;
  TransportPacket packet;
  Bth& bth = packet.bth;
  bth.opcode = in.u8();
  uint8_t flags = in.u8();
  bth.solicited = flags & 0x80;
  bth.migration = flags & 0x40;
  bth.pad = (flags >> 4) & 0x3;
  bth.transport_version = flags & 0xf;
  bth.pkey = in.u16();
  uint8_t congestion = in.u8();
  bth.fecn = congestion & 0x80;
  bth.becn = congestion & 0x40;
  bth.dest_qp = in.u24();
  bth.ack_request = in.u8() & 0x80;
  bth.psn = in.u24();
  const OpcodeInfo& info = opcode_info(bth.opcode);
  if (!info.valid || bth.transport_version != 0) return std::nullopt;
  const size_t extension = header_bytes(info) - kBthBytes;
  if (!in.has(extension)) return std::nullopt;
  if (info.xrceth) {
    in.u8();
    packet.xrc_srqn = in.u24();
  }
  if (info.headers & kDeth) {
    packet.deth.qkey = in.u32();
    in.u8();
    packet.deth.source_qp = in.u24();
  }
  if (info.headers & kReth) {
    packet.reth.virtual_address = in.u64();
    packet.reth.rkey = in.u32();
    packet.reth.dma_length = in.u32();
  }
  if (info.headers & kAtomicEth) {
    packet.atomic.virtual_address = in.u64();
    packet.atomic.rkey = in.u32();
    packet.atomic.swap_add = in.u64();
    packet.atomic.compare = in.u64();
  }
  if (info.headers & kAeth) {
    packet.aeth.syndrome = in.u8();
    packet.aeth.msn = in.u24();
  }
  if (info.headers & kAtomicAckEth) packet.atomic_ack_original = in.u64();
  if (info.headers & kImmDt) packet.immediate = in.u32();
  if (info.headers & kIeth) packet.invalidate_rkey = in.u32();
  std::span<const uint8_t> rest = in.rest();
  if (rest.size() % 4 != 0 || bth.pad > rest.size()) return std::nullopt;
  if (!(info.headers & kPayload) && !rest.empty()) return std::nullopt;
  packet.payload = rest.first(rest.size() - bth.pad);
  return packet;
}

}  // namespace softverbs::wire
