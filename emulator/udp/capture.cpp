#include "udp/capture.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>

#include "wire/pcap_file.h"

namespace softverbs::udp {

PacketCapture::~PacketCapture() {
  if (fd_ >= 0) ::close(fd_);
}

void PacketCapture::record(CaptureControl& control, const wire::FlowAddress& flow, std::span<const uint8_t> datagram) {
  uint32_t generation = control.generation.load(std::memory_order_acquire);
  if (generation != generation_) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    generation_ = generation;
    if (control.active.load(std::memory_order_acquire)) {
      char path[sizeof control.path];
      std::memcpy(path, control.path, sizeof path);
      path[sizeof path - 1] = 0;
      fd_ = ::open(path, O_WRONLY | O_APPEND | O_CLOEXEC);
    }
  }
  if (fd_ < 0) return;
  append_pcap_record(fd_, wire::ip_packet(flow, datagram));
}

}  // namespace softverbs::udp
