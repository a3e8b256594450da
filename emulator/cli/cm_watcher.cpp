// The host's part of the kernel's CM that outlives applications. The
// kernel sends a DREQ for each connection of a process whose rdma_cm file
// closes, however it ended. Here a process of the device that holds a QP1
// agent sends them for one that died (CmConnectionTable); this watcher,
// one per UDP device, sends them when no such process is left on the host,
// so that a peer on another host never sees a killed process as connected.
// It receives nothing: its DREQs are resent until their retries run out,
// unless a process of the device takes the DREP in the meantime.
#include <fcntl.h>
#include <net/if.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <thread>

#include "cli_commands.h"
#include "device/cm_routing.h"
#include "device/device_memory.h"
#include "host/netdev.h"
#include "support/debug_log.h"
#include "udp/socket_util.h"
#include "wire/roce_headers.h"

namespace softverbs::cli {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

// Often while connections are recorded, as the agents' sweeps; seldom otherwise.
constexpr auto kSweepWhileConnected = std::chrono::milliseconds(250);
constexpr auto kSweepOtherwise = std::chrono::seconds(1);
// A watcher of a device that went down exits within kSweepOtherwise; one
// started by the next `up` waits that long for its lock.
constexpr auto kLockPatience = std::chrono::seconds(3);

fs::path lock_path(const DeviceConfig& config) { return config.runtime_dir / (config.name + ".cm-watcher"); }
fs::path memory_path(const DeviceConfig& config) { return config.runtime_dir / (config.name + ".mem"); }

// An exclusive lock on the watcher's lock file, held while it lives; an
// empty Fd if another holds it.
udp::Fd try_lock(const DeviceConfig& config) {
  udp::Fd fd(::open(lock_path(config).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (fd.get() >= 0 && ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) fd.reset();
  return fd;
}

// Sends `orphan`'s DREQ from its local address to QP1 of its peer, as one
// RoCE v2 datagram of its own (from a port of its own: the ICRC covers it).
void send_dreq(const CmConnectionTable::Entry& orphan, uint32_t scope_id) {
  using namespace wire;
  udp::Fd fd(udp::bind_udp(orphan.local_gid, 0, scope_id));
  if (fd.get() < 0) {
    debug_log("cm watcher: cannot send from %s: %s", format_address(orphan.local_gid).c_str(), strerror(errno));
    return;
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &length) != 0) return;
  const auto* as_v4 = reinterpret_cast<const sockaddr_in*>(&bound);
  const auto* as_v6 = reinterpret_cast<const sockaddr_in6*>(&bound);
  FlowAddress flow;
  flow.source = orphan.local_gid;
  flow.destination = orphan.peer_gid;
  flow.source_port = ntohs(bound.ss_family == AF_INET ? as_v4->sin_port : as_v6->sin6_port);
  flow.destination_port = kRoceV2Port;
  flow.traffic_class = orphan.traffic_class;
  const auto mad = orphan_dreq(orphan);
  TransportPacket packet;
  packet.bth.opcode = opcode(Service::Ud, op::kSendOnly);
  packet.bth.dest_qp = kGsiQpn;
  packet.deth = {wire::cm::kGsiQkey, kGsiQpn};
  packet.payload = mad;
  std::vector<uint8_t> datagram = build(packet);
  seal(flow, datagram);
  const udp::SocketAddressStorage to =
      udp::to_sockaddr(orphan.peer_gid, kRoceV2Port, udp::is_link_local(orphan.peer_gid) ? scope_id : 0);
  if (::sendto(fd.get(), datagram.data(), datagram.size(), 0, to.get(), to.length) < 0)
    debug_log("cm watcher: a DREQ to %s: %s", format_address(orphan.peer_gid).c_str(), strerror(errno));
}

}  // namespace

bool carries_udp(const DeviceConfig& config) {
  // Only `auto` asks the netdev; a netdev that is gone carries nothing.
  if (config.transport != TransportChoice::Auto) return softverbs::carries_udp(config.transport, false);
  const auto netdev = query_netdev(config.netdev);
  return netdev && softverbs::carries_udp(config.transport, netdev->is_loopback);
}

std::optional<pid_t> cm_watcher_pid(const DeviceConfig& config) {
  const udp::Fd fd(::open(lock_path(config).c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return std::nullopt;
  std::optional<pid_t> pid;
  if (::flock(fd.get(), LOCK_SH | LOCK_NB) != 0) {  // held: the watcher lives
    char text[16] = {};
    if (::pread(fd.get(), text, sizeof text - 1, 0) > 0) pid = static_cast<pid_t>(std::atoi(text));
  }
  return pid;
}

void start_cm_watcher(const DeviceConfig& config) {
  if (!carries_udp(config)) return;
  if (try_lock(config).get() < 0) return;  // a watcher lives
  char self[4096];
  const ssize_t length = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (length <= 0) return;
  self[length] = '\0';
  const pid_t child = ::fork();
  if (child < 0) return;
  if (child == 0) {
    // Detached twice over: no parent to reap it, no terminal, and none of
    // the caller's descriptors (a test reading `up`'s output waits for EOF).
    ::setsid();
    if (::fork() != 0) ::_exit(0);
    const int null = ::open("/dev/null", O_RDWR);
    for (int fd = 0; fd <= 2; ++fd) ::dup2(null, fd);
    ::close_range(3, ~0u, 0);
    ::signal(SIGHUP, SIG_IGN);
    ::execl(self, "softverbs", "cm-watcher", config.name.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
}

int command_cm_watcher(const std::string& name) {
  DeviceRegistry registry(default_runtime_dir());
  auto config = registry.find(name);
  if (!config) return kExitFailure;
  udp::Fd lock;
  for (const auto deadline = Clock::now() + kLockPatience; (lock = try_lock(*config)).get() < 0;) {
    if (Clock::now() >= deadline) return kExitOk;  // another watcher has the device
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  // Its pid, for `softverbs status`.
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(lock.get(), 0) != 0 || ::pwrite(lock.get(), pid.data(), pid.size(), 0) < 0) return kExitFailure;
  const uint32_t scope_id = ::if_nametoindex(config->netdev.c_str());
  std::shared_ptr<DeviceMemory> memory;
  ino_t memory_inode = 0;
  for (;;) {
    // Gone with `down`, or with its runtime directory; or moved to shared
    // memory, where its peers are on this host and see the death themselves.
    if (auto current = registry.find(name); !current || !carries_udp(*current)) break;
    struct stat file {};
    const bool exists = ::stat(memory_path(*config).c_str(), &file) == 0;
    if (memory && (!exists || file.st_ino != memory_inode || memory->shared().removed.load())) memory.reset();
    if (!memory && exists) {
      // The first process to open the device creates its memory.
      std::string error;
      memory = DeviceMemory::open(memory_path(*config), &error);
      memory_inode = file.st_ino;
    }
    bool connected = false;
    if (memory) {
      for (const CmConnectionTable::Entry& orphan : due_orphan_dreqs(*memory, Clock::now())) {
        debug_log("cm watcher: a DREQ for communication ID %#x, whose process died (%u more if unanswered)",
                  orphan.local_comm_id, orphan.dreqs_left);
        send_dreq(orphan, scope_id);
      }
      connected = cm_connections_recorded(*memory);
    }
    std::this_thread::sleep_for(connected ? kSweepWhileConnected : kSweepOtherwise);
  }
  return kExitOk;
}

}  // namespace softverbs::cli
