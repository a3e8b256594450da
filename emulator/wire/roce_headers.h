// RoCEv2 transport headers as they travel in a UDP datagram (destination
// port 4791): the BTH and the extension headers each opcode carries (RETH,
// AETH, AtomicETH, AtomicAckETH, ImmDt, IETH, DETH, XRCETH), payload padding to 4
// bytes, and the ICRC trailer. Building and parsing live here and nowhere
// else; parse() accepts only what the opcode table allows.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace softverbs::wire {

inline constexpr uint16_t kRoceV2Port = 4791;
inline constexpr size_t kBthBytes = 12;
inline constexpr size_t kIcrcBytes = 4;

// Transport service in the opcode's top three bits.
enum class Service : uint8_t { Rc = 0x00, Uc = 0x20, Rd = 0x40, Ud = 0x60, Xrc = 0xa0 };

// Operations in the opcode's low five bits (IBA table 38).
namespace op {
inline constexpr uint8_t kSendFirst = 0x00;
inline constexpr uint8_t kSendMiddle = 0x01;
inline constexpr uint8_t kSendLast = 0x02;
inline constexpr uint8_t kSendLastImm = 0x03;
inline constexpr uint8_t kSendOnly = 0x04;
inline constexpr uint8_t kSendOnlyImm = 0x05;
inline constexpr uint8_t kWriteFirst = 0x06;
inline constexpr uint8_t kWriteMiddle = 0x07;
inline constexpr uint8_t kWriteLast = 0x08;
inline constexpr uint8_t kWriteLastImm = 0x09;
inline constexpr uint8_t kWriteOnly = 0x0a;
inline constexpr uint8_t kWriteOnlyImm = 0x0b;
inline constexpr uint8_t kReadRequest = 0x0c;
inline constexpr uint8_t kReadResponseFirst = 0x0d;
inline constexpr uint8_t kReadResponseMiddle = 0x0e;
inline constexpr uint8_t kReadResponseLast = 0x0f;
inline constexpr uint8_t kReadResponseOnly = 0x10;
inline constexpr uint8_t kAcknowledge = 0x11;
inline constexpr uint8_t kAtomicAcknowledge = 0x12;
inline constexpr uint8_t kCompareSwap = 0x13;
inline constexpr uint8_t kFetchAdd = 0x14;
inline constexpr uint8_t kSendLastInvalidate = 0x16;
inline constexpr uint8_t kSendOnlyInvalidate = 0x17;
// IBA 1.5's Memory Placement Extensions (RC only).
inline constexpr uint8_t kAtomicWrite = 0x1d;
}  // namespace op

inline constexpr uint8_t opcode(Service service, uint8_t operation) {
  return static_cast<uint8_t>(static_cast<uint8_t>(service) | operation);
}

// Which headers follow the BTH, per opcode.
namespace header {
inline constexpr uint8_t kReth = 1u << 0;
inline constexpr uint8_t kAeth = 1u << 1;
inline constexpr uint8_t kAtomicEth = 1u << 2;
inline constexpr uint8_t kAtomicAckEth = 1u << 3;
inline constexpr uint8_t kImmDt = 1u << 4;
inline constexpr uint8_t kIeth = 1u << 5;
inline constexpr uint8_t kDeth = 1u << 6;
inline constexpr uint8_t kPayload = 1u << 7;  // the opcode may carry data
}  // namespace header

// What a packet does (IBA 9.2, as rxe's opcode masks say it), and where it
// sits in its message.
enum class OpKind : uint8_t {
  Send,
  Write,
  ReadRequest,
  ReadResponse,
  Atomic,
  Acknowledge,
  AtomicAcknowledge,
  AtomicWrite,  // RETH and 8 bytes of payload, answered by a zero-length READ RESPONSE ONLY
};
enum class OpPosition : uint8_t { First, Middle, Last, Only };

struct OpcodeInfo {
  bool valid = false;
  uint8_t headers = 0;
  const char* name = "";
  OpKind kind = OpKind::Send;
  OpPosition position = OpPosition::Only;
  // XRC requests carry an XRCETH (the SRQ number) right after the BTH.
  bool xrceth = false;

