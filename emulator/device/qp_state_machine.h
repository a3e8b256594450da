// The QP state machine as the IB spec (chapter 10.3 / 11.2.5) defines it for
// Modify QP: which transitions exist and, per QP type, which attributes each
// transition requires and which it allows. Validity is data: one table.
#pragma once

#include <cstdint>

namespace softverbs {

enum class QpState : uint8_t { Reset, Init, Rtr, Rts, Sqd, Sqe, Error };
enum class QpType : uint8_t { Rc, Uc, Ud };

// The XRC half an RC QP may play (IBV_QPT_XRC_SEND, IBV_QPT_XRC_RECV): an
// XRC_SEND QP sends an RC stream whose messages each name an XRC SRQ (the
// XRCETH); an XRC_RECV QP is that stream's responder, taking each message's
// receive from the SRQ it names.
enum class XrcRole : uint8_t { None, Send, Recv };

// Attribute mask bits. The values are the verbs ABI's (IBV_QP_*), which the
// provider checks with static_asserts, so masks cross the boundary unchanged.
namespace qp_attr {
inline constexpr uint32_t kState = 1u << 0;
inline constexpr uint32_t kCurrentState = 1u << 1;
inline constexpr uint32_t kEnableSqdAsyncNotify = 1u << 2;
inline constexpr uint32_t kAccessFlags = 1u << 3;
inline constexpr uint32_t kPkeyIndex = 1u << 4;
inline constexpr uint32_t kPort = 1u << 5;
inline constexpr uint32_t kQkey = 1u << 6;
inline constexpr uint32_t kAddressVector = 1u << 7;
inline constexpr uint32_t kPathMtu = 1u << 8;
inline constexpr uint32_t kTimeout = 1u << 9;
inline constexpr uint32_t kRetryCount = 1u << 10;
inline constexpr uint32_t kRnrRetry = 1u << 11;
inline constexpr uint32_t kRqPsn = 1u << 12;
inline constexpr uint32_t kMaxQpRdAtomic = 1u << 13;
inline constexpr uint32_t kAlternatePath = 1u << 14;
inline constexpr uint32_t kMinRnrTimer = 1u << 15;
inline constexpr uint32_t kSqPsn = 1u << 16;
inline constexpr uint32_t kMaxDestRdAtomic = 1u << 17;
inline constexpr uint32_t kPathMigrationState = 1u << 18;
inline constexpr uint32_t kCapabilities = 1u << 19;
inline constexpr uint32_t kDestQpn = 1u << 20;
}  // namespace qp_attr

enum class TransitionVerdict : uint8_t {
  Allowed,
  NoSuchTransition,          // e.g. RESET -> RTS
  MissingRequiredAttribute,  // a required bit is absent
  AttributeNotAllowed,       // a bit outside required|optional|STATE
  CurrentStateNotAllowed,    // IBV_QP_CUR_STATE given outside RTR/RTS/SQD/SQE
};

struct TransitionRule {
  bool valid = false;
  uint32_t required[3] = {};  // indexed by QpType
  uint32_t optional[3] = {};
};

const TransitionRule& transition_rule(QpState from, QpState to);

// Checks a Modify QP request: `mask` is the caller's attribute mask (with or
// without kState; `to` is the target state, `from` the QP's current one).
TransitionVerdict check_transition(QpState from, QpState to, QpType type, uint32_t mask);
// The same for an RC QP playing an XRC role, whose rules differ from RC's
// where a half of the QP is missing (IBA 11.2.4.2, the kernel's table):
// XRC_SEND has no responder attributes, XRC_RECV no requester ones.
TransitionVerdict check_transition(QpState from, QpState to, XrcRole role, uint32_t mask);
// The attributes of the half an XRC QP lacks, which the kernel's uverbs
// takes out of a Modify QP's mask before checking it: a program may pass
// them (perftest -c XRC does), and they are ignored.
uint32_t ignored_attributes(XrcRole role);

const char* qp_state_name(QpState state);

// Posting rules (IB spec 10.8.2): sends are accepted in RTS and, queued but not
// executed, in SQD; receives from INIT on. In ERR both are accepted and
// complete with a flush error.
bool can_post_send(QpState state);
bool can_post_recv(QpState state);

}  // namespace softverbs
