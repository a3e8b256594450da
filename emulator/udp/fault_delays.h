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
    for (size_t i = 0; i < delayed.size();) {
      if (delayed[i].due <= now) {
        HeldPacket item = std::move(delayed[i]);
        delayed.erase(delayed.begin() + static_cast<std::ptrdiff_t>(i));
        send(item.fd, item.to, item.bytes);
      } else {
        ++i;
      }
    }
    for (auto it = reordered.begin(); it != reordered.end();) {
      if (it->second.due <= now) {
        send(it->second.fd, it->second.to, it->second.bytes);
        it = reordered.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Hands every packet `qpn` sent to `send(fd, to, bytes)`: a destroyed
  // QP's packets were on the wire already, as an HCA's would be.
  template <typename Send>
  void release_qp(uint32_t qpn, Send&& send) {
    for (size_t i = 0; i < delayed.size();) {
      if (delayed[i].qpn == qpn) {
        HeldPacket item = std::move(delayed[i]);
        delayed.erase(delayed.begin() + static_cast<std::ptrdiff_t>(i));
        send(item.fd, item.to, item.bytes);
      } else {
        ++i;
      }
    }
    if (auto it = reordered.find(qpn); it != reordered.end()) {
      HeldPacket item = std::move(it->second);
      reordered.erase(it);
      send(item.fd, item.to, item.bytes);
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
