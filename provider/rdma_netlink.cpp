#include "rdma_netlink.h"

#include <dirent.h>
#include <dlfcn.h>
#include <linux/netlink.h>
#include <net/if.h>
#include <rdma/rdma_netlink.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "device/device_snapshot.h"

namespace softverbs::preload {

namespace {

// The emulated sockets, by descriptor and the socket's inode: a descriptor
// closed and reused for another socket is not mistaken for one.
struct EmulatedSocket {
  int fd;
  ino_t inode;
};
std::mutex sockets_lock;
std::vector<EmulatedSocket> sockets;
std::atomic<bool> any_socket{false};

ino_t inode_of(int fd) {
  struct stat status {};
  return fstat(fd, &status) == 0 ? status.st_ino : 0;
}

bool is_emulated(int fd) {
  if (!any_socket.load(std::memory_order_acquire)) return false;
  std::lock_guard guard(sockets_lock);
  auto found = std::find_if(sockets.begin(), sockets.end(), [fd](const EmulatedSocket& s) { return s.fd == fd; });
  if (found == sockets.end()) return false;
  if (inode_of(fd) == found->inode) return true;
  sockets.erase(found);
  return false;
}

// ---- the devices, as the program's sysfs tree shows them ---------------------

struct Port {
  uint32_t number = 0;
  uint8_t state = 0;           // IB port state: 4 ACTIVE
  uint8_t physical_state = 0;  // 5 LinkUp
  std::string netdev;
};

struct Device {
  uint32_t index = 0;
  std::string name;
  uint64_t node_guid = 0;
  uint64_t system_image_guid = 0;
  std::string firmware;
  uint8_t node_type = 0;
  std::vector<Port> ports;
  std::string memory_file;  // a softverbs device's memory; empty for a real device
};

std::string first_line(const std::string& path) {
  std::string line;
  if (FILE* file = std::fopen(path.c_str(), "re")) {
    char buffer[256];
    if (std::fgets(buffer, sizeof buffer, file) != nullptr) line = buffer;
    std::fclose(file);
  }
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line;
}

std::vector<std::string> names_in(const std::string& directory) {
  std::vector<std::string> names;
  if (DIR* dir = opendir(directory.c_str())) {
    while (const dirent* entry = readdir(dir))
      if (entry->d_name[0] != '.') names.emplace_back(entry->d_name);
    closedir(dir);
  }
  std::sort(names.begin(), names.end());
  return names;
}

uint64_t guid_of(const std::string& text) {
  std::string hex;
  for (char c : text)
    if (c != ':') hex += c;
  return std::strtoull(hex.c_str(), nullptr, 16);
}

// "4: ACTIVE" -> 4
uint8_t leading_number(const std::string& text) { return static_cast<uint8_t>(std::atoi(text.c_str())); }

// A softverbs device's sysfs directory holds its record (softverbs.conf),
// whose runtime_dir holds its memory; a real device's holds no record.
std::string memory_file_of(const std::string& device_dir) {
  std::string name, runtime_dir;
  if (FILE* file = std::fopen((device_dir + "/softverbs.conf").c_str(), "re")) {
    char buffer[4096];
    while (std::fgets(buffer, sizeof buffer, file) != nullptr) {
      std::string line = buffer;
      while (!line.empty() && line.back() == '\n') line.pop_back();
      if (line.starts_with("name=")) name = line.substr(5);
      if (line.starts_with("runtime_dir=")) runtime_dir = line.substr(12);
    }
    std::fclose(file);
  }
  return name.empty() || runtime_dir.empty() ? std::string() : runtime_dir + "/" + name + ".mem";
}

// Indexes follow the names' order, so they stay the same between the
// program's requests.
std::vector<Device> read_devices() {
  const char* sysfs = std::getenv("SYSFS_PATH");
  const std::string base = std::string(sysfs != nullptr && *sysfs != '\0' ? sysfs : "/sys") + "/class/infiniband";
  std::vector<Device> devices;
  for (const std::string& name : names_in(base)) {
    const std::string dir = base + "/" + name;
    Device device;
    device.index = static_cast<uint32_t>(devices.size() + 1);
    device.name = name;
    device.node_guid = guid_of(first_line(dir + "/node_guid"));
    device.system_image_guid = guid_of(first_line(dir + "/sys_image_guid"));
    device.firmware = first_line(dir + "/fw_ver");
    device.node_type = leading_number(first_line(dir + "/node_type"));
    device.memory_file = memory_file_of(dir);
    for (const std::string& number : names_in(dir + "/ports")) {
      Port port;
      port.number = static_cast<uint32_t>(std::strtoul(number.c_str(), nullptr, 10));
      if (port.number == 0) continue;
      const std::string port_dir = dir + "/ports/" + number;
      port.state = leading_number(first_line(port_dir + "/state"));
      port.physical_state = leading_number(first_line(port_dir + "/phys_state"));
      port.netdev = first_line(port_dir + "/gid_attrs/ndevs/0");
      device.ports.push_back(port);
    }
    std::sort(device.ports.begin(), device.ports.end(),
              [](const Port& a, const Port& b) { return a.number < b.number; });
    devices.push_back(device);
  }
  return devices;
}

// ---- messages -------------------------------------------------------------------

class Message {
 public:
  Message(uint16_t type, uint16_t flags, uint32_t sequence, uint32_t portid) : bytes_(NLMSG_HDRLEN, 0) {
    nlmsghdr header{};
    header.nlmsg_type = type;
    header.nlmsg_flags = flags;
    header.nlmsg_seq = sequence;
    header.nlmsg_pid = portid;
    std::memcpy(bytes_.data(), &header, sizeof header);
  }
  void put(uint16_t type, const void* data, size_t length) {
    const nlattr attribute{static_cast<uint16_t>(NLA_HDRLEN + length), type};
    const size_t at = bytes_.size();
    bytes_.resize(at + NLA_ALIGN(NLA_HDRLEN + length), 0);
    std::memcpy(bytes_.data() + at, &attribute, sizeof attribute);
    if (length != 0) std::memcpy(bytes_.data() + at + NLA_HDRLEN, data, length);
  }
  void put_u8(uint16_t type, uint8_t value) { put(type, &value, sizeof value); }
  void put_u32(uint16_t type, uint32_t value) { put(type, &value, sizeof value); }
  void put_u64(uint16_t type, uint64_t value) { put(type, &value, sizeof value); }
  void put_string(uint16_t type, const std::string& value) { put(type, value.c_str(), value.size() + 1); }
  // A nested attribute: its members follow, then end_nest closes it.
  size_t begin_nest(uint16_t type) {
    const size_t at = bytes_.size();
    put(static_cast<uint16_t>(type | NLA_F_NESTED), nullptr, 0);
    return at;
  }
  void end_nest(size_t at) {
    const auto length = static_cast<uint16_t>(bytes_.size() - at);
    std::memcpy(bytes_.data() + at + offsetof(nlattr, nla_len), &length, sizeof length);
  }
  void append(const void* data, size_t length) {
    const auto* first = static_cast<const uint8_t*>(data);
    bytes_.insert(bytes_.end(), first, first + length);
  }
  std::vector<uint8_t> finish() {
    const auto length = static_cast<uint32_t>(bytes_.size());
    std::memcpy(bytes_.data() + offsetof(nlmsghdr, nlmsg_len), &length, sizeof length);
    return std::move(bytes_);
  }

