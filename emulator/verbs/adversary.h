// Adversarial mode (`softverbs run --adversarial[=SEED]`, which sets
// SOFTVERBS_ADVERSARIAL=SEED): within what the IB spec allows, the device
// behaves as unkindly as real hardware can, so that a program that reads
// data before its completion or assumes an order the spec does not promise
// fails visibly. Every decision comes from a generator seeded by the seed
// and a stable per-process value, so that a failing seed can be replayed.
//
// Off (the variable unset), every hook is one predictable branch on
// `adversary::enabled()`.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "device/completion_ring.h"

namespace softverbs {

class DeviceMemory;

namespace adversary {

namespace detail {
extern const bool kEnabled;
}

inline bool enabled() { return detail::kEnabled; }

// Prints the run's seed on stderr, once per process, so that a failure
// can be replayed.
void announce();

// The seed this process derives its decisions from (the run's seed mixed
// with the process's command line and fork position).
uint64_t process_seed();

// Completion queues: a poll takes the CQ's ready completions into a small
// staging area of this process and returns some of them, perhaps none, in
// an order that keeps each work queue's completions in order but mixes the
// queues. A staged completion is released within a few polls, and an armed
// CQ that holds staged completions gets its event.
class CqPoller {
 public:
  virtual ~CqPoller() = default;
  // Pops up to out.size() completions from the CQ's ring.
  virtual size_t pop_ready(std::span<Completion> out) = 0;
};

// One ibv_poll_cq: what it returns.
size_t poll(DeviceMemory& memory, int cq_index, CqPoller& ring, std::span<Completion> out);
// ibv_start_poll: one more poll of the CQ, and its first completion.
bool start_poll(DeviceMemory& memory, int cq_index, CqPoller& ring, Completion& out);
// ibv_next_poll: the next completion this poll returns, if any.
bool next_poll(DeviceMemory& memory, int cq_index, Completion& out);
// After ibv_req_notify_cq: an event now if completions are staged (they
// arrive, as far as the application can tell, after the arming), and now
// and then a spurious one.
void armed(DeviceMemory& memory, int cq_index);
// The CQ is destroyed, or a QP whose completions are purged.
void forget_cq(DeviceMemory& memory, int cq_index);
void purge_qp(DeviceMemory& memory, int cq_index, uint32_t qpn);

// The first SEND to `target_qpn` (seen from this process) is answered
// with an RNR NAK; the caller checks that the requester retries RNR.
bool rnr_for_first_send(uint32_t target_qpn);

// Data placement: a message of `total` bytes is placed in these pieces,
// in this order (the last bytes often first), with pause_between_pieces()
// between them. One piece (the whole) for a message too short to split:
// 8 bytes and less, which atomics need whole.
struct Piece {
  uint64_t offset = 0;
  uint64_t length = 0;
};
std::vector<Piece> placement_pieces(uint64_t total);
void pause_between_pieces();

// The slow peer: a process the seed picks pauses now and then in posts
// and polls.
void maybe_stall();

}  // namespace adversary
}  // namespace softverbs
