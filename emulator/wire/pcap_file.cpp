#include "wire/pcap_file.h"

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>

namespace softverbs {

namespace {

struct GlobalHeader {
  uint32_t magic = 0xa1b23c4d;  // nanosecond timestamps
  uint16_t version_major = 2;
  uint16_t version_minor = 4;
  int32_t this_zone = 0;
  uint32_t sigfigs = 0;
  uint32_t snaplen = 262144;
  uint32_t network = kPcapLinkTypeRaw;
};

struct RecordHeader {
  uint32_t seconds;
  uint32_t nanoseconds;
  uint32_t captured_length;
  uint32_t original_length;
};

}  // namespace

bool create_pcap_file(const std::filesystem::path& path, std::string* error) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    *error = "cannot create " + path.string() + ": " + std::strerror(errno);
    return false;
  }
  GlobalHeader header;
  bool ok = ::write(fd, &header, sizeof header) == static_cast<ssize_t>(sizeof header);
  if (!ok) *error = "cannot write " + path.string() + ": " + std::strerror(errno);
  ::close(fd);
  return ok;
}

bool append_pcap_record(int fd, std::span<const uint8_t> ip_packet) {
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  RecordHeader record{static_cast<uint32_t>(now.tv_sec), static_cast<uint32_t>(now.tv_nsec),
                      static_cast<uint32_t>(ip_packet.size()), static_cast<uint32_t>(ip_packet.size())};
  iovec parts[2] = {{&record, sizeof record}, {const_cast<uint8_t*>(ip_packet.data()), ip_packet.size()}};
  ssize_t expected = static_cast<ssize_t>(sizeof record + ip_packet.size());
  return ::writev(fd, parts, 2) == expected;
}

}  // namespace softverbs
