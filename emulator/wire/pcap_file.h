// Packet captures in the classic pcap format with nanosecond timestamps and
// raw IP frames (LINKTYPE_RAW), which tshark, Wireshark and tcpdump read.
// Several processes append to one capture: each record is one write() to a
// file opened with O_APPEND, so records never interleave.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

namespace softverbs {

inline constexpr uint32_t kPcapLinkTypeRaw = 101;

// Creates (truncating) a capture file holding only the global header.
bool create_pcap_file(const std::filesystem::path& path, std::string* error);

// Appends one record holding `ip_packet` to an open O_APPEND descriptor.
bool append_pcap_record(int fd, std::span<const uint8_t> ip_packet);

}  // namespace softverbs
