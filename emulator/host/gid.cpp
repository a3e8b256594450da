#include "host/gid.h"

#include <algorithm>
#include <cstdio>

namespace softverbs {

bool Gid::is_zero() const {
  return std::all_of(raw.begin(), raw.end(), [](uint8_t b) { return b == 0; });
}

bool Gid::is_multicast() const {
  if (raw[0] == 0xff) return true;
  const bool ipv4_mapped = std::all_of(raw.begin(), raw.begin() + 10, [](uint8_t b) { return b == 0; }) &&
                           raw[10] == 0xff && raw[11] == 0xff;
  return ipv4_mapped && (raw[12] & 0xf0) == 0xe0;
}

Gid Gid::from_ipv4(std::span<const uint8_t, 4> address) {
  Gid gid;
  gid.raw[10] = 0xff;
  gid.raw[11] = 0xff;
  std::copy(address.begin(), address.end(), gid.raw.begin() + 12);
  return gid;
}

Gid Gid::from_ipv6(std::span<const uint8_t, 16> address) {
  Gid gid;
  std::copy(address.begin(), address.end(), gid.raw.begin());
  return gid;
}

Gid Gid::link_local_from_mac(std::span<const uint8_t, 6> mac) {
  Gid gid;
  gid.raw[0] = 0xfe;
  gid.raw[1] = 0x80;
  gid.raw[8] = mac[0] ^ 0x02;  // flip the universal/local bit (modified EUI-64)
  gid.raw[9] = mac[1];
  gid.raw[10] = mac[2];
  gid.raw[11] = 0xff;
  gid.raw[12] = 0xfe;
  gid.raw[13] = mac[3];
  gid.raw[14] = mac[4];
  gid.raw[15] = mac[5];
  return gid;
}

std::string Gid::to_sysfs_string() const {
  char text[40];
  std::snprintf(text, sizeof text, "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x", raw[0],
                raw[1], raw[2], raw[3], raw[4], raw[5], raw[6], raw[7], raw[8], raw[9], raw[10], raw[11], raw[12],
                raw[13], raw[14], raw[15]);
  return text;
}

std::optional<Gid> Gid::from_sysfs_string(std::string_view text) {
  if (text.size() != 39) return std::nullopt;
  Gid gid;
  for (size_t group = 0; group < 8; ++group) {
    if (group != 0 && text[group * 5 - 1] != ':') return std::nullopt;
    unsigned value = 0;
    for (size_t digit = 0; digit < 4; ++digit) {
      char c = text[group * 5 + digit];
      unsigned nibble;
      if (c >= '0' && c <= '9')
        nibble = c - '0';
      else if (c >= 'a' && c <= 'f')
        nibble = c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        nibble = c - 'A' + 10;
      else
        return std::nullopt;
      value = value * 16 + nibble;
    }
    gid.raw[group * 2] = static_cast<uint8_t>(value >> 8);
    gid.raw[group * 2 + 1] = static_cast<uint8_t>(value & 0xff);
  }
  return gid;
}

const char* gid_type_sysfs_name(GidType type) {
  // The strings the kernel writes in ports/N/gid_attrs/types/M; libibverbs
  // compares them literally.
  return type == GidType::RoceV2 ? "RoCE v2" : "IB/RoCE v1";
}

}  // namespace softverbs
