// ACK coalescing: an ACK that would leave alone waits (is held) for the
// next request its QP's application posts, and leaves with it, often in
// the same UDP GSO send. An ACK that left on its own would reach a peer
// that, having its completion, stops polling and waits for the answer to
// its request some other way (spinning on memory): then only the peer's
// background thread could take that answer in, a thread wake-up later.
// Held until this process's next request, the ACK arrives with it, and the
// peer, still polling for its completion, takes in both.
//
// How long an ACK may wait is learned per QP from how soon its application
// posted after the last request it took in (kAckHold up to kMaxAckHold).
// The engine decides per pass what to hold (PortEngine::send_answers_locked
// in udp/ack_policy.cpp); this class keeps the held ACKs and the pacing.
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "udp/parameters.h"
#include "udp/qp.h"

namespace softverbs::udp {

class HeldAcks {
 public:
  struct Held {
    uint32_t qpn;
    Clock::time_point since;
  };
  using iterator = std::vector<Held>::iterator;

  bool empty() const { return held_.empty(); }
  const Held& front() const { return held_.front(); }
  iterator begin() { return held_.begin(); }
  iterator end() { return held_.end(); }
  std::vector<Held>::const_iterator begin() const { return held_.begin(); }
  std::vector<Held>::const_iterator end() const { return held_.end(); }
  iterator find(uint32_t qpn) {
    return std::find_if(held_.begin(), held_.end(), [qpn](const Held& held) { return held.qpn == qpn; });
  }
  void hold(uint32_t qpn, Clock::time_point now) { held_.push_back({qpn, now}); }
  void erase(iterator held) { held_.erase(held); }

  // When the hold of `held` runs out.
  Clock::time_point due(const Held& held) const { return held.since + hold_for(held.qpn); }
  Clock::time_point earliest_due() const;

  // Did the application of `qpn` let its last held ACK run out without
  // posting? Then it takes requests in and does not answer them.
  bool app_left_last_ack_alone(uint32_t qpn) const {
    auto it = pacing_.find(qpn);
    return it != pacing_.end() && it->second.left_alone_since != Clock::time_point::max();
  }
  // The ACK held since `since` ran out and left alone.
  void note_left_alone(uint32_t qpn, Clock::time_point since) { pacing_[qpn].left_alone_since = since; }
  // The application of `qpn` posts at `now`: how long did its ACK wait
  // before, and so how long should the next one be held?
  void learn(uint32_t qpn, Clock::time_point now);
  void forget_pacing(uint32_t qpn) { pacing_.erase(qpn); }

 private:
  // How long each QP holds ACKs, where it differs from kAckHold.
  struct Pacing {
    Clock::duration hold = parameters::kAckHold;
    Clock::time_point left_alone_since = Clock::time_point::max();  // its last ACK expired
  };
  Clock::duration hold_for(uint32_t qpn) const {
    auto it = pacing_.find(qpn);
    return it == pacing_.end() ? Clock::duration(parameters::kAckHold) : it->second.hold;
  }

  // A few at a time, each QP holding one ACK at most: a flat vector (a tree
  // allocated a node per packet on the latency path).
  std::vector<Held> held_;
  std::unordered_map<uint32_t, Pacing> pacing_;
};

}  // namespace softverbs::udp
