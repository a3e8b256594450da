// Unit tests of the device model: GIDs, device records, attributes, the GID
// table and the generated sysfs tree.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "device/device_attributes.h"
#include "device/device_limits.h"
#include "device/device_memory.h"
#include "device/device_snapshot.h"
#include "device/shared_mutex.h"
#include "device/transport_counters.h"
#include "host/device_config.h"
#include "host/device_registry.h"
#include "host/sysfs_tree.h"
#include "process_runner.h"
#include "support/file_util.h"

namespace softverbs {
namespace {

namespace fs = std::filesystem;
using test::TemporaryDirectory;

TEST(TransportCounters, EachProcessAddsToItsOwnSlotAndTheDeviceSumsThem) {
  auto counters = std::make_unique<TransportCounters>();
  CounterSlot& mine = counters->claim(getpid());
  EXPECT_EQ(&counters->claim(getpid()), &mine) << "a process keeps its slot";
  // A process that has exited: reaped, so its pid names no one.
  pid_t gone = fork();
  if (gone == 0) _exit(0);
  ASSERT_GT(gone, 0);
  waitpid(gone, nullptr, 0);
  CounterSlot& theirs = counters->claim(gone);
  EXPECT_NE(&theirs, &mine) << "two processes, two slots (two cache lines)";
  EXPECT_EQ(reinterpret_cast<uintptr_t>(&theirs) % 64, 0u);
  mine.add(Counter::RxPackets, 3);
  theirs.add(Counter::RxPackets, 4);
  theirs.add(Counter::TxBytes, 100);
  EXPECT_EQ(counters->get(Counter::RxPackets), 7u);
  EXPECT_EQ(counters->get(Counter::TxBytes), 100u);
  // The exited owner's slot goes to the next process; its counts stay in the sum.
  pid_t parent = getppid();
  CounterSlot& next = counters->claim(parent);
  EXPECT_EQ(&next, &theirs);
  next.add(Counter::RxPackets, 1);
  EXPECT_EQ(counters->get(Counter::RxPackets), 8u);
  EXPECT_EQ(counters->get(Counter::TxBytes), 100u);
  counters->reset();
  EXPECT_EQ(counters->get(Counter::RxPackets), 0u);
  EXPECT_EQ(counters->get(Counter::TxBytes), 0u);
}

// What `rdma resource` and `rdma statistic` are answered from: a read-only
// look that sees the live QPs and the counters, and refuses a file that is
// no device memory of this version with a reason.
TEST(DeviceSnapshot, SeesLiveQpsAndCountersAndRefusesOtherFiles) {
  TemporaryDirectory dir;
  const fs::path file = dir.path() + "/softverbs0.mem";
  std::string error;
  auto memory = DeviceMemory::open(file, &error);
  ASSERT_TRUE(memory) << error;
  memory->shared().counters.claim(getpid()).add(Counter::RxPackets, 7);
  const int index = memory->allocate_qp();
  ASSERT_GE(index, 0);
  QpRecord& qp = memory->shared().qps[index];
  const int cq_index = memory->allocate_cq();
  ASSERT_GE(cq_index, 0);
  memory->shared().cqs[cq_index].ring.producer.capacity = 64;
  qp.send_cq = qp.recv_cq = cq_index;
  qp.type = QpType::Uc;
  const int srq_index = memory->allocate_srq();
  ASSERT_GE(srq_index, 0);
  SrqRecord& srq = memory->shared().srqs[srq_index];
  srq.pd_handle = 5;
  qp.srq = srq_index;
  qp.attributes.dest_qpn = 0x1234;
  qp.attributes.sq_psn = 99;
  set_state(qp, QpState::Rts);

  auto snapshot = read_device_snapshot(file, &error);
  ASSERT_TRUE(snapshot) << error;
  ASSERT_EQ(snapshot->qps.size(), 1u);
  EXPECT_EQ(snapshot->qps[0].qpn, qp.qpn);
  EXPECT_EQ(snapshot->qps[0].type, QpType::Uc);
  EXPECT_EQ(snapshot->qps[0].state, QpState::Rts);
  EXPECT_EQ(snapshot->qps[0].dest_qpn, 0x1234u);
  EXPECT_EQ(snapshot->qps[0].sq_psn, 99u);
  EXPECT_EQ(snapshot->qps[0].pid, getpid());
  ASSERT_EQ(snapshot->contexts.size(), 1u);
  EXPECT_EQ(snapshot->contexts[0].ctxn, static_cast<uint32_t>(memory->process_slot()));
  EXPECT_EQ(snapshot->contexts[0].pid, getpid());
  ASSERT_EQ(snapshot->srqs.size(), 1u);
  EXPECT_EQ(snapshot->srqs[0].srqn, srq.srqn);
  EXPECT_FALSE(snapshot->srqs[0].xrc);
  EXPECT_EQ(snapshot->srqs[0].pd_handle, 5u);
  EXPECT_EQ(snapshot->srqs[0].cqn, -1) << "a basic SRQ has no CQ of its own";
  EXPECT_EQ(snapshot->srqs[0].qpns, std::vector<uint32_t>{qp.qpn});
  ASSERT_EQ(snapshot->cqs.size(), 1u);
  EXPECT_EQ(snapshot->cqs[0].cqn, static_cast<uint32_t>(cq_index));
  EXPECT_EQ(snapshot->cqs[0].cqe, 64u);
  EXPECT_EQ(snapshot->cqs[0].users, 2u) << "the QP's send and receive CQ";
  EXPECT_EQ(snapshot->cqs[0].pid, getpid());
  ASSERT_EQ(snapshot->counters.size(), kCounterCount);
  const auto rx = std::find_if(snapshot->counters.begin(), snapshot->counters.end(),
                               [](const auto& counter) { return counter.first == "rx_packets"; });
  ASSERT_NE(rx, snapshot->counters.end());
  EXPECT_EQ(rx->second, 7u);

  // Regions of live processes are listed, windows and the regions of
  // records no live process holds are not.
  std::optional<uint32_t> key, window, orphan;
  {
    ExclusiveLock lock(memory->shared().memory_lock);
    key = memory->shared().mrs.register_region(3, getpid(), 0x10000, 0x2000, 4096, access::kLocalWrite, {},
                                               memory->process_slot());
    window = memory->shared().mrs.allocate_window(3, getpid(), memory->process_slot(), 2);
    orphan = memory->shared().mrs.register_region(3, 1, 0x30000, 0x30000, 64, 0, {}, -1);
  }
  ASSERT_TRUE(key && window && orphan);
  snapshot = read_device_snapshot(file, &error);
  ASSERT_TRUE(snapshot) << error;
  ASSERT_EQ(snapshot->mrs.size(), 1u);
  EXPECT_EQ(snapshot->mrs[0].key, *key);
  EXPECT_EQ(snapshot->mrs[0].pd_handle, 3u);
  EXPECT_EQ(snapshot->mrs[0].iova, 0x2000u);
  EXPECT_EQ(snapshot->mrs[0].length, 4096u);
  EXPECT_EQ(snapshot->mrs[0].pid, getpid());
  {
    ExclusiveLock lock(memory->shared().memory_lock);
    ASSERT_TRUE(memory->shared().mrs.deregister(*key));
  }
  EXPECT_TRUE(read_device_snapshot(file, &error)->mrs.empty());

  qp.live = 0;  // destroyed: no longer listed
  snapshot = read_device_snapshot(file, &error);
  ASSERT_TRUE(snapshot) << error;
  EXPECT_TRUE(snapshot->qps.empty());
  ASSERT_EQ(snapshot->cqs.size(), 1u);
  EXPECT_EQ(snapshot->cqs[0].users, 0u);

  EXPECT_FALSE(read_device_snapshot(dir.path() + "/nosuchdevice.mem", &error));
  EXPECT_NE(error.find("No such file or directory"), std::string::npos) << error;
  // A device memory file of another layout version (sparse: only its header written).
  const fs::path other = dir.path() + "/other.mem";
  {
    FILE* f = std::fopen(other.c_str(), "w");
    ASSERT_NE(f, nullptr);
    const uint64_t magic = kDeviceMemoryMagic;
    const uint32_t wrong_version = kDeviceMemoryVersion + 1;
    std::fwrite(&magic, sizeof magic, 1, f);
    std::fwrite(&wrong_version, sizeof wrong_version, 1, f);
    std::fclose(f);
    fs::resize_file(other, sizeof(DeviceShared));
  }
  EXPECT_FALSE(read_device_snapshot(other, &error));
  EXPECT_NE(error.find("not a softverbs device memory file of this version"), std::string::npos) << error;
  fs::resize_file(other, 4096);
  EXPECT_FALSE(read_device_snapshot(other, &error));
  EXPECT_NE(error.find("too short"), std::string::npos) << error;
}

TEST(TransportCounters, ProcessesPastTheSlotsShareTheLastOne) {
  auto counters = std::make_unique<TransportCounters>();
  // Every slot held by a live process that is not us.
  for (CounterSlot& slot : counters->slots) slot.owner_pid = getppid();
  CounterSlot& shared = counters->claim(getpid());
  EXPECT_EQ(&shared, &counters->slots.back());
  shared.add(Counter::TxPackets, 2);
  EXPECT_EQ(counters->get(Counter::TxPackets), 2u) << "nothing lost";
}

TEST(Gid, Ipv4MappedFormat) {
  const uint8_t address[4] = {192, 168, 7, 1};
  Gid gid = Gid::from_ipv4(std::span<const uint8_t, 4>(address));
  EXPECT_EQ(gid.to_sysfs_string(), "0000:0000:0000:0000:0000:ffff:c0a8:0701");
}

TEST(Gid, LinkLocalFromMacFlipsUniversalBit) {
  const uint8_t mac[6] = {0x52, 0x54, 0x00, 0x12, 0x34, 0x56};
  Gid gid = Gid::link_local_from_mac(std::span<const uint8_t, 6>(mac));
  EXPECT_EQ(gid.to_sysfs_string(), "fe80:0000:0000:0000:5054:00ff:fe12:3456");
}

TEST(Gid, SysfsStringRoundTripsAndRejectsGarbage) {
  auto gid = Gid::from_sysfs_string("fe80:0000:0000:0000:5054:00ff:fe12:3456");
  ASSERT_TRUE(gid.has_value());
  EXPECT_EQ(gid->raw[0], 0xfe);
  EXPECT_EQ(gid->raw[15], 0x56);
  EXPECT_EQ(gid->to_sysfs_string(), "fe80:0000:0000:0000:5054:00ff:fe12:3456");
  EXPECT_FALSE(Gid::from_sysfs_string("fe80::1"));
  EXPECT_FALSE(Gid::from_sysfs_string("fe80:0000:0000:0000:5054:00ff:fe12:345g"));
  EXPECT_FALSE(Gid::from_sysfs_string("fe80-0000:0000:0000:5054:00ff:fe12:3456"));
}

TEST(DeviceConfig, SerializeParseRoundTrip) {
  DeviceConfig config;
  config.name = "dev_1";
  config.netdev = "veth0";
  config.uverbs_index = 65;
  config.node_guid = 0x0202c9fffe001234ull;
  config.netdev_mtu = 1500;
  config.transport = TransportChoice::Udp;
  config.runtime_dir = "/run/softverbs";
  std::string error;
  auto parsed = DeviceConfig::parse(config.serialize(), &error);
  ASSERT_TRUE(parsed) << error;
  EXPECT_EQ(parsed->name, "dev_1");
  EXPECT_EQ(parsed->netdev, "veth0");
  EXPECT_EQ(parsed->uverbs_index, 65);
  EXPECT_EQ(parsed->node_guid, 0x0202c9fffe001234ull);
  EXPECT_EQ(parsed->netdev_mtu, 1500u);
  EXPECT_EQ(parsed->transport, TransportChoice::Udp);
  EXPECT_EQ(parsed->runtime_dir, "/run/softverbs");
  EXPECT_EQ(parsed->uverbs_name(), "uverbs65");
}

TEST(DeviceConfig, ParseNamesTheBadLine) {
  std::string error;
  EXPECT_FALSE(DeviceConfig::parse("name=a\nuverbs_index=x\nnode_guid=0000:0000:0000:0001\n", &error));
  EXPECT_NE(error.find("line 2"), std::string::npos) << error;
  EXPECT_FALSE(DeviceConfig::parse("name=a\nnode_guid=0000:0000:0000:0001\n", &error));
  EXPECT_NE(error.find("incomplete"), std::string::npos) << error;
  EXPECT_FALSE(DeviceConfig::parse("name=../etc\nuverbs_index=1\nnode_guid=0000:0000:0000:0001\n", &error));
  EXPECT_FALSE(DeviceConfig::parse("transport=carrier-pigeon\n", &error));
  EXPECT_NE(error.find("transport"), std::string::npos) << error;
}

TEST(DeviceConfig, DeviceNameRules) {
  EXPECT_TRUE(is_valid_device_name("softverbs0"));
  EXPECT_TRUE(is_valid_device_name("a.b-c_d"));
  EXPECT_FALSE(is_valid_device_name(""));
  EXPECT_FALSE(is_valid_device_name(".."));
  EXPECT_FALSE(is_valid_device_name("a/b"));
  EXPECT_FALSE(is_valid_device_name("has space"));
  EXPECT_FALSE(is_valid_device_name(std::string(64, 'x')));
  EXPECT_FALSE(is_valid_device_name("-x")) << "would read as an option";
  EXPECT_FALSE(is_valid_device_name(".hidden"));
  EXPECT_TRUE(is_valid_device_name("0dev"));
}

TEST(DeviceConfig, NodeGuidIsStableLocalAndDistinct) {
  uint64_t a = derive_node_guid("host-1", "softverbs0");
  EXPECT_EQ(a, derive_node_guid("host-1", "softverbs0"));
  EXPECT_NE(a, derive_node_guid("host-1", "softverbs1"));
  EXPECT_NE(a, derive_node_guid("host-2", "softverbs0"));
  EXPECT_EQ((a >> 56) & 0x03, 0x02u) << "locally administered, unicast";
  EXPECT_EQ((a >> 24) & 0xffff, 0xfffeu) << "EUI-64 shape";
  EXPECT_EQ(format_guid(0x0002c903000a0b0cull), "0002:c903:000a:0b0c");
}

TEST(DeviceAttributes, MtuFollowsTheNetdev) {
  EXPECT_EQ(roce_mtu_for_netdev(65536), Mtu::k4096);
  EXPECT_EQ(roce_mtu_for_netdev(9000), Mtu::k4096);
  EXPECT_EQ(roce_mtu_for_netdev(1500), Mtu::k1024);
  EXPECT_EQ(roce_mtu_for_netdev(1104), Mtu::k1024) << "1024 bytes of payload + 80 of headers fit";
  EXPECT_EQ(roce_mtu_for_netdev(1103), Mtu::k512);
  EXPECT_EQ(roce_mtu_for_netdev(300), Mtu::k256);
  EXPECT_EQ(mtu_bytes(Mtu::k4096), 4096u);
  EXPECT_EQ(mtu_bytes(Mtu::k256), 256u);
}

TEST(DeviceAttributes, ReportTheLimits) {
  DeviceConfig config;
  config.node_guid = 0x1234;
  config.netdev_mtu = 1500;
  DeviceAttributes device = device_attributes(config);
  EXPECT_EQ(device.node_guid, 0x1234u);
  EXPECT_EQ(device.max_qp_wr, limits::kMaxQpWr);
  EXPECT_EQ(device.max_sge, limits::kMaxSge);
  EXPECT_EQ(device.atomic_capability, AtomicCapability::Hca);
  EXPECT_EQ(device.physical_port_count, 1);
  PortAttributes port = port_attributes(config);
  EXPECT_EQ(port.state, PortState::Active);
  EXPECT_EQ(port.active_mtu, Mtu::k1024);
  EXPECT_EQ(port.gid_table_length, limits::kGidTableLength);
  EXPECT_GE(port.max_message_size, uint32_t{1} << 30);
  EXPECT_TRUE(port.link_layer_ethernet);
}

NetdevInfo sample_netdev() {
  NetdevInfo netdev;
  netdev.name = "eth7";
  netdev.mac = {0x52, 0x54, 0x00, 0xab, 0xcd, 0xef};
  netdev.mtu = 1500;
  netdev.ipv4_addresses.push_back({10, 1, 2, 3});
  std::array<uint8_t, 16> v6{};
  v6[0] = 0x20;
  v6[1] = 0x01;
  v6[2] = 0x0d;
  v6[3] = 0xb8;
  v6[15] = 0x09;
  netdev.ipv6_addresses.push_back(v6);
  // The kernel's own link-local address equals the default GID: not repeated.
  netdev.ipv6_addresses.push_back(Gid::link_local_from_mac(netdev.mac).raw);
  return netdev;
}

TEST(GidTable, DefaultGidThenOneV1V2PairPerAddress) {
  auto table = build_gid_table(sample_netdev());
  ASSERT_EQ(table.size(), 6u);
  EXPECT_EQ(table[0].gid.to_sysfs_string(), "fe80:0000:0000:0000:5054:00ff:feab:cdef");
  EXPECT_EQ(table[0].type, GidType::RoceV1);
  EXPECT_EQ(table[1].type, GidType::RoceV2);
  EXPECT_EQ(table[1].gid, table[0].gid);
  EXPECT_EQ(table[3].gid.to_sysfs_string(), "0000:0000:0000:0000:0000:ffff:0a01:0203");
  EXPECT_EQ(table[3].type, GidType::RoceV2);
  EXPECT_EQ(table[5].gid.to_sysfs_string(), "2001:0db8:0000:0000:0000:0000:0000:0009");
  for (const auto& entry : table) EXPECT_EQ(entry.netdev, "eth7");
}

TEST(GidTable, CappedAtTheTableLength) {
  NetdevInfo netdev = sample_netdev();
  for (uint8_t i = 0; i < 40; ++i) netdev.ipv4_addresses.push_back({10, 0, 0, i});
  EXPECT_EQ(build_gid_table(netdev).size(), static_cast<size_t>(limits::kGidTableLength));
}

DeviceConfig sample_config(const fs::path& runtime_dir) {
  DeviceConfig config;
  config.name = "softverbs7";
  config.netdev = "eth7";
  config.uverbs_index = 70;
  config.node_guid = 0x0252c9fffe00abcdull;
  config.netdev_mtu = 1500;
  config.runtime_dir = runtime_dir;
  return config;
}

TEST(SysfsTree, HasEveryFileLibibverbsReads) {
  TemporaryDirectory dir;
  fs::path root = fs::path(dir.path()) / "sysfs";
  DeviceConfig config = sample_config(dir.path());
  std::string error;
  ASSERT_TRUE(write_device_tree(root, config, build_gid_table(sample_netdev()), &error)) << error;

  auto line = [&](const fs::path& relative) { return read_first_line(root / relative).value_or("<missing>"); };
  EXPECT_EQ(line("class/infiniband_verbs/abi_version"), "6");
  EXPECT_EQ(line("class/infiniband_verbs/uverbs70/ibdev"), "softverbs7");
  // The node is /dev/null: its numbers, so that ibv_import_device finds the device.
  struct stat null_device {};
  ASSERT_EQ(stat("/dev/null", &null_device), 0);
  EXPECT_EQ(line("class/infiniband_verbs/uverbs70/dev"),
            std::to_string(major(null_device.st_rdev)) + ":" + std::to_string(minor(null_device.st_rdev)));
  EXPECT_EQ(line("class/infiniband_verbs/uverbs70/abi_version"), std::to_string(limits::kUverbsAbiVersion));
  fs::path device = "class/infiniband/softverbs7";
  EXPECT_EQ(line(device / "node_type"), "1: CA");
  EXPECT_EQ(line(device / "node_guid"), "0252:c9ff:fe00:abcd");
  EXPECT_EQ(line(device / "device/modalias"), "softverbs:softverbs7");
  EXPECT_EQ(fs::read_symlink(root / device / "device/net/eth7"), "/sys/class/net/eth7");
  EXPECT_EQ(line(device / "ports/1/pkeys/0"), "0xffff");
  EXPECT_EQ(line(device / "ports/1/state"), "4: ACTIVE");
  EXPECT_EQ(line(device / "ports/1/link_layer"), "Ethernet");
  EXPECT_EQ(line(device / "ports/1/gids/3"), "0000:0000:0000:0000:0000:ffff:0a01:0203");
  EXPECT_EQ(line(device / "ports/1/gid_attrs/types/3"), "RoCE v2");
  EXPECT_EQ(line(device / "ports/1/gid_attrs/types/2"), "IB/RoCE v1");
  EXPECT_EQ(line(device / "ports/1/gid_attrs/ndevs/3"), "eth7");
  // Every index below gid_tbl_len exists; unused ones are zero with no netdev.
  for (int index = 0; index < limits::kGidTableLength; ++index) {
    EXPECT_TRUE(fs::exists(root / device / "ports/1/gids" / std::to_string(index))) << index;
    EXPECT_TRUE(fs::exists(root / device / "ports/1/gid_attrs/types" / std::to_string(index))) << index;
    EXPECT_TRUE(fs::exists(root / device / "ports/1/gid_attrs/ndevs" / std::to_string(index))) << index;
  }
  EXPECT_EQ(line(device / "ports/1/gids/31"), "0000:0000:0000:0000:0000:0000:0000:0000");
  EXPECT_EQ(read_text_file(root / device / "ports/1/gid_attrs/ndevs/31").value_or("x"), "");
  // The provider's source of truth travels with the tree.
  auto record = DeviceConfig::parse(read_text_file(root / device / kDeviceConfigFile).value_or(""), &error);
  ASSERT_TRUE(record) << error;
  EXPECT_EQ(record->node_guid, config.node_guid);
}

TEST(SysfsTree, RefreshReplacesAndRemoveDeletes) {
  TemporaryDirectory dir;
  fs::path root = fs::path(dir.path()) / "sysfs";
  DeviceConfig config = sample_config(dir.path());
  std::string error;
  ASSERT_TRUE(write_device_tree(root, config, build_gid_table(sample_netdev()), &error)) << error;
  NetdevInfo fewer = sample_netdev();
  fewer.ipv4_addresses.clear();
  fewer.ipv6_addresses.clear();
  ASSERT_TRUE(write_device_tree(root, config, build_gid_table(fewer), &error)) << error;
  EXPECT_EQ(read_first_line(root / "class/infiniband/softverbs7/ports/1/gids/3").value(),
            "0000:0000:0000:0000:0000:0000:0000:0000");
  // No staging leftovers next to the device.
  int entries = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(root / "class/infiniband")) ++entries;
  EXPECT_EQ(entries, 1);
  remove_device_tree(root, config);
  EXPECT_FALSE(fs::exists(root / "class/infiniband/softverbs7"));
  EXPECT_FALSE(fs::exists(root / "class/infiniband_verbs/uverbs70"));
}

TEST(SysfsTree, LinksRealDevicesWithoutShadowingOurs) {
  TemporaryDirectory dir;
  fs::path real = fs::path(dir.path()) / "real";
  fs::create_directories(real / "devices/mlx5_0");
  fs::create_directories(real / "devices/uverbs0");
  fs::create_directories(real / "class/infiniband");
  fs::create_directories(real / "class/infiniband_verbs");
  fs::create_symlink(real / "devices/mlx5_0", real / "class/infiniband/mlx5_0");
  fs::create_symlink(real / "devices/uverbs0", real / "class/infiniband_verbs/uverbs0");
  write_text_file(real / "class/infiniband_verbs/abi_version", "6\n");

  fs::path root = fs::path(dir.path()) / "sysfs";
  std::string error;
  ASSERT_TRUE(write_device_tree(root, sample_config(dir.path()), build_gid_table(sample_netdev()), &error));
  link_real_devices(root, real);
  EXPECT_EQ(fs::read_symlink(root / "class/infiniband/mlx5_0"), fs::canonical(real / "devices/mlx5_0"));
  EXPECT_EQ(fs::read_symlink(root / "class/infiniband_verbs/uverbs0"), fs::canonical(real / "devices/uverbs0"));
  EXPECT_FALSE(fs::is_symlink(root / "class/infiniband/softverbs7"));
  EXPECT_EQ(read_first_line(root / "class/infiniband_verbs/abi_version").value(), "6");

  // A real device that goes away loses its link.
  fs::remove(real / "class/infiniband/mlx5_0");
  fs::remove_all(real / "devices/mlx5_0");
  link_real_devices(root, real);
  EXPECT_FALSE(fs::exists(fs::symlink_status(root / "class/infiniband/mlx5_0")));
}

TEST(DeviceRegistry, SaveListFindRemove) {
  TemporaryDirectory dir;
  DeviceRegistry registry(fs::path(dir.path()) / "rt");
  std::string error;
  ASSERT_TRUE(registry.save(sample_config(registry.runtime_dir()), &error)) << error;
  auto devices = registry.list();
  ASSERT_EQ(devices.size(), 1u);
  EXPECT_EQ(devices[0].name, "softverbs7");
  EXPECT_TRUE(registry.find("softverbs7"));
  EXPECT_FALSE(registry.find("nosuch"));
  EXPECT_FALSE(registry.find("../../etc/passwd"));
  EXPECT_TRUE(registry.remove("softverbs7", &error));
  EXPECT_TRUE(registry.list().empty());
  EXPECT_FALSE(registry.remove("softverbs7", &error));
  EXPECT_NE(error.find("cannot remove"), std::string::npos);
}

TEST(DeviceRegistry, UverbsIndexSkipsTakenAndRealDevices) {
  TemporaryDirectory dir;
  DeviceRegistry registry(fs::path(dir.path()) / "rt");
  fs::path real = fs::path(dir.path()) / "real";
  fs::create_directories(real / "class/infiniband_verbs/uverbs64");
  EXPECT_EQ(registry.allocate_uverbs_index("a", real), 65);
  DeviceConfig config = sample_config(registry.runtime_dir());
  config.name = "a";
  config.uverbs_index = 65;
  std::string error;
  ASSERT_TRUE(registry.save(config, &error));
  EXPECT_EQ(registry.allocate_uverbs_index("a", real), 65) << "an existing device keeps its index";
  EXPECT_EQ(registry.allocate_uverbs_index("b", real), 66);
}

TEST(DeviceRegistry, UsersOfExitedProcessesArePruned) {
  TemporaryDirectory dir;
  DeviceRegistry registry(fs::path(dir.path()) / "rt");
  std::string error;
  ASSERT_TRUE(registry.ensure_exists(&error)) << error;
  registry.register_user("softverbs0", getpid());
  pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);
  registry.register_user("softverbs0", child);
  auto users = registry.users("softverbs0");
  ASSERT_EQ(users.size(), 1u);
  EXPECT_EQ(users[0].pid, getpid());
  EXPECT_FALSE(users[0].command.empty());
  EXPECT_FALSE(fs::exists(fs::path(registry.runtime_dir()) / "users/softverbs0" / std::to_string(child)));
  registry.unregister_user("softverbs0", getpid());
  EXPECT_TRUE(registry.users("softverbs0").empty());
}

TEST(DeviceRegistry, RefusesARuntimeDirOwnedBySomeoneElse) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to create a directory owned by another user";
  TemporaryDirectory dir;
  fs::path foreign = fs::path(dir.path()) / "foreign";
  fs::create_directories(foreign);
  ASSERT_EQ(chown(foreign.c_str(), 65534, 65534), 0);
  DeviceRegistry registry(foreign);
  std::string error;
  EXPECT_FALSE(registry.ensure_exists(&error));
  EXPECT_NE(error.find("another user"), std::string::npos) << error;
}

}  // namespace
}  // namespace softverbs
