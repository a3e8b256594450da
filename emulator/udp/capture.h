// Packet capture (`softverbs capture`): every datagram this process sends,
// and every one it receives from another host, appended as an IP packet to
// the pcap file that the device's CaptureControl names.
#pragma once

#include <cstdint>
#include <span>

#include "device/transport_counters.h"
#include "wire/roce_packet.h"

namespace softverbs::udp {

class PacketCapture {
 public:
  PacketCapture() = default;
  ~PacketCapture();
  PacketCapture(const PacketCapture&) = delete;
  PacketCapture& operator=(const PacketCapture&) = delete;

  // Appends `datagram` of `flow` to the capture `control` describes; opens
  // the file anew whenever the capture has been started or stopped since.
  // The caller checks control.active first (the common case costs a load).
  void record(CaptureControl& control, const wire::FlowAddress& flow, std::span<const uint8_t> datagram);

 private:
  uint32_t generation_ = 0;
  int fd_ = -1;
};

}  // namespace softverbs::udp
