// UDP generic segmentation offload (GSO): one sendmsg that the kernel cuts
// into datagrams of one size (the last may be shorter). Shared by the UDP
// transport and the raw-UDP baselines of bench/, which must send the same way.
#pragma once

#include <netinet/in.h>
#include <netinet/udp.h>
#include <sys/socket.h>

#include <cstdint>
#include <cstring>

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

}  // namespace softverbs
