// Work requests and queue entries as the emulator sees them, independent of
// libibverbs' structures (the provider translates).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "device/completion_ring.h"
#include "device/memory_region_table.h"
#include "device/qp_state_machine.h"

namespace softverbs {

struct Sge {
  uint64_t address = 0;  // an iova in the lkey's region
  uint32_t length = 0;
  uint32_t lkey = 0;
};

// Send opcodes; values are the verbs ABI's (IBV_WR_*).
enum class SendOpcode : uint32_t {
  RdmaWrite = 0,
  RdmaWriteWithImm = 1,
  Send = 2,
  SendWithImm = 3,
  RdmaRead = 4,
  AtomicCompareSwap = 5,
  AtomicFetchAdd = 6,
  LocalInvalidate = 7,
  BindMemoryWindow = 8,
  SendWithInvalidate = 9,
  AtomicWrite = 15,  // IBA 1.5's Memory Placement Extensions
};

namespace send_flag {
inline constexpr uint32_t kFence = 1u << 0;
inline constexpr uint32_t kSignaled = 1u << 1;
inline constexpr uint32_t kSolicited = 1u << 2;
inline constexpr uint32_t kInline = 1u << 3;
}  // namespace send_flag

// What each send opcode is, in one table (as rxe's rxe_wr_opcode_info): the
// QP types that may post it, what it completes as, and how it moves data.
namespace wr_mask {
inline constexpr uint16_t kSend = 1u << 0;
inline constexpr uint16_t kWrite = 1u << 1;
inline constexpr uint16_t kRead = 1u << 2;
inline constexpr uint16_t kAtomic = 1u << 3;
inline constexpr uint16_t kImmediate = 1u << 4;  // carries imm_data
// Names a remote range (RETH or AtomicETH): remote_address and rkey.
inline constexpr uint16_t kRemoteRange = 1u << 5;
// Its data comes back into the local SGEs (READ, atomics): they need
// local write access and cannot be inline.
inline constexpr uint16_t kIntoLocal = 1u << 6;
// Executed by the device itself, no packet (BIND_MW, LOCAL_INV).
inline constexpr uint16_t kLocal = 1u << 7;
// Carries an rkey the responder invalidates (an IETH).
inline constexpr uint16_t kInvalidate = 1u << 8;
}  // namespace wr_mask

struct SendOpcodeInfo {
  const char* name = nullptr;  // nullptr: not an opcode the device takes
  uint16_t mask = 0;
  WcOpcode completion = WcOpcode::Send;
  bool rc = false, uc = false, ud = false;  // the QP types that may post it
  // ATOMIC WRITE: one request packet that a responder answers with a
  // zero-length RDMA READ RESPONSE ONLY (as it does a FLUSH).
  bool answered_by_empty_read_response = false;

