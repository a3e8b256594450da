// Moving bytes between the address spaces of the processes that share a
// device: the one copy of the shared-memory transport. Within one process it
// is memmove; across processes, process_vm_readv/writev (the kernel checks
// that the caller may access the target, as it would for ptrace). Where the
// kernel refuses those (Yama ptrace_scope, container seccomp profiles), the
// target process's copy agent does the copy through a bounce buffer in device
// memory: two copies and a wake-up, but it works wherever the device does.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <span>

#include "device/event_socket.h"

namespace softverbs {

class DeviceMemory;

// A range in another process, with the key that registered it (the copy
// agent checks the range against the key's region before touching it).
struct RemoteRange {
  uint64_t address = 0;
  uint64_t length = 0;
  uint32_t key = 0;
  // The one right the copy exercises on the key's region (access::k*:
  // local write to place a SEND, remote write, read or atomic); the copy
  // agent refuses a range whose region does not grant it.
  uint32_t access = 0;
};

// The copy agent's datagrams (a request to the target's agent socket, its
// answer to the requester's), for the agent, its requesters and the fuzz
// target.
namespace copy_agent {
inline constexpr uint32_t kMagic = 0x53564147;  // "SVAG"
inline constexpr size_t kMaxSegments = 32;
inline constexpr uint64_t kChunkBytes = uint64_t{4} << 20;  // bytes one request moves at most

struct Segment {
  uint64_t address;
  uint64_t length;
  uint32_t key;
  uint32_t access;  // the right the copy exercises (access::k*), checked against the key's region
};

struct Request {
  uint32_t magic;
  uint32_t write;  // 1: bounce -> agent's memory; 0: agent's memory -> bounce
  uint64_t bounce_offset;
  uint32_t count;
  uint32_t reserved;
  SocketAddress reply;
  Segment segments[kMaxSegments];
};

struct Reply {
  uint32_t magic;
  int32_t status;
};
}  // namespace copy_agent

enum class CopyMethod : uint8_t { Auto, KernelOnly, AgentOnly };

// SOFTVERBS_COPY=auto|kernel|agent; auto unless set.
CopyMethod configured_copy_method();

// Copies the bytes of `local` (this process) into `remote` (process `pid`).
// Returns 0 or an errno.
int copy_to_process(DeviceMemory& memory, pid_t pid, std::span<const iovec> local, std::span<const RemoteRange> remote);
// Copies from `remote` (process `pid`) into `local` (this process).
int copy_from_process(DeviceMemory& memory, pid_t pid, std::span<const iovec> local,
                      std::span<const RemoteRange> remote);

// The copy agent path alone, whatever SOFTVERBS_COPY says (for tests and
// for callers that know the kernel path is refused).
int agent_copy_to_process(DeviceMemory& memory, pid_t pid, std::span<const iovec> local,
                          std::span<const RemoteRange> remote);
int agent_copy_from_process(DeviceMemory& memory, pid_t pid, std::span<const iovec> local,
                            std::span<const RemoteRange> remote);

// memmove between two lists of this process's buffers (as many bytes as the
// shorter list holds).
void copy_within_process(std::span<const iovec> to, std::span<const iovec> from);

// This process's copy agent socket for `memory` (an abstract datagram
// socket that takes only datagrams of this user: see event_socket.h);
// -1 on error.
int open_copy_agent_socket(DeviceMemory& memory);
// Serves copy requests from `fd` until it fails: each range is checked
// against the region its key names in this process (owner, bounds, the
// right exercised) before a byte moves. Requests from other users get no
// answer. Runs on the process's presence thread (DeviceMemory::process_slot).
void serve_copy_requests(DeviceMemory& memory, int fd);
// One request datagram, as the agent serves it: 0 or an errno (for the
// fuzz target and tests).
int serve_copy_request(DeviceMemory& memory, std::span<const uint8_t> datagram);

}  // namespace softverbs
