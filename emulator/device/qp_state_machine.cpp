#include "device/qp_state_machine.h"

#include <array>
#include <cstddef>

namespace softverbs {

namespace {

using namespace qp_attr;

constexpr size_t kStates = 7;
constexpr size_t index(QpState state) { return static_cast<size_t>(state); }
constexpr size_t index(QpType type) { return static_cast<size_t>(type); }

// One rule per (from, to). Rows not filled in are invalid transitions.
constexpr TransitionRule rule(std::array<uint32_t, 3> required, std::array<uint32_t, 3> optional) {
  TransitionRule r;
  r.valid = true;
  for (size_t i = 0; i < 3; ++i) {
    r.required[i] = required[i];
    r.optional[i] = optional[i];
  }
  return r;
}

constexpr TransitionRule kAlways = rule({0, 0, 0}, {0, 0, 0});

// Optional attributes of RTR->RTS, RTS->RTS and SQD->RTS, indexed RC, UC, UD.
constexpr uint32_t kRtsOptional[3] = {
    kCurrentState | kAccessFlags | kAlternatePath | kPathMigrationState | kMinRnrTimer,
    kCurrentState | kAccessFlags | kAlternatePath | kPathMigrationState, kCurrentState | kQkey};

using Table = std::array<std::array<TransitionRule, kStates>, kStates>;

constexpr Table build_table() {
  Table table{};
  // Every state may go to RESET or ERR (spec 11.2.5.2; ERR from any state).
  for (size_t from = 0; from < kStates; ++from) {
    table[from][index(QpState::Reset)] = kAlways;
    table[from][index(QpState::Error)] = kAlways;
  }
  table[index(QpState::Reset)][index(QpState::Init)] = rule(
      {kPkeyIndex | kPort | kAccessFlags, kPkeyIndex | kPort | kAccessFlags, kPkeyIndex | kPort | kQkey}, {0, 0, 0});
  table[index(QpState::Init)][index(QpState::Init)] = rule(
      {0, 0, 0}, {kPkeyIndex | kPort | kAccessFlags, kPkeyIndex | kPort | kAccessFlags, kPkeyIndex | kPort | kQkey});
  table[index(QpState::Init)][index(QpState::Rtr)] = rule(
      {kAddressVector | kPathMtu | kDestQpn | kRqPsn | kMaxDestRdAtomic | kMinRnrTimer,
       kAddressVector | kPathMtu | kDestQpn | kRqPsn, 0},
      {kAlternatePath | kAccessFlags | kPkeyIndex, kAlternatePath | kAccessFlags | kPkeyIndex, kPkeyIndex | kQkey});
  table[index(QpState::Rtr)][index(QpState::Rts)] =
      rule({kTimeout | kRetryCount | kRnrRetry | kSqPsn | kMaxQpRdAtomic, kSqPsn, kSqPsn},
           {kRtsOptional[0], kRtsOptional[1], kRtsOptional[2]});
  table[index(QpState::Rts)][index(QpState::Rts)] =
      rule({0, 0, 0}, {kRtsOptional[0], kRtsOptional[1], kRtsOptional[2]});
  table[index(QpState::Rts)][index(QpState::Sqd)] =
      rule({0, 0, 0}, {kEnableSqdAsyncNotify, kEnableSqdAsyncNotify, kEnableSqdAsyncNotify});
  table[index(QpState::Sqd)][index(QpState::Rts)] =
      rule({0, 0, 0}, {kRtsOptional[0], kRtsOptional[1], kRtsOptional[2]});
  table[index(QpState::Sqd)][index(QpState::Sqd)] =
      rule({0, 0, 0},
           {kPort | kAddressVector | kTimeout | kRetryCount | kRnrRetry | kMaxQpRdAtomic | kMaxDestRdAtomic |
                kAlternatePath | kAccessFlags | kPkeyIndex | kMinRnrTimer | kPathMigrationState,
            kAddressVector | kAlternatePath | kAccessFlags | kPkeyIndex | kPathMigrationState, kPkeyIndex | kQkey});
  // SQE exists only for unreliable types (an RC send error takes the QP to ERR).
  table[index(QpState::Sqe)][index(QpState::Rts)] =
      rule({0, 0, 0}, {0, kCurrentState | kAccessFlags, kCurrentState | kQkey});
  return table;
}

constexpr Table kTable = build_table();

}  // namespace

const TransitionRule& transition_rule(QpState from, QpState to) { return kTable[index(from)][index(to)]; }

namespace {

TransitionVerdict check_masks(uint32_t mask, uint32_t required, uint32_t optional) {
  if ((mask & required) != required) return TransitionVerdict::MissingRequiredAttribute;
  if (mask & ~(required | optional | kState)) return TransitionVerdict::AttributeNotAllowed;
  return TransitionVerdict::Allowed;
}

bool current_state_allowed(QpState from, uint32_t mask) {
  return !(mask & kCurrentState) || from == QpState::Rtr || from == QpState::Rts || from == QpState::Sqd ||
         from == QpState::Sqe;
}

}  // namespace

TransitionVerdict check_transition(QpState from, QpState to, QpType type, uint32_t mask) {
  if (!current_state_allowed(from, mask)) return TransitionVerdict::CurrentStateNotAllowed;
  const TransitionRule& r = transition_rule(from, to);
  if (!r.valid) return TransitionVerdict::NoSuchTransition;
  return check_masks(mask, r.required[index(type)], r.optional[index(type)]);
}

TransitionVerdict check_transition(QpState from, QpState to, XrcRole role, uint32_t mask) {
  if (role == XrcRole::None) return check_transition(from, to, QpType::Rc, mask);
  if (!current_state_allowed(from, mask)) return TransitionVerdict::CurrentStateNotAllowed;
  const TransitionRule& r = transition_rule(from, to);
  if (!r.valid) return TransitionVerdict::NoSuchTransition;
  uint32_t required = r.required[index(QpType::Rc)];
  uint32_t optional = r.optional[index(QpType::Rc)];
  if (role == XrcRole::Send) {
    // No responder: nothing about incoming RDMA READs or RNR NAKs to send.
    required &= ~(kMaxDestRdAtomic | kMinRnrTimer);
    optional &= ~(kMaxDestRdAtomic | kMinRnrTimer);
  } else {
    // No requester: no retries, no outgoing READs or atomics.
    if (from == QpState::Rtr && to == QpState::Rts) required = kTimeout | kSqPsn;
    optional &= ~(kRetryCount | kRnrRetry | kMaxQpRdAtomic);
  }
  return check_masks(mask, required, optional);
}

uint32_t ignored_attributes(XrcRole role) {
  switch (role) {
    case XrcRole::Send:
      return kMaxDestRdAtomic | kMinRnrTimer;
    case XrcRole::Recv:
      return kMaxQpRdAtomic | kRetryCount | kRnrRetry;
    case XrcRole::None:
      break;
  }
  return 0;
}

const char* qp_state_name(QpState state) {
  constexpr const char* kNames[] = {"RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR"};
  return kNames[index(state)];
}

bool can_post_send(QpState state) {
  return state == QpState::Rts || state == QpState::Sqd || state == QpState::Sqe || state == QpState::Error;
}

bool can_post_recv(QpState state) { return state != QpState::Reset; }

}  // namespace softverbs
