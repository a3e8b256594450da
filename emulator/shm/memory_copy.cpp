#include "shm/memory_copy.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "device/device_memory.h"
#include "device/event_socket.h"
#include "device/on_demand_paging.h"
#include "shm/shared_regions.h"
#include "support/internal_mappings.h"
#include "support/payload_copy.h"
#include "support/process_id.h"
#include "support/small_vector.h"
#include "verbs/adversary.h"

namespace softverbs {

namespace {

// ---- in-process and kernel copies -----------------------------------------

// memmove between two iovec lists, in this process.
void copy_vectors(std::span<const iovec> to, std::span<const iovec> from) {
  size_t to_index = 0, to_offset = 0;
  for (const iovec& source : from) {
    size_t done = 0;
    while (done < source.iov_len && to_index < to.size()) {
      size_t room = to[to_index].iov_len - to_offset;
      size_t chunk = std::min(room, source.iov_len - done);
      move_payload(static_cast<char*>(to[to_index].iov_base) + to_offset,
                   static_cast<const char*>(source.iov_base) + done, chunk);
      done += chunk;
      to_offset += chunk;
      if (to_offset == to[to_index].iov_len) {
        ++to_index;
        to_offset = 0;
      }
    }
  }
}

size_t total(std::span<const iovec> vectors) {
  size_t sum = 0;
  for (const iovec& v : vectors) sum += v.iov_len;
  return sum;
}

std::vector<iovec> to_iovecs(std::span<const RemoteRange> ranges) {
  std::vector<iovec> vectors;
  vectors.reserve(ranges.size());
  for (const RemoteRange& r : ranges) vectors.push_back({reinterpret_cast<void*>(r.address), r.length});
  return vectors;
}

// Advances an iovec list by `bytes`.
void advance(std::vector<iovec>& list, size_t& index, size_t bytes) {
  while (bytes > 0 && index < list.size()) {
    iovec& v = list[index];
    size_t step = std::min(bytes, v.iov_len);
    v.iov_base = static_cast<char*>(v.iov_base) + step;
    v.iov_len -= step;
    bytes -= step;
    if (v.iov_len == 0) ++index;
  }
  while (index < list.size() && list[index].iov_len == 0) ++index;
}

// process_vm_* takes at most IOV_MAX vectors a side and may copy partially:
// loop until everything moved. Lists up to the device's SGE limit stay on the
// stack.
template <typename Call>
int kernel_copy(pid_t pid, std::span<const iovec> local, std::span<const iovec> remote, Call call) {
  size_t wanted = std::min(total(local), total(remote));
  if (local.size() <= 64 && remote.size() <= 64) {
    // The common case: one call moves everything.
    ssize_t n = call(pid, local.data(), local.size(), remote.data(), remote.size(), 0);
    if (n == static_cast<ssize_t>(wanted)) return 0;
    if (n < 0 && errno != EINTR) return errno;
  }
  std::vector<iovec> l(local.begin(), local.end()), r(remote.begin(), remote.end());
  size_t moved = 0, li = 0, ri = 0;
  while (moved < wanted) {
    size_t lcount = std::min<size_t>(l.size() - li, 1024), rcount = std::min<size_t>(r.size() - ri, 1024);
    ssize_t n = call(pid, l.data() + li, lcount, r.data() + ri, rcount, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EFAULT;
    moved += static_cast<size_t>(n);
    advance(l, li, static_cast<size_t>(n));
    advance(r, ri, static_cast<size_t>(n));
  }
  return 0;
}

// ---- the copy agent ---------------------------------------------------------

using copy_agent::kMaxSegments;
using AgentSegment = copy_agent::Segment;
using AgentRequest = copy_agent::Request;
using AgentReply = copy_agent::Reply;
constexpr uint32_t kAgentMagic = copy_agent::kMagic;
constexpr uint64_t kChunkBytes = copy_agent::kChunkBytes;
constexpr int kAgentTimeoutMs = 5000;

SocketAddress agent_address(DeviceMemory& memory, pid_t pid) {
  char name[96];
  std::snprintf(name, sizeof name, "softverbs-agent-%016llx-%d",
                static_cast<unsigned long long>(memory.shared().instance_id), static_cast<int>(pid));
  SocketAddress address;
  address_from_text(name, &address);
  return address;
}

// The rights a copy into (write) or out of the agent's memory may exercise:
// placing a SEND needs local write on the receive buffer's key, a WRITE
// remote write, a READ remote read, an atomic remote atomic both ways.
bool right_fits_direction(uint32_t right, bool write) {
  if (right == 0 || (right & (right - 1)) != 0) return false;  // exactly one
  if (write) return right == access::kLocalWrite || right == access::kRemoteWrite || right == access::kRemoteAtomic;
  return right == access::kRemoteRead || right == access::kRemoteAtomic;
}

}  // namespace

int serve_copy_request(DeviceMemory& memory, std::span<const uint8_t> datagram) {
  AgentRequest request;
  if (datagram.size() != sizeof request) return EINVAL;
  std::memcpy(&request, datagram.data(), sizeof request);
  if (request.magic != kAgentMagic || request.count > kMaxSegments || request.write > 1) return EINVAL;
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < request.count; ++i) {
    const AgentSegment& s = request.segments[i];
    std::optional<MemoryRegion> region = memory.shared().mrs.find(s.key);
    if (!region || region->owner_pid != current_pid() || s.address < region->address ||
        s.address - region->address > region->length || s.length > region->length - (s.address - region->address) ||
        !right_fits_direction(s.access, request.write == 1) || (region->access & s.access) != s.access)
      return EFAULT;
    // An on-demand region's pages are resolved now, as the requester's
    // kernel copy would have: one not mapped fails the copy.
    if ((region->access & access::kOnDemand) &&
        (overlaps_internal_mapping(s.address, s.length) ||
         fault_in_pages(s.address, s.length, request.write == 1 || s.access == access::kRemoteAtomic) != 0))
      return EFAULT;
    if (s.length > kChunkBytes - bytes) return EINVAL;
    bytes += s.length;
  }
  const DeviceShared& shared = memory.shared();
  if (request.bounce_offset < shared.heap_start || request.bounce_offset > shared.heap_end ||
      bytes > shared.heap_end - request.bounce_offset)
    return EINVAL;
  char* bounce = memory.at<char>(request.bounce_offset);
  for (uint32_t i = 0; i < request.count; ++i) {
    const AgentSegment& s = request.segments[i];
    auto* mine = reinterpret_cast<char*>(s.address);
    if (request.write)
      copy_payload(mine, bounce, s.length);
    else
      copy_payload(bounce, mine, s.length);
    bounce += s.length;
  }
  return 0;
}

namespace {

// One request: the caller's bounce buffer holds (or receives) the bytes of
// `segments`, in order.
int agent_request(DeviceMemory& memory, pid_t pid, bool write, uint64_t bounce,
                  std::span<const AgentSegment> segments) {
  AgentRequest request{};
  request.magic = kAgentMagic;
  request.write = write ? 1 : 0;
  request.bounce_offset = bounce;
  request.count = static_cast<uint32_t>(segments.size());
  std::copy(segments.begin(), segments.end(), request.segments);
  int reply_fd = open_event_socket(&request.reply);
  if (reply_fd < 0) return errno;
  int status = EHOSTUNREACH;
  if (send_datagram(agent_address(memory, pid), &request, sizeof request)) {
    status = ETIMEDOUT;
    // Only the agent's answer counts: a datagram from another user is
    // skipped, so that no one can answer in its place.
    for (;;) {
      pollfd waiting{reply_fd, POLLIN, 0};
      AgentReply reply{};
      const int ready = poll(&waiting, 1, kAgentTimeoutMs);
      if (ready < 0 && errno == EINTR) continue;  // the application's signal, not the agent's silence
      if (ready != 1) break;
      const ssize_t got = receive_from_trusted(reply_fd, &reply, sizeof reply);
      if (got == -1 && errno == EINTR) continue;
      if (got == -1) break;
      if (got == static_cast<ssize_t>(sizeof reply) && reply.magic == kAgentMagic) {
        status = reply.status;
        break;
      }
    }
  }
  close(reply_fd);
  return status;
}

int agent_copy(DeviceMemory& memory, pid_t pid, bool write, std::span<const iovec> local,
               std::span<const RemoteRange> remote) {
  uint64_t wanted = std::min<uint64_t>(total(local), [&] {
    uint64_t sum = 0;
    for (const RemoteRange& r : remote) sum += r.length;
    return sum;
  }());
  uint64_t bounce_bytes = std::min(wanted, kChunkBytes);
  if (wanted == 0) return 0;
  uint64_t bounce = memory.allocate(bounce_bytes);
  if (bounce == 0) return ENOMEM;
  std::vector<iovec> mine(local.begin(), local.end());
  size_t mine_index = 0;
  int status = 0;
  size_t range = 0;
  uint64_t range_offset = 0, moved = 0;
  while (status == 0 && moved < wanted) {
    // The next chunk: up to kChunkBytes over up to kMaxSegments segments.
    std::vector<AgentSegment> segments;
    uint64_t chunk = 0;
    while (range < remote.size() && segments.size() < kMaxSegments && chunk < bounce_bytes && moved + chunk < wanted) {
      const RemoteRange& r = remote[range];
      uint64_t take = std::min({r.length - range_offset, bounce_bytes - chunk, wanted - moved - chunk});
      if (take > 0) segments.push_back({r.address + range_offset, take, r.key, r.access});
      chunk += take;
      range_offset += take;
      if (range_offset == r.length) {
        ++range;
        range_offset = 0;
      }
    }
    iovec bounce_vector{memory.at<char>(bounce), chunk};
    std::vector<iovec> mine_part;
    {
      // The slice of the local list this chunk covers.
      std::vector<iovec> rest(mine.begin() + static_cast<std::ptrdiff_t>(mine_index), mine.end());
      uint64_t left = chunk;
      for (const iovec& v : rest) {
        if (left == 0) break;
        size_t take = std::min<uint64_t>(v.iov_len, left);
        mine_part.push_back({v.iov_base, take});
        left -= take;
      }
    }
    if (write) {
      copy_vectors(std::span(&bounce_vector, 1), mine_part);
      status = agent_request(memory, pid, true, bounce, segments);
    } else {
      status = agent_request(memory, pid, false, bounce, segments);
      if (status == 0) copy_vectors(mine_part, std::span(&bounce_vector, 1));
    }
    advance(mine, mine_index, chunk);
    moved += chunk;
  }
  memory.release(bounce, bounce_bytes);
  return status;
}

bool kernel_refused(int error) { return error == EPERM || error == EACCES || error == ENOSYS; }

template <typename Call>
int copy(DeviceMemory& memory, pid_t pid, bool write, std::span<const iovec> local, std::span<const RemoteRange> remote,
         Call kernel_call) {
  SmallVector<iovec, 64> few;
  std::vector<iovec> many;
  std::span<const iovec> remote_vectors;
  if (remote.size() <= 64) {
    for (const RemoteRange& r : remote) few.push_back({reinterpret_cast<void*>(r.address), r.length});
    remote_vectors = few;
  } else {
    many = to_iovecs(remote);
    remote_vectors = many;
  }
  if (pid == current_pid()) {
    if (write)
      copy_vectors(remote_vectors, local);
    else
      copy_vectors(local, remote_vectors);
    return 0;
  }
  // Regions the owner shared are mapped here: a memcpy, no system call. The
  // caller holds memory_lock, so the keys stay what the table says.
  if (SmallVector<iovec, 64> mapped; remote.size() <= 64 && configured_copy_method() == CopyMethod::Auto) {
    bool all = true;
    for (const RemoteRange& range : remote) {
      auto region = memory.shared().mrs.find(range.key);
      // On-demand pages are never reached through a mapping of the owner's
      // memory, which would not see them unmapped.
      uint8_t* view = region && region->owner_pid == pid && !(region->access & access::kOnDemand)
                          ? peer_view(pid, region->backing, range.address, range.length)
                          : nullptr;
      if (view == nullptr) {
        all = false;
        break;
      }
      mapped.push_back({view, range.length});
    }
    if (all) {
      if (write)
        copy_vectors(mapped, local);
      else
        copy_vectors(local, mapped);
      return 0;
    }
  }
  // Another process's on-demand pages are resolved by its own agent, which
  // also keeps them out of softverbs' mappings there (internal_mappings.h).
  if (std::any_of(remote.begin(), remote.end(), [&](const RemoteRange& range) {
        auto region = memory.shared().mrs.find(range.key);
        return region && (region->access & access::kOnDemand);
      }))
    return agent_copy(memory, pid, write, local, remote);
  CopyMethod method = configured_copy_method();
  if (method != CopyMethod::AgentOnly) {
    int error = kernel_copy(pid, local, remote_vectors, kernel_call);
    if (error == 0 || method == CopyMethod::KernelOnly || !kernel_refused(error)) return error;
  }
  return agent_copy(memory, pid, write, local, remote);
}

}  // namespace

void copy_within_process(std::span<const iovec> to, std::span<const iovec> from) { copy_vectors(to, from); }

int agent_copy_to_process(DeviceMemory& memory, pid_t pid, std::span<const iovec> local,
                          std::span<const RemoteRange> remote) {
  return agent_copy(memory, pid, true, local, remote);
}

int agent_copy_from_process(DeviceMemory& memory, pid_t pid, std::span<const iovec> local,
                            std::span<const RemoteRange> remote) {
  return agent_copy(memory, pid, false, local, remote);
}

CopyMethod configured_copy_method() {
  static const CopyMethod method = [] {
    const char* text = std::getenv("SOFTVERBS_COPY");
    if (text == nullptr) return CopyMethod::Auto;
    if (std::strcmp(text, "agent") == 0) return CopyMethod::AgentOnly;
    if (std::strcmp(text, "kernel") == 0) return CopyMethod::KernelOnly;
    return CopyMethod::Auto;
  }();
  return method;
}

namespace {

// The bytes [offset, offset + length) of a list of ranges.
template <typename Range, typename Start, typename Shift>
std::vector<Range> slice(std::span<const Range> ranges, uint64_t offset, uint64_t length, Start start_of, Shift shift) {
  std::vector<Range> out;
  uint64_t at = 0;
  for (const Range& range : ranges) {
    const uint64_t size = start_of(range);
    const uint64_t begin = std::max(at, offset), end = std::min(at + size, offset + length);
    if (begin < end) out.push_back(shift(range, begin - at, end - begin));
    at += size;
  }
  return out;
}

// Adversarial mode: the message lands in pieces, in a shuffled order, with
// pauses between them, as an HCA may place it before its completion.
int copy_in_pieces(DeviceMemory& memory, pid_t pid, std::span<const iovec> local, std::span<const RemoteRange> remote) {
  const std::vector<adversary::Piece> pieces = adversary::placement_pieces(total(local));
  if (pieces.size() <= 1) return copy(memory, pid, true, local, remote, process_vm_writev);
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (i > 0) adversary::pause_between_pieces();
    const adversary::Piece& piece = pieces[i];
    auto local_piece = slice<iovec>(
        local, piece.offset, piece.length, [](const iovec& v) { return v.iov_len; },
        [](const iovec& v, uint64_t skip, uint64_t length) {
          return iovec{static_cast<char*>(v.iov_base) + skip, length};
        });
    auto remote_piece = slice<RemoteRange>(
        remote, piece.offset, piece.length, [](const RemoteRange& r) { return r.length; },
        [](const RemoteRange& r, uint64_t skip, uint64_t length) {
          return RemoteRange{r.address + skip, length, r.key, r.access};
        });
    if (remote_piece.empty()) continue;
    if (int error = copy(memory, pid, true, local_piece, remote_piece, process_vm_writev)) return error;
  }
  return 0;
}

}  // namespace