 private:
  std::vector<uint8_t> bytes_;
};

constexpr uint16_t nldev_type(uint16_t command) {
  return static_cast<uint16_t>(RDMA_NL_GET_TYPE(RDMA_NL_NLDEV, command));
}

// What the kernel answers for one device (RDMA_NLDEV_CMD_GET).
std::vector<uint8_t> device_message(const Device& device, uint16_t flags, const nlmsghdr& request) {
  Message message(request.nlmsg_type, flags, request.nlmsg_seq, request.nlmsg_pid);
  message.put_u32(RDMA_NLDEV_ATTR_DEV_INDEX, device.index);
  message.put_string(RDMA_NLDEV_ATTR_DEV_NAME, device.name);
  // For a device, the port index is its number of ports.
  message.put_u32(RDMA_NLDEV_ATTR_PORT_INDEX, device.ports.empty() ? 0 : device.ports.back().number);
  message.put_string(RDMA_NLDEV_ATTR_FW_VERSION, device.firmware);
  message.put_u64(RDMA_NLDEV_ATTR_NODE_GUID, device.node_guid);
  message.put_u64(RDMA_NLDEV_ATTR_SYS_IMAGE_GUID, device.system_image_guid);
  message.put_u8(RDMA_NLDEV_ATTR_DEV_NODE_TYPE, device.node_type);
  message.put_string(RDMA_NLDEV_ATTR_DEV_PROTOCOL, "roce");
  return message.finish();
}

// What the kernel answers for one port (RDMA_NLDEV_CMD_PORT_GET).
std::vector<uint8_t> port_message(const Device& device, const Port& port, uint16_t flags, const nlmsghdr& request) {
  Message message(request.nlmsg_type, flags, request.nlmsg_seq, request.nlmsg_pid);
  message.put_u32(RDMA_NLDEV_ATTR_DEV_INDEX, device.index);
  message.put_string(RDMA_NLDEV_ATTR_DEV_NAME, device.name);
  message.put_u32(RDMA_NLDEV_ATTR_PORT_INDEX, port.number);
  message.put_u8(RDMA_NLDEV_ATTR_PORT_STATE, port.state);
  message.put_u8(RDMA_NLDEV_ATTR_PORT_PHYS_STATE, port.physical_state);
  if (!port.netdev.empty()) {
    const unsigned interface = if_nametoindex(port.netdev.c_str());
    if (interface != 0) {
      message.put_u32(RDMA_NLDEV_ATTR_NDEV_INDEX, interface);
      message.put_string(RDMA_NLDEV_ATTR_NDEV_NAME, port.netdev);
    }
  }
  return message.finish();
}

std::vector<uint8_t> error_message(int error, const nlmsghdr& request) {
  Message message(NLMSG_ERROR, 0, request.nlmsg_seq, request.nlmsg_pid);
  const int32_t code = -error;
  message.append(&code, sizeof code);
  message.append(&request, sizeof request);  // the request's header only, as with NETLINK_CAP_ACK
  return message.finish();
}

std::vector<uint8_t> done_message(const nlmsghdr& request) {
  Message message(NLMSG_DONE, NLM_F_MULTI, request.nlmsg_seq, request.nlmsg_pid);
  const int32_t status = 0;
  message.append(&status, sizeof status);
  return message.finish();
}

// ---- what the device holds and counts (its memory, read-only) ----------------

// The kernel's enum ib_qp_type, as RDMA_NLDEV_ATTR_RES_TYPE carries it.
uint8_t kernel_qp_type(const QpSnapshot& qp) {
  constexpr uint8_t kGsi = 1, kRc = 2, kUc = 3, kUd = 4, kXrcInitiator = 9, kXrcTarget = 10;
  if (qp.cm_agent) return kGsi;
  if (qp.xrc == XrcRole::Send) return kXrcInitiator;
  if (qp.xrc == XrcRole::Recv) return kXrcTarget;
  switch (qp.type) {
    case QpType::Rc:
      return kRc;
    case QpType::Uc:
      return kUc;
    case QpType::Ud:
      return kUd;
  }
  return kUd;
}

void put_device(Message& message, const Device& device) {
  message.put_u32(RDMA_NLDEV_ATTR_DEV_INDEX, device.index);
  message.put_string(RDMA_NLDEV_ATTR_DEV_NAME, device.name);
}

// A nested table of named u64 values, the shape of both the resource
// summary and the hardware counters.
struct NamedValueAttributes {
  uint16_t table, entry, name, value;
};
void put_named_values(Message& message, const NamedValueAttributes& types,
                      std::span<const std::pair<std::string, uint64_t>> values) {
  const size_t table = message.begin_nest(types.table);
  for (const auto& [name, value] : values) {
    const size_t entry = message.begin_nest(types.entry);
    message.put_string(types.name, name);
    message.put_u64(types.value, value);
    message.end_nest(entry);
  }
  message.end_nest(table);
}

// RDMA_NLDEV_CMD_RES_GET: how many objects of each kind the device holds.
std::vector<uint8_t> summary_message(const Device& device, const DeviceSnapshot& snapshot, const nlmsghdr& request) {
  Message message(request.nlmsg_type, 0, request.nlmsg_seq, request.nlmsg_pid);
  put_device(message, device);
  const std::pair<std::string, uint64_t> counts[] = {{"cq", snapshot.cqs.size()},
                                                     {"qp", snapshot.qps.size()},
                                                     {"mr", snapshot.mrs.size()},
                                                     {"srq", snapshot.srqs.size()},
                                                     {"ctx", snapshot.contexts.size()}};
  put_named_values(message,
                   {RDMA_NLDEV_ATTR_RES_SUMMARY, RDMA_NLDEV_ATTR_RES_SUMMARY_ENTRY,
                    RDMA_NLDEV_ATTR_RES_SUMMARY_ENTRY_NAME, RDMA_NLDEV_ATTR_RES_SUMMARY_ENTRY_CURR},
                   counts);
  return message.finish();
}

// A resource dump (RES_QP_GET, RES_CQ_GET, ...): `items` as entries of nested
// table `table`, 32 to a message so that each fits the tool's receive buffer.
template <typename Item, typename PutEntry>
std::vector<std::vector<uint8_t>> dump_messages(const Device& device, const std::vector<Item>& items,
                                                uint16_t table_type, uint16_t entry_type, const nlmsghdr& request,
                                                PutEntry put_entry) {
  constexpr size_t kEntriesPerMessage = 32;
  std::vector<std::vector<uint8_t>> messages;
  for (size_t first = 0; first < items.size(); first += kEntriesPerMessage) {
    Message message(request.nlmsg_type, NLM_F_MULTI, request.nlmsg_seq, request.nlmsg_pid);
    put_device(message, device);
    const size_t table = message.begin_nest(table_type);
    for (size_t i = first; i < std::min(items.size(), first + kEntriesPerMessage); ++i) {
      const size_t entry = message.begin_nest(entry_type);
      put_entry(message, items[i]);
      message.end_nest(entry);
    }
    message.end_nest(table);
    messages.push_back(message.finish());
  }
  messages.push_back(done_message(request));
  return messages;
}

void put_qp(Message& message, const QpSnapshot& qp) {
  message.put_u32(RDMA_NLDEV_ATTR_PORT_INDEX, 1);
  message.put_u32(RDMA_NLDEV_ATTR_RES_LQPN, qp.qpn);
  // As the kernel: a connected QP's remote QPN, receive PSN and path
  // migration state (always migrated: no alternate paths).
  if (qp.type != QpType::Ud && !qp.cm_agent) {
    message.put_u32(RDMA_NLDEV_ATTR_RES_RQPN, qp.dest_qpn);
    message.put_u32(RDMA_NLDEV_ATTR_RES_RQ_PSN, qp.rq_psn);
    message.put_u8(RDMA_NLDEV_ATTR_RES_PATH_MIG_STATE, 0);
  }
  message.put_u32(RDMA_NLDEV_ATTR_RES_SQ_PSN, qp.sq_psn);
  message.put_u8(RDMA_NLDEV_ATTR_RES_TYPE, kernel_qp_type(qp));
  message.put_u8(RDMA_NLDEV_ATTR_RES_STATE, static_cast<uint8_t>(qp.state));
  message.put_u32(RDMA_NLDEV_ATTR_RES_PID, static_cast<uint32_t>(qp.pid));
  message.put_u32(RDMA_NLDEV_ATTR_RES_PDN, qp.pd_handle);
}

void put_cq(Message& message, const CqSnapshot& cq) {
  message.put_u32(RDMA_NLDEV_ATTR_RES_CQE, cq.cqe);
  message.put_u64(RDMA_NLDEV_ATTR_RES_USECNT, cq.users);
  message.put_u32(RDMA_NLDEV_ATTR_RES_PID, static_cast<uint32_t>(cq.pid));
  message.put_u32(RDMA_NLDEV_ATTR_RES_CQN, cq.cqn);
}

void put_srq(Message& message, const SrqSnapshot& srq) {
  message.put_u32(RDMA_NLDEV_ATTR_RES_SRQN, srq.srqn);
  message.put_u8(RDMA_NLDEV_ATTR_RES_TYPE, srq.xrc ? 1 : 0);  // the kernel's IB_SRQT_BASIC, IB_SRQT_XRC
  message.put_u32(RDMA_NLDEV_ATTR_RES_PDN, srq.pd_handle);
  if (srq.cqn >= 0) message.put_u32(RDMA_NLDEV_ATTR_RES_CQN, static_cast<uint32_t>(srq.cqn));
  // Its QPs, a range for each run of consecutive QPNs, as the kernel sends them.
  const size_t table = message.begin_nest(RDMA_NLDEV_ATTR_RES_QP);
  for (size_t first = 0; first < srq.qpns.size();) {
    size_t last = first;
    while (last + 1 < srq.qpns.size() && srq.qpns[last + 1] == srq.qpns[last] + 1) ++last;
    const size_t entry = message.begin_nest(RDMA_NLDEV_ATTR_RES_QP_ENTRY);
    if (last == first) {
      message.put_u32(RDMA_NLDEV_ATTR_RES_LQPN, srq.qpns[first]);
    } else {
      message.put_u32(RDMA_NLDEV_ATTR_MIN_RANGE, srq.qpns[first]);
      message.put_u32(RDMA_NLDEV_ATTR_MAX_RANGE, srq.qpns[last]);
    }
    message.end_nest(entry);
    first = last + 1;
  }
  message.end_nest(table);
  message.put_u32(RDMA_NLDEV_ATTR_RES_PID, static_cast<uint32_t>(srq.pid));
}

void put_context(Message& message, const ContextSnapshot& context) {
  message.put_u32(RDMA_NLDEV_ATTR_RES_CTXN, context.ctxn);
  message.put_u32(RDMA_NLDEV_ATTR_RES_PID, static_cast<uint32_t>(context.pid));
}

// As the kernel: the keys and the address of a region only to a caller
// with CAP_NET_ADMIN in the initial user namespace (the rkey is what a peer
// needs to reach it); a rootless container's root has it in its own only.
bool has_net_admin() {
  constexpr char kInitialUserNamespace[] = "user:[4026531837]";  // the kernel's PROC_USER_INIT_INO
  char user_namespace[64] = {};
  if (::readlink("/proc/self/ns/user", user_namespace, sizeof user_namespace - 1) < 0 ||
      std::strcmp(user_namespace, kInitialUserNamespace) != 0)
    return false;
  FILE* status = std::fopen("/proc/self/status", "re");
  if (status == nullptr) return false;
  constexpr unsigned kCapNetAdmin = 12;
  bool has = false;
  char line[256];
  while (std::fgets(line, sizeof line, status) != nullptr) {
    if (std::strncmp(line, "CapEff:", 7) != 0) continue;
    has = (std::strtoull(line + 7, nullptr, 16) >> kCapNetAdmin & 1) != 0;
    break;
  }
  std::fclose(status);
  return has;
}

void put_mr(Message& message, const MrSnapshot& mr, bool privileged) {
  if (privileged) {
    message.put_u32(RDMA_NLDEV_ATTR_RES_RKEY, mr.key);
    message.put_u32(RDMA_NLDEV_ATTR_RES_LKEY, mr.key);
    message.put_u64(RDMA_NLDEV_ATTR_RES_IOVA, mr.iova);
  }
  message.put_u64(RDMA_NLDEV_ATTR_RES_MRLEN, mr.length);
  message.put_u32(RDMA_NLDEV_ATTR_RES_MRN, mr.mrn);
  message.put_u32(RDMA_NLDEV_ATTR_RES_PDN, mr.pd_handle);
  message.put_u32(RDMA_NLDEV_ATTR_RES_PID, static_cast<uint32_t>(mr.pid));
}

// RDMA_NLDEV_CMD_STAT_GET of a port: the device's counters, as an HCA's
// port hardware counters.
std::vector<uint8_t> counters_message(const Device& device, uint32_t port, const DeviceSnapshot& snapshot,
                                      const nlmsghdr& request) {
  Message message(request.nlmsg_type, 0, request.nlmsg_seq, request.nlmsg_pid);
  put_device(message, device);
  message.put_u32(RDMA_NLDEV_ATTR_PORT_INDEX, port);
  put_named_values(message,
                   {RDMA_NLDEV_ATTR_STAT_HWCOUNTERS, RDMA_NLDEV_ATTR_STAT_HWCOUNTER_ENTRY,
                    RDMA_NLDEV_ATTR_STAT_HWCOUNTER_ENTRY_NAME, RDMA_NLDEV_ATTR_STAT_HWCOUNTER_ENTRY_VALUE},
                   snapshot.counters);
  return message.finish();
}

// The payload of a request's attribute `type`, if it has it.
std::optional<std::span<const uint8_t>> find_attribute(const nlmsghdr& request, uint16_t type) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(&request);
  size_t at = NLMSG_HDRLEN;
  while (at + NLA_HDRLEN <= request.nlmsg_len) {
    nlattr attribute;
    std::memcpy(&attribute, bytes + at, sizeof attribute);
    if (attribute.nla_len < NLA_HDRLEN || at + attribute.nla_len > request.nlmsg_len) return std::nullopt;
    if ((attribute.nla_type & NLA_TYPE_MASK) == type)
      return std::span<const uint8_t>(bytes + at + NLA_HDRLEN, attribute.nla_len - NLA_HDRLEN);
    at += NLA_ALIGN(attribute.nla_len);
  }
  return std::nullopt;
}

bool has_attribute(const nlmsghdr& request, uint16_t type) { return find_attribute(request, type).has_value(); }

// The u32 attribute `type` of a request, if it has it.
bool u32_attribute(const nlmsghdr& request, uint16_t type, uint32_t* value) {
  const auto payload = find_attribute(request, type);
  if (!payload || payload->size() != sizeof *value) return false;
  std::memcpy(value, payload->data(), sizeof *value);
  return true;
}

// The answers to RES_GET, the QP, CQ, MR, SRQ and context dumps, and STAT_GET about a softverbs device,
// from its memory; nullopt where softverbs does not answer the request (a
// real device, per-QP counters, counter modes).
std::optional<std::vector<std::vector<uint8_t>>> resource_answers(const nlmsghdr& request, const Device& device,
                                                                  bool dump, bool acknowledge) {
  const uint16_t type = request.nlmsg_type;
  const bool summary = type == nldev_type(RDMA_NLDEV_CMD_RES_GET) && !dump;
  const bool qps = type == nldev_type(RDMA_NLDEV_CMD_RES_QP_GET) && dump;
  const bool cqs = type == nldev_type(RDMA_NLDEV_CMD_RES_CQ_GET) && dump;
  const bool mrs = type == nldev_type(RDMA_NLDEV_CMD_RES_MR_GET) && dump;
  const bool srqs = type == nldev_type(RDMA_NLDEV_CMD_RES_SRQ_GET) && dump;
  const bool contexts = type == nldev_type(RDMA_NLDEV_CMD_RES_CTX_GET) && dump;
  const bool counters =
      type == nldev_type(RDMA_NLDEV_CMD_STAT_GET) && !dump && !has_attribute(request, RDMA_NLDEV_ATTR_STAT_MODE) &&
      !has_attribute(request, RDMA_NLDEV_ATTR_STAT_RES) && !has_attribute(request, RDMA_NLDEV_ATTR_STAT_COUNTER_ID);
  if ((!summary && !qps && !cqs && !mrs && !srqs && !contexts && !counters) || device.memory_file.empty())
    return std::nullopt;
  std::string error;
  const std::optional<DeviceSnapshot> snapshot = read_device_snapshot(device.memory_file, &error);
  if (!snapshot) return std::vector<std::vector<uint8_t>>{error_message(ENODEV, request)};
  std::vector<std::vector<uint8_t>> answers;
  if (summary) answers.push_back(summary_message(device, *snapshot, request));
  if (counters) {
    uint32_t port = 0;
    u32_attribute(request, RDMA_NLDEV_ATTR_PORT_INDEX, &port);
    if (std::none_of(device.ports.begin(), device.ports.end(), [&](const Port& p) { return p.number == port; }))
      return std::vector<std::vector<uint8_t>>{error_message(EINVAL, request)};
    answers.push_back(counters_message(device, port, *snapshot, request));
  }
  if (qps) {
    answers =
        dump_messages(device, snapshot->qps, RDMA_NLDEV_ATTR_RES_QP, RDMA_NLDEV_ATTR_RES_QP_ENTRY, request, put_qp);
  } else if (cqs) {
    answers =
        dump_messages(device, snapshot->cqs, RDMA_NLDEV_ATTR_RES_CQ, RDMA_NLDEV_ATTR_RES_CQ_ENTRY, request, put_cq);
  } else if (mrs) {
    const bool privileged = has_net_admin();
    answers = dump_messages(device, snapshot->mrs, RDMA_NLDEV_ATTR_RES_MR, RDMA_NLDEV_ATTR_RES_MR_ENTRY, request,
                            [&](Message& message, const MrSnapshot& mr) { put_mr(message, mr, privileged); });
  } else if (srqs) {
    answers =
        dump_messages(device, snapshot->srqs, RDMA_NLDEV_ATTR_RES_SRQ, RDMA_NLDEV_ATTR_RES_SRQ_ENTRY, request, put_srq);
  } else if (contexts) {
    answers = dump_messages(device, snapshot->contexts, RDMA_NLDEV_ATTR_RES_CTX, RDMA_NLDEV_ATTR_RES_CTX_ENTRY, request,
                            put_context);
  } else if (acknowledge) {
    answers.push_back(error_message(0, request));
  }
  return answers;
}

// The kernel's answers to one request: GET and PORT_GET, one object or a
// dump; a softverbs device's resources and counters; anything else is not
// supported.
std::vector<std::vector<uint8_t>> answers_to(const nlmsghdr& request) {
  std::vector<std::vector<uint8_t>> answers;
  const bool dump = (request.nlmsg_flags & NLM_F_DUMP) == NLM_F_DUMP;
  const bool acknowledge = (request.nlmsg_flags & NLM_F_ACK) != 0;
  const std::vector<Device> devices = read_devices();
  uint32_t device_index = 0;
  const bool named = u32_attribute(request, RDMA_NLDEV_ATTR_DEV_INDEX, &device_index);
  const auto device =
      std::find_if(devices.begin(), devices.end(), [&](const Device& d) { return named && d.index == device_index; });
  if (request.nlmsg_type == nldev_type(RDMA_NLDEV_CMD_GET) && dump) {
    for (const Device& each : devices) answers.push_back(device_message(each, NLM_F_MULTI, request));
    answers.push_back(done_message(request));
  } else if (request.nlmsg_type == nldev_type(RDMA_NLDEV_CMD_GET)) {
    if (device == devices.end()) return {error_message(EINVAL, request)};
    answers.push_back(device_message(*device, 0, request));
    if (acknowledge) answers.push_back(error_message(0, request));
  } else if (request.nlmsg_type == nldev_type(RDMA_NLDEV_CMD_PORT_GET)) {
    if (device == devices.end()) return {error_message(EINVAL, request)};
    if (dump) {
      for (const Port& port : device->ports) answers.push_back(port_message(*device, port, NLM_F_MULTI, request));
      answers.push_back(done_message(request));
    } else {
      uint32_t port_number = 0;
      u32_attribute(request, RDMA_NLDEV_ATTR_PORT_INDEX, &port_number);
      const auto port = std::find_if(device->ports.begin(), device->ports.end(),
                                     [&](const Port& p) { return p.number == port_number; });
      if (port == device->ports.end()) return {error_message(EINVAL, request)};
      answers.push_back(port_message(*device, *port, 0, request));
      if (acknowledge) answers.push_back(error_message(0, request));
    }
  } else if (auto resources =
                 device != devices.end() ? resource_answers(request, *device, dump, acknowledge) : std::nullopt) {
    answers = std::move(*resources);
  } else {
    answers.push_back(error_message(EOPNOTSUPP, request));
  }
  return answers;
}

// The socket's own address: the answers are sent to it from itself.
bool own_address(int fd, sockaddr_nl* address) {
  socklen_t length = sizeof *address;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(address), &length) != 0) return false;
  if (address->nl_pid != 0) return true;
  const sockaddr_nl any{AF_NETLINK, 0, 0, 0};  // not bound yet: let the kernel pick its port id
  if (bind(fd, reinterpret_cast<const sockaddr*>(&any), sizeof any) != 0) return false;
  length = sizeof *address;
  return getsockname(fd, reinterpret_cast<sockaddr*>(address), &length) == 0 && address->nl_pid != 0;
}

}  // namespace