  bool valid_for(QpType type) const {
    return name != nullptr && (type == QpType::Rc ? rc : type == QpType::Uc ? uc : ud);
  }
  bool is(uint16_t bits) const { return (mask & bits) != 0; }
  // READs, atomics and ATOMIC WRITE: the requester waits for response packets.
  bool expects_response() const { return is(wr_mask::kRead | wr_mask::kAtomic) || answered_by_empty_read_response; }
};

// In the header, so that the UDP requester's dozen lookups per packet
// compile to loads.
namespace send_opcode_table {

using namespace wr_mask;

inline constexpr std::array<SendOpcodeInfo, 10> kSendOpcodes = {{
    // name, mask, completes as, RC, UC, UD
    {"RDMA_WRITE", kWrite | kRemoteRange, WcOpcode::RdmaWrite, true, true, false},
    {"RDMA_WRITE_WITH_IMM", kWrite | kRemoteRange | kImmediate, WcOpcode::RdmaWrite, true, true, false},
    {"SEND", kSend, WcOpcode::Send, true, true, true},
    {"SEND_WITH_IMM", kSend | kImmediate, WcOpcode::Send, true, true, true},
    {"RDMA_READ", kRead | kRemoteRange | kIntoLocal, WcOpcode::RdmaRead, true, false, false},
    {"ATOMIC_CMP_AND_SWP", kAtomic | kRemoteRange | kIntoLocal, WcOpcode::CompareSwap, true, false, false},
    {"ATOMIC_FETCH_AND_ADD", kAtomic | kRemoteRange | kIntoLocal, WcOpcode::FetchAdd, true, false, false},
    {"LOCAL_INV", kLocal, WcOpcode::LocalInvalidate, true, true, false},
    {"BIND_MW", kLocal, WcOpcode::BindMw, true, true, false},
    // The wire has SEND with invalidate for RC only (IBA table 38).
    {"SEND_WITH_INV", kSend | kInvalidate, WcOpcode::Send, true, false, false},
}};
static_assert(kSendOpcodes[static_cast<size_t>(SendOpcode::RdmaRead)].completion == WcOpcode::RdmaRead &&
                  kSendOpcodes[static_cast<size_t>(SendOpcode::AtomicFetchAdd)].completion == WcOpcode::FetchAdd &&
                  kSendOpcodes[static_cast<size_t>(SendOpcode::BindMemoryWindow)].completion == WcOpcode::BindMw,
              "indexed by the IBV_WR_* value");

// ATOMIC WRITE (IBA 1.5, Memory Placement Extensions): 8 bytes from the
// local SGEs (or inline) placed at an 8-byte aligned remote address in one
// store; it needs remote write access, as in rxe.
inline constexpr SendOpcodeInfo kAtomicWrite{"ATOMIC_WRITE", kRemoteRange, WcOpcode::AtomicWrite, true, false,
                                             false,          true};

inline constexpr SendOpcodeInfo kUnknown{};

}  // namespace send_opcode_table

// The entry for `opcode` (an IBV_WR_* value); an empty one (name nullptr)
// for a value the device does not take.
inline const SendOpcodeInfo& send_opcode_info(uint32_t opcode) {
  using namespace send_opcode_table;
  if (opcode == static_cast<uint32_t>(SendOpcode::AtomicWrite)) return kAtomicWrite;
  return opcode < kSendOpcodes.size() ? kSendOpcodes[opcode] : kUnknown;
}
inline const SendOpcodeInfo& send_opcode_info(SendOpcode opcode) {
  return send_opcode_info(static_cast<uint32_t>(opcode));
}

// The work completion opcode a send work request completes with.
inline WcOpcode completion_opcode(SendOpcode opcode) { return send_opcode_info(opcode).completion; }

// What a RoCE HCA reports in a UD receive's wc.sl: not a service level but
// the packet's network header type, as mlx5 does and UCX reads it: bit 3
// set for a RoCE v2 (UDP) packet, and in bits 0-2 its L3 header: 0 a GRH
// (RoCE v1), 1 IPv6, 2 IPv4.
inline uint8_t roce_packet_type(bool roce_v2, bool ipv4) {
  if (!roce_v2) return 0x0;
  return ipv4 ? 0xa : 0x9;
}

// A receive queue entry, stored in shared memory with its SGEs after it.
struct RecvWqe {
  uint64_t wr_id = 0;
  uint32_t num_sge = 0;
  // Its position in the queue plus one (modulo 2^32), stored last, with
  // release order: a taker reads the entry only once it carries the
  // position the taker expects, so the poster needs no lock that takers
  // take (see RecvQueue).
  uint32_t sequence = 0;
  // Sge sges[max_sge] follow.
};

// Where a UDP transport's packets for a QP or a UD datagram go: a peer
// address (UDP port 4791) and the local address they leave from.
struct NetworkPath {
  std::array<uint8_t, 16> local{};  // IPv6, or IPv4-mapped
  std::array<uint8_t, 16> remote{};
  uint32_t scope_id = 0;  // IPv6 link-local peers: the netdev's ifindex
  uint8_t traffic_class = 0;
  uint8_t hop_limit = 64;
  uint32_t flow_label = 0;
};

// A send work request as the device holds it from post to completion, on
// either transport (as rxe's rxe_send_wqe): what was posted, and each
// transport's progress on it.
struct SendWqe {
  uint64_t wr_id = 0;
  SendOpcode opcode = SendOpcode::Send;
  uint32_t flags = 0;
  bool signaled = false;  // kSignaled, or the QP signals every send
  uint32_t imm_data = 0;  // network byte order, as posted
  // lkey SGEs. With kInline they are plain (address, length) in the poster's
  // memory, read at post time as an HCA does, until keep_inline() copies
  // the bytes into inline_bytes and leaves one SGE over them (which a move
  // keeps valid, a copy does not). The UDP requester sends an inline WQE's
  // inline_bytes and has no SGEs.
  std::vector<Sge> sges;
  std::vector<uint8_t> inline_bytes;
  uint64_t length = 0;  // of all SGEs
  uint64_t remote_address = 0;
  uint32_t rkey = 0;
  uint64_t compare_add = 0;
  uint64_t swap = 0;
  uint32_t invalidate_rkey = 0;  // LOCAL_INV, SEND_WITH_INV
  WindowBind bind;               // BIND_MW
  // UD: the address handle's part.
  uint32_t remote_qpn = 0;
  uint32_t remote_qkey = 0;
  // XRC_SEND: the XRC SRQ at the peer that the message is for (its XRCETH).
  uint32_t remote_srqn = 0;
  bool has_grh = false;
  uint8_t sgid_index = 0;
  bool roce_v2 = true;  // the source GID's type: a RoCE v2 packet (UDP/IP) or a v1 one (a GRH)
  std::array<uint8_t, 16> source_gid{};
  std::array<uint8_t, 16> destination_gid{};
  uint8_t hop_limit = 0;
  uint8_t traffic_class = 0;
  uint32_t flow_label = 0;
  NetworkPath ud_path;  // over UDP, resolved at post

