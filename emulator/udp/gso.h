// UDP generic segmentation offload (GSO): one sendmsg that the kernel cuts
// into datagrams of one size (the last may be shorter), and its receiving
// twin, GRO. Shared by the UDP transport and the raw-UDP baselines of bench/,
// which must send and read the same way.
#pragma once

#include <netinet/in.h>
#include <netinet/udp.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace softverbs {

// Room for the control message that asks for GSO; it must outlive the send.
struct UdpSegmentControl {
  alignas(cmsghdr) char bytes[CMSG_SPACE(sizeof(uint16_t))] = {};
};

// Makes `message` a GSO send of datagrams of `segment` bytes.
inline void request_udp_segments(msghdr& message, UdpSegmentControl& control, uint16_t segment) {
  message.msg_control = control.bytes;
  message.msg_controllen = sizeof control.bytes;
  cmsghdr* header = CMSG_FIRSTHDR(&message);
  header->cmsg_level = SOL_UDP;
  header->cmsg_type = UDP_SEGMENT;
  header->cmsg_len = CMSG_LEN(sizeof(uint16_t));
  std::memcpy(CMSG_DATA(header), &segment, sizeof segment);
}

// Room for the UDP_GRO control message that comes with coalesced datagrams.
// Left uninitialized: the kernel fills it, and the transport sets up a
// batch of these for every read, most of which find nothing.
struct UdpGroControl {
  alignas(cmsghdr) char bytes[CMSG_SPACE(sizeof(int))];
};

// With UDP_GRO the kernel hands over several datagrams of one flow in one
// read, all of one size but the last: that size, as the control message of
// `message` gives it, or `length` (the bytes read) when it gives none.
inline size_t udp_gro_segment(msghdr& message, size_t length) {
  for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr; header = CMSG_NXTHDR(&message, header)) {
    if (header->cmsg_level == SOL_UDP && header->cmsg_type == UDP_GRO) {
      int size = 0;
      std::memcpy(&size, CMSG_DATA(header), sizeof size);
      if (size > 0) return static_cast<size_t>(size);
    }
  }
  return length;
}

// The datagrams of a GSO send of `total` bytes, given as the pieces
// `parts`, for a host where GSO fails: `send_one(pieces, length)` for each
// datagram of `segment` bytes (the last may be shorter), with the parts of
// `parts` it spans, which may begin and end within a piece.
template <typename SendOne>
void for_each_datagram(std::span<const iovec> parts, size_t total, size_t segment, SendOne&& send_one) {
  std::vector<iovec> datagram;
  size_t part = 0;
  size_t offset = 0;  // into parts[part]: where the next datagram starts
  for (size_t at = 0; at < total && segment > 0; at += segment) {
    const size_t length = std::min(segment, total - at);
    datagram.clear();
    for (size_t left = length; left > 0 && part < parts.size();) {
      const size_t take = std::min(left, parts[part].iov_len - offset);
      if (take > 0) datagram.push_back({static_cast<uint8_t*>(parts[part].iov_base) + offset, take});
      left -= take;
      offset += take;
      if (offset == parts[part].iov_len) {
        ++part;
        offset = 0;
      }
    }
    send_one(std::span<const iovec>(datagram), length);
  }
}

}  // namespace softverbs