int open_emulated_rdma_netlink(int type) {
  const int fd = static_cast<int>(syscall(SYS_socket, AF_NETLINK, type, NETLINK_USERSOCK));
  if (fd < 0) return -1;
  const ino_t inode = inode_of(fd);
  std::lock_guard guard(sockets_lock);
  std::erase_if(sockets, [fd](const EmulatedSocket& s) { return s.fd == fd; });
  sockets.push_back({fd, inode});
  any_socket.store(true, std::memory_order_release);
  return fd;
}

bool answer_if_emulated(int fd, std::span<const iovec> request, ssize_t* sent) {
  if (!is_emulated(fd)) return false;
  sockaddr_nl self{};
  if (!own_address(fd, &self)) {
    *sent = -1;
    return true;
  }
  std::vector<uint8_t> joined;
  for (const iovec& piece : request) {
    const auto* base = static_cast<const uint8_t*>(piece.iov_base);
    joined.insert(joined.end(), base, base + piece.iov_len);
  }
  const uint8_t* bytes = joined.data();
  const size_t length = joined.size();
  size_t at = 0;
  while (at + NLMSG_HDRLEN <= length) {
    nlmsghdr header;
    std::memcpy(&header, bytes + at, sizeof header);
    if (header.nlmsg_len < NLMSG_HDRLEN || at + header.nlmsg_len > length) break;
    std::vector<uint8_t> copy(bytes + at, bytes + at + header.nlmsg_len);
    auto* parsed = reinterpret_cast<nlmsghdr*>(copy.data());
    if (parsed->nlmsg_pid == 0) parsed->nlmsg_pid = self.nl_pid;  // answers carry the requester's port id
    for (const std::vector<uint8_t>& answer : answers_to(*parsed)) {
      // Straight to the kernel: the answer is this socket's to itself.
      if (syscall(SYS_sendto, fd, answer.data(), answer.size(), 0, reinterpret_cast<const sockaddr*>(&self),
                  sizeof self) < 0) {
        *sent = -1;
        return true;
      }
    }
    at += NLMSG_ALIGN(header.nlmsg_len);
  }
  *sent = static_cast<ssize_t>(length);
  return true;
}

bool called_from_verbs_library(const void* caller) {
  Dl_info info{};
  if (caller == nullptr || dladdr(caller, &info) == 0 || info.dli_fname == nullptr) return false;
  const char* slash = std::strrchr(info.dli_fname, '/');
  const char* name = slash != nullptr ? slash + 1 : info.dli_fname;
  return std::strncmp(name, "libnl-", 6) == 0 || std::strncmp(name, "libibverbs", 10) == 0;
}

}  // namespace softverbs::preload