  // An error found while executing (a length, an unroutable address): it
  // completes in order, as an HCA reports it.
  WcStatus error = WcStatus::Success;

  // Shared memory: waiting for a receive (RNR) or for the peer. The RNR
  // budget starts at the first RNR, as the timeout's (give_up) at the first
  // attempt that finds no responder: nullopt before; -1: infinite.
  std::optional<int> rnr_retries_left;
  std::chrono::steady_clock::time_point next_attempt{};
  std::chrono::steady_clock::time_point give_up{std::chrono::steady_clock::time_point::max()};

  // UDP: the requester's and completer's progress.
  bool assigned = false;  // first_psn is valid
  uint32_t first_psn = 0;
  uint32_t psn_count = 0;        // PSNs the WQE uses (a READ: one per response packet)
  uint32_t packets_sent = 0;     // SEND/WRITE: next packet to send; READ/atomic: request sent (0/1)
  uint32_t read_next_psn = 0;    // READ: PSN of the next response expected
  uint64_t read_done = 0;        // READ: bytes placed
  bool finished = false;         // READ/atomic: the response is in
  bool holds_rd_atomic = false;  // counted in the requester's rd_atomic_in_flight

  uint32_t last_psn() const { return (first_psn + psn_count - 1) & 0xffffff; }
  bool is_read() const { return send_opcode_info(opcode).is(wr_mask::kRead); }
  bool is_atomic() const { return send_opcode_info(opcode).is(wr_mask::kAtomic); }
  bool is_atomic_write() const { return opcode == SendOpcode::AtomicWrite; }
  bool expects_response() const { return send_opcode_info(opcode).expects_response(); }
  bool fully_sent() const { return expects_response() ? packets_sent >= 1 : packets_sent >= psn_count; }

  // Back to a blank request, keeping the vectors' buffers (a per-QP scratch
  // WQE makes no heap allocation from post to post).
  void reset();
  // Copies an inline send's bytes out of the poster's memory, for a WQE that
  // outlives its post.
  void keep_inline();
};

}  // namespace softverbs