  constexpr bool immediate() const { return (headers & header::kImmDt) != 0; }
  // Sent by a responder: READ responses and (atomic) acknowledgements.
  constexpr bool response() const {
    return kind == OpKind::ReadResponse || kind == OpKind::Acknowledge || kind == OpKind::AtomicAcknowledge;
  }
  constexpr bool starts_message() const { return position == OpPosition::First || position == OpPosition::Only; }
  constexpr bool ends_message() const { return position == OpPosition::Last || position == OpPosition::Only; }
  // A SEND's first packet, or the last of a WRITE with immediate, takes a
  // receive WQE.
  constexpr bool consumes_receive() const {
    return (kind == OpKind::Send && starts_message()) || (kind == OpKind::Write && immediate() && ends_message());
  }
};

// The opcode table; invalid entries for reserved and unsupported (RD) codes.
const OpcodeInfo& opcode_info(uint8_t opcode);

// The opcode of `service` for a packet of `kind` at `position` (with an
// immediate or not); 0xff where there is none (SEND and WRITE have all four
// positions, the others one) and for atomics and ATOMIC WRITE, whose opcode
// the work request names.
uint8_t opcode_for(Service service, OpKind kind, OpPosition position, bool immediate);

// The BTH and the extension headers an opcode carries, in bytes.
size_t header_bytes(const OpcodeInfo& info);

struct Bth {
  uint8_t opcode = 0;
  bool solicited = false;
  bool migration = false;
  uint8_t pad = 0;  // filled in by build()
  uint8_t transport_version = 0;
  uint16_t pkey = 0xffff;
  bool fecn = false;
  bool becn = false;
  uint32_t dest_qp = 0;  // 24 bits
  bool ack_request = false;
  uint32_t psn = 0;  // 24 bits
};

struct Reth {
  uint64_t virtual_address = 0;
  uint32_t rkey = 0;
  uint32_t dma_length = 0;
};

struct Aeth {
  uint8_t syndrome = 0;
  uint32_t msn = 0;  // 24 bits
};

struct AtomicEth {
  uint64_t virtual_address = 0;
  uint32_t rkey = 0;
  uint64_t swap_add = 0;
  uint64_t compare = 0;
};

struct Deth {
  uint32_t qkey = 0;
  uint32_t source_qp = 0;  // 24 bits
};

struct TransportPacket {
  Bth bth;
  Reth reth;
  Aeth aeth;
  AtomicEth atomic;
  uint64_t atomic_ack_original = 0;
  uint32_t immediate = 0;  // as on the wire (network order bytes in a host integer read big-endian)
  uint32_t invalidate_rkey = 0;
  Deth deth;
  uint32_t xrc_srqn = 0;             // XRCETH, 24 bits
  std::span<const uint8_t> payload;  // parse(): points into the input
};

// The longest BTH + extension headers any opcode carries (XRC compare&swap:
// BTH + XRCETH + AtomicETH).
inline constexpr size_t kMaxHeaderBytes = kBthBytes + 4 + 28;

// Writes the BTH and the opcode's extension headers for a packet whose
// payload is `payload_length` bytes (the BTH's pad count follows from it);
// packet.payload is not looked at. Returns the header length, or 0 if the
// opcode is invalid or carries no payload but a length was given.
size_t build_headers(const TransportPacket& packet, size_t payload_length, std::span<uint8_t, kMaxHeaderBytes> out);

// Pad bytes after a payload of `payload_length` bytes.
inline constexpr size_t pad_bytes(size_t payload_length) { return (4 - payload_length % 4) % 4; }

// BTH, the opcode's extension headers, payload and pad bytes (no ICRC).
// Empty if the opcode is invalid or carries no payload but one was given.
std::vector<uint8_t> build(const TransportPacket& packet);

// Parses BTH..payload of a transport packet whose ICRC was already removed.
// nullopt for anything malformed: short, unknown opcode, pad larger than the
// payload, payload on an opcode that carries none, bad transport version.
std::optional<TransportPacket> parse(std::span<const uint8_t> transport);

}  // namespace softverbs::wire
