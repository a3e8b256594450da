#include "device/work_request.h"

#include <array>

namespace softverbs {

namespace {

using namespace wr_mask;

constexpr std::array<SendOpcodeInfo, 10> kSendOpcodes = {{
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
constexpr SendOpcodeInfo kAtomicWrite{"ATOMIC_WRITE", kRemoteRange, WcOpcode::AtomicWrite, true, false, false, true};

}  // namespace

const SendOpcodeInfo& send_opcode_info(uint32_t opcode) {
  static constexpr SendOpcodeInfo kUnknown{};
  if (opcode == static_cast<uint32_t>(SendOpcode::AtomicWrite)) return kAtomicWrite;
  return opcode < kSendOpcodes.size() ? kSendOpcodes[opcode] : kUnknown;
}

void SendWqe::reset() {
  std::vector<Sge> kept_sges = std::move(sges);
  std::vector<uint8_t> kept_bytes = std::move(inline_bytes);
  kept_sges.clear();
  kept_bytes.clear();
  *this = SendWqe{};
  sges = std::move(kept_sges);
  inline_bytes = std::move(kept_bytes);
}

void SendWqe::keep_inline() {
  if (!(flags & send_flag::kInline)) return;
  inline_bytes.clear();
  for (const Sge& sge : sges) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(sge.address);
    inline_bytes.insert(inline_bytes.end(), bytes, bytes + sge.length);
  }
  sges.assign(1, Sge{reinterpret_cast<uint64_t>(inline_bytes.data()), static_cast<uint32_t>(inline_bytes.size()), 0});
}

}  // namespace softverbs
