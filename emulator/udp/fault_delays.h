// The packets that fault injection (udp/fault_injection.h) holds back on the
// sending side: delayed ones, each until its time, and per QP one held for
// reordering, which leaves after the QP's next packet has overtaken it (or
// at kReorderHold).
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "udp/qp.h"
#include "udp/socket_util.h"
#include "wire/roce_packet.h"

namespace softverbs::udp {

// A whole datagram (ICRC included, maybe corrupted) and where it goes.
struct HeldPacket {
  Clock::time_point due;
  int fd;
  SocketAddressStorage to;
  std::vector<uint8_t> bytes;
  wire::FlowAddress flow;
  uint32_t qpn = 0;  // the QP that sent it
};

struct FaultDelays {
  std::vector<HeldPacket> delayed;
  std::unordered_map<uint32_t, HeldPacket> reordered;  // one per QP at most

  // Hands every packet due by `now` to `send(fd, to, bytes)`: the delayed
  // ones first, in the order they were delayed, then the reordered ones.
  template <typename Send>
  void release_due(Clock::time_point now, Send&& send) {
    release_where([now](const HeldPacket& item) { return item.due <= now; }, send);
  }

  // Hands every packet `qpn` sent to `send(fd, to, bytes)`: a destroyed
  // QP's packets were on the wire already, as an HCA's would be.
  template <typename Send>
  void release_qp(uint32_t qpn, Send&& send) {
    release_where([qpn](const HeldPacket& item) { return item.qpn == qpn; }, send);
  }

  // Hands every held packet that `chosen` picks to `send`, in the order
  // release_due describes.
  template <typename Chosen, typename Send>
  void release_where(Chosen&& chosen, Send&& send) {
    for (size_t i = 0; i < delayed.size();) {
      if (chosen(delayed[i])) {
        HeldPacket item = std::move(delayed[i]);
        delayed.erase(delayed.begin() + static_cast<std::ptrdiff_t>(i));
        send(item.fd, item.to, item.bytes);
      } else {
        ++i;
      }
    }
    for (auto it = reordered.begin(); it != reordered.end();) {
      if (chosen(it->second)) {
        send(it->second.fd, it->second.to, it->second.bytes);
        it = reordered.erase(it);
      } else {
        ++it;
      }
    }
  }

  Clock::time_point earliest_due() const {
    Clock::time_point earliest = Clock::time_point::max();
    for (const HeldPacket& item : delayed) earliest = std::min(earliest, item.due);
    for (const auto& [qpn, item] : reordered) earliest = std::min(earliest, item.due);
    return earliest;
  }
};

}  // namespace softverbs::udp
