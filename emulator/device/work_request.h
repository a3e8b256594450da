// Work requests and queue entries as the emulator sees them, independent of
// libibverbs' structures (the provider translates).
#pragma once

#include <array>
#include <cstdint>
#include <span>

#include "device/completion_ring.h"

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
};

namespace send_flag {
inline constexpr uint32_t kFence = 1u << 0;
inline constexpr uint32_t kSignaled = 1u << 1;
inline constexpr uint32_t kSolicited = 1u << 2;
inline constexpr uint32_t kInline = 1u << 3;
}  // namespace send_flag

// The work completion opcode a send work request completes with.
inline WcOpcode completion_opcode(SendOpcode opcode) {
  switch (opcode) {
    case SendOpcode::RdmaWrite:
    case SendOpcode::RdmaWriteWithImm:
      return WcOpcode::RdmaWrite;
    case SendOpcode::RdmaRead:
      return WcOpcode::RdmaRead;
    case SendOpcode::AtomicCompareSwap:
      return WcOpcode::CompareSwap;
    case SendOpcode::AtomicFetchAdd:
      return WcOpcode::FetchAdd;
    case SendOpcode::Send:
    case SendOpcode::SendWithImm:
      break;
  }
  return WcOpcode::Send;
}

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

// A send work request as the provider hands it to the device.
struct SendRequest {
  uint64_t wr_id = 0;
  SendOpcode opcode = SendOpcode::Send;
  uint32_t flags = 0;
  uint32_t imm_data = 0;  // network byte order, as posted
  // With kInline the SGEs are plain (address, length) in this process: their
  // lkeys are not looked at, as an HCA copies inline data at post time.
  std::span<const Sge> sges;
  uint64_t remote_address = 0;
  uint32_t rkey = 0;
  uint64_t compare_add = 0;
  uint64_t swap = 0;
  // UD only
  uint32_t remote_qpn = 0;
  uint32_t remote_qkey = 0;
  bool has_grh = false;
  bool roce_v2 = true;  // the source GID's type: a RoCE v2 packet (UDP/IP) or a v1 one (a GRH)
  std::array<uint8_t, 16> source_gid{};
  std::array<uint8_t, 16> destination_gid{};
  uint8_t hop_limit = 0;
  uint8_t traffic_class = 0;
  uint32_t flow_label = 0;
};

}  // namespace softverbs
