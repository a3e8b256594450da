#include "wire/icrc.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "wire/crc32.h"
#include "wire/roce_headers.h"

namespace softverbs::wire {

namespace {

constexpr size_t kIpv4Header = 20;
constexpr size_t kIpv4MaxHeader = 60;
constexpr size_t kIpv6Header = 40;
constexpr size_t kUdpHeader = 8;

// Length of the IP + UDP headers at the start of `packet`; 0 if malformed.
size_t header_length(std::span<const uint8_t> packet) {
  if (packet.empty()) return 0;
  bool ipv6 = (packet[0] >> 4) == 6;
  size_t ip_length = ipv6 ? kIpv6Header : static_cast<size_t>(packet[0] & 0xf) * 4;
  if (!ipv6 && ((packet[0] >> 4) != 4 || ip_length < kIpv4Header)) return 0;
  if (packet.size() < ip_length + kUdpHeader) return 0;
  return ip_length + kUdpHeader;
}

}  // namespace

namespace {

// The register after the eight bytes of ones that stand for the LRH.
constexpr uint32_t kAfterOnes = [] {
  uint32_t crc = 0xffffffffu;
  for (int byte = 0; byte < 8; ++byte) {
    crc ^= 0xffu;
    for (int bit = 0; bit < 8; ++bit) crc = (crc & 1) ? 0xedb88320u ^ (crc >> 1) : crc >> 1;
  }
  return crc;
}();

}  // namespace

uint32_t icrc_headers(std::span<const uint8_t> headers) {
  const size_t header_bytes = headers.size();
  if (header_bytes < kIpv4Header + kUdpHeader || header_bytes > kIpv4MaxHeader + kUdpHeader) return 0;
  const bool ipv6 = (headers[0] >> 4) == 6;
  const size_t ip_length = header_bytes - kUdpHeader;
  // A masked copy; the rest of the packet is taken as it is.
  std::array<uint8_t, kIpv4MaxHeader + kUdpHeader> masked;
  std::memcpy(masked.data(), headers.data(), header_bytes);
  if (ipv6) {
    masked[0] |= 0x0f;                         // traffic class, high half
    masked[1] = masked[2] = masked[3] = 0xff;  // traffic class, low half; flow label
    masked[7] = 0xff;                          // hop limit
  } else {
    masked[1] = 0xff;                // type of service (DSCP, ECN)
    masked[8] = 0xff;                // time to live
    masked[10] = masked[11] = 0xff;  // header checksum
  }
  masked[ip_length + 6] = masked[ip_length + 7] = 0xff;  // UDP checksum
  return crc32(kAfterOnes, std::span(masked.data(), header_bytes));
}

uint32_t icrc_add_transport(uint32_t crc, std::span<const uint8_t> transport) {
  if (transport.size() < kBthBytes) return 0;
  // The BTH's fifth byte (FECN, BECN, resv6) counts as ones: it lies in the
  // first eight bytes, taken as one step with the byte replaced, so the
  // packet is neither copied nor changed.
  uint32_t low, high;
  std::memcpy(&low, transport.data(), 4);
  std::memcpy(&high, transport.data() + 4, 4);
  crc = crc32_step8(crc, low, high | 0xffu);
  return crc32(crc, transport.subspan(8));
}

uint32_t icrc_from_headers(uint32_t headers_crc, std::span<const uint8_t> transport) {
  if (transport.size() < kBthBytes) return 0;
  return ~icrc_add_transport(headers_crc, transport);
}

uint32_t icrc(std::span<const uint8_t> headers, std::span<const uint8_t> transport) {
  if (headers.size() < kIpv4Header + kUdpHeader || headers.size() > kIpv4MaxHeader + kUdpHeader) return 0;
  return icrc_from_headers(icrc_headers(headers), transport);
}

uint32_t icrc(std::span<const uint8_t> packet) {
  size_t headers = header_length(packet);
  if (headers == 0) return 0;
  return icrc(packet.first(headers), packet.subspan(headers));
}

void store_icrc(uint32_t value, uint8_t* out) {
  // Least significant byte first, as the CRC register shifts out.
  for (int i = 0; i < 4; ++i) out[i] = static_cast<uint8_t>(value >> (8 * i));
}

uint32_t load_icrc(const uint8_t* in) {
  return static_cast<uint32_t>(in[0]) | static_cast<uint32_t>(in[1]) << 8 | static_cast<uint32_t>(in[2]) << 16 |
         static_cast<uint32_t>(in[3]) << 24;
}

void append_icrc(std::vector<uint8_t>& packet) {
  uint8_t bytes[kIcrcBytes];
  store_icrc(icrc(packet), bytes);
  packet.insert(packet.end(), bytes, bytes + kIcrcBytes);
}

bool verify_icrc(std::span<const uint8_t> packet) {
  if (packet.size() < kIcrcBytes) return false;
  return icrc(packet.first(packet.size() - kIcrcBytes)) == load_icrc(packet.data() + packet.size() - kIcrcBytes);
}

namespace {

// A 32x32 matrix over GF(2): column i is the image of bit i.
using Gf2Matrix = std::array<uint32_t, 32>;

uint32_t apply(const Gf2Matrix& matrix, uint32_t vector) {
  uint32_t out = 0;
  for (int bit = 0; vector != 0; ++bit, vector >>= 1)
    if (vector & 1) out ^= matrix[bit];
  return out;
}

Gf2Matrix multiply(const Gf2Matrix& a, const Gf2Matrix& b) {
  Gf2Matrix product;
  for (int i = 0; i < 32; ++i) product[i] = apply(a, b[i]);
  return product;
}

// The register update of `bytes` zero bytes, as a matrix (by squaring).
Gf2Matrix zero_bytes(size_t bytes) {
  Gf2Matrix step;  // one zero byte
  for (int bit = 0; bit < 32; ++bit) step[bit] = crc32(uint32_t{1} << bit, std::array<uint8_t, 1>{0});
  Gf2Matrix result;
  for (int bit = 0; bit < 32; ++bit) result[bit] = uint32_t{1} << bit;
  while (bytes != 0) {
    if (bytes & 1) result = multiply(step, result);
    step = multiply(step, step);
    bytes >>= 1;
  }
  return result;
}

}  // namespace

IdentificationSolver::Length IdentificationSolver::make_length(size_t bytes_after) {
  Length made;
  made.bytes_after = bytes_after;
  const Gf2Matrix shift = zero_bytes(bytes_after);
  for (size_t bit = 0; bit < kBits; ++bit) {
    // Big-endian on the wire: bit 15 of the ID is the first byte's top bit.
    const auto id = static_cast<uint16_t>(1u << bit);
    const std::array<uint8_t, 2> field{static_cast<uint8_t>(id >> 8), static_cast<uint8_t>(id)};
    made.images[bit] = apply(shift, crc32(0, field));
    // Forward elimination: each row a reduced image, the pivot bit no later
    // row has, and the identification bits that make it.
    uint32_t image = made.images[bit];
    uint16_t bits = id;
    for (size_t row = 0; row < made.rows; ++row)
      if (image & made.pivots[row]) {
        image ^= made.reduced[row];
        bits ^= made.ids[row];
      }
    if (image == 0) continue;
    made.reduced[made.rows] = image;
    made.pivots[made.rows] = image & (~image + 1);
    made.ids[made.rows] = bits;
    ++made.rows;
  }
  return made;
}

namespace {
size_t change_slot(uint32_t change, size_t slots) { return (change * 0x9e3779b1u >> 16) % slots; }
}  // namespace

IdentificationSolver::Recent& IdentificationSolver::recent(size_t bytes_after) {
  Recent& recent = recent_[(bytes_after * 0x9e3779b1u >> 8) % recent_.size()];
  if (recent.length.bytes_after == bytes_after) return recent;
  auto found = all_.find(bytes_after);
  if (found == all_.end()) {
    if (all_.size() >= kLengthsKept) all_.clear();
    found = all_.emplace(bytes_after, make_length(bytes_after)).first;
  }
  recent.length = found->second;
  recent.slot_place.fill(0);
  for (size_t place = 0; place < kSegmentIdentifications; ++place) {
    // Each place's change from one with a bit fewer (its lowest set bit).
    recent.place_change[place] =
        place == 0 ? 0 : recent.place_change[place & (place - 1)] ^ recent.length.images[std::countr_zero(place)];
    size_t slot = change_slot(recent.place_change[place], recent.slot_place.size());
    while (recent.slot_place[slot] != 0) slot = (slot + 1) % recent.slot_place.size();
    recent.slot_change[slot] = recent.place_change[place];
    recent.slot_place[slot] = static_cast<uint8_t>(place + 1);
  }
  return recent;
}

uint32_t IdentificationSolver::change(uint16_t id, size_t bytes_after) {
  if (id == 0) return 0;
  const Recent& made = recent(bytes_after);
  if (id < kSegmentIdentifications) return made.place_change[id];
  uint32_t change = 0;
  for (size_t bit = 0; bit < kBits; ++bit)
    if (id & (1u << bit)) change ^= made.length.images[bit];
  return change;
}

std::optional<uint16_t> IdentificationSolver::solve(uint32_t difference, size_t bytes_after) {
  if (difference == 0) return 0;
  const Recent& made = recent(bytes_after);
  for (size_t slot = change_slot(difference, made.slot_place.size()); made.slot_place[slot] != 0;
       slot = (slot + 1) % made.slot_place.size())
    if (made.slot_change[slot] == difference) return static_cast<uint16_t>(made.slot_place[slot] - 1);
  uint16_t id = 0;
  for (size_t row = 0; row < made.length.rows; ++row)
    if (difference & made.length.pivots[row]) {
      difference ^= made.length.reduced[row];
      id ^= made.length.ids[row];
    }
  if (difference != 0) return std::nullopt;
  return id;
}

}  // namespace softverbs::wire