int copy_to_process(DeviceMemory& memory, pid_t pid, std::span<const iovec> local,
                    std::span<const RemoteRange> remote) {
  if (adversary::enabled()) [[unlikely]]
    return copy_in_pieces(memory, pid, local, remote);
  return copy(memory, pid, true, local, remote, process_vm_writev);
}

int copy_from_process(DeviceMemory& memory, pid_t pid, std::span<const iovec> local,
                      std::span<const RemoteRange> remote) {
  return copy(memory, pid, false, local, remote, process_vm_readv);
}

int open_copy_agent_socket(DeviceMemory& memory) {
  const SocketAddress address = agent_address(memory, current_pid());
  return open_trusted_socket(address);
}

void serve_copy_requests(DeviceMemory& memory, int fd) {
  for (;;) {
    alignas(AgentRequest) uint8_t datagram[sizeof(AgentRequest) + 1];
    const ssize_t n = receive_from_trusted(fd, datagram, sizeof datagram);
    if (n == -1 && errno == EINTR) continue;
    if (n == -1) return;
    if (n == -2) continue;  // another user's: not answered at all
    AgentRequest request;
    if (static_cast<size_t>(n) != sizeof request) continue;
    std::memcpy(&request, datagram, sizeof request);
    if (request.magic != kAgentMagic) continue;
    AgentReply reply{kAgentMagic, serve_copy_request(memory, std::span(datagram, sizeof request))};
    send_datagram(request.reply, &reply, sizeof reply);
  }
}

}  // namespace softverbs
