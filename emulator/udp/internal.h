// Helpers the UDP transport's roles share; not part of its interface.
#pragma once

#include <endian.h>
#include <sys/uio.h>

#include <algorithm>

#include "udp/qp.h"

namespace softverbs::udp {

using LocalVectors = SmallVector<iovec, limits::kMaxSge + 1>;

// Resolves bytes [offset, offset + length) of a WQE's local data to this
// process's addresses, checking every lkey piece for `access` (0 to read,
// access::kLocalWrite to write). False if a check fails.
//
// The keys are looked up under the device's memory_lock, which is released
// at once: the device-wide lock is not held while bytes are checksummed and
// sent, so that processes do not take turns. The addresses stay good for as
// long as the caller holds the engine's mutex, because they lie in this
// process's own regions and this process's dereg_mr and rereg_mr wait for
// that mutex (UdpTransport::hold_data_paths).
bool gather_local(DeviceMemory& memory, const UdpQp& qp, const SendWqe& wqe, uint64_t offset, uint64_t length,
                  uint32_t access, LocalVectors& out);

// Copies `from` into the byte ranges `to` of this process.
void scatter(std::span<const iovec> to, std::span<const uint8_t> from);

// Before a packet that one process of the device passes to the QP's owner
// (see udp/transport.h). The forwarding socket is a UDP port on 127.0.0.1
// that any local user can send to; the secret, kept in device memory that
// only the device's user can map, tells the owner that the header (the
// addresses it trusts) came from a process of the device.
inline constexpr uint32_t kForwardMagic = 0x53565246;  // "SVRF"
struct ForwardHeader {
  uint32_t magic = kForwardMagic;
  uint16_t source_port = 0;
  uint16_t destination_port = 0;
  uint64_t secret = 0;  // DeviceShared::forward_secret
  uint8_t source[16] = {};
  uint8_t destination[16] = {};
};

// Packets (and PSNs) a message of `length` bytes takes at path MTU `mtu`.
inline uint32_t packets_for(uint64_t length, uint32_t mtu) {
  return std::max<uint32_t>(1, static_cast<uint32_t>((length + mtu - 1) / mtu));
}

}  // namespace softverbs::udp
