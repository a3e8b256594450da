// rdma-core's own, unmodified tools on a softverbs device, started through
// `softverbs run` exactly as a user would.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <regex>
#include <thread>

#include "host/device_config.h"
#include "process_runner.h"
#include "support/file_util.h"

namespace softverbs {
namespace {

namespace fs = std::filesystem;
using test::ProcessResult;
using test::run_process;
using test::TemporaryDirectory;

class RdmaTools : public ::testing::Test {
 protected:
  ProcessResult run_tool(std::vector<std::string> command, std::vector<std::string> run_options = {}) {
    std::vector<std::string> argv = {SOFTVERBS_CLI, "run"};
    argv.insert(argv.end(), run_options.begin(), run_options.end());
    argv.push_back("--");
    argv.insert(argv.end(), command.begin(), command.end());
    return run_process(argv, {"SOFTVERBS_RUNTIME_DIR=" + runtime_dir()});
  }
  std::string runtime_dir() const { return dir_.path() + "/rt"; }
  DeviceConfig record() const {
    auto config = DeviceConfig::parse(read_text_file(runtime_dir() + "/devices/softverbs0.conf").value_or(""), nullptr);
    EXPECT_TRUE(config);
    return config.value_or(DeviceConfig{});
  }
  static std::string guid_without_colons(uint64_t guid) {
    std::string text = format_guid(guid);
    std::erase(text, ':');
    return text;
  }

  TemporaryDirectory dir_;
};

TEST_F(RdmaTools, IbvDevicesListsSoftverbs0WithItsGuid) {
  auto r = run_tool({"ibv_devices"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::regex row("softverbs0\\s+([0-9a-f]{16})");
  std::smatch match;
  ASSERT_TRUE(std::regex_search(r.out, match, row)) << r.out;
  EXPECT_EQ(match[1].str(), guid_without_colons(record().node_guid));
}

void expect_devinfo_output(const ProcessResult& r, const DeviceConfig& config) {
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("hca_id:\tsoftverbs0"), std::string::npos) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("transport:\\s+InfiniBand \\(0\\)"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("node_guid:\\s+" + format_guid(config.node_guid)))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("state:\\s+PORT_ACTIVE \\(4\\)"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("link_layer:\\s+Ethernet"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("phys_state:\\s+LINK_UP"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("GID\\[\\s*\\d+\\]:\\s+::ffff:127\\.0\\.0\\.1, RoCE v2"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("GID\\[\\s*0\\]:\\s+fe80:[0-9a-f:]+, RoCE v1"))) << r.out;
}

TEST_F(RdmaTools, IbvDevinfoVerbose) {
  auto r = run_tool({"ibv_devinfo", "-v"});
  expect_devinfo_output(r, record());
}

TEST_F(RdmaTools, IbvDevinfoSelectsTheDeviceByName) {
  auto r = run_tool({"ibv_devinfo", "-d", "softverbs0", "-i", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("PORT_ACTIVE"), std::string::npos) << r.out;
  r = run_tool({"ibv_devinfo", "-d", "nosuchdevice"});
  EXPECT_NE(r.exit_code, 0);
}

// infiniband-diags' port tools read the sysfs tree (through libibumad), as
// they do for rxe: the first thing many users type to see if a port is up.
TEST_F(RdmaTools, IbstatAndIbstatusShowTheActivePort) {
  if (run_process({"sh", "-c", "command -v ibstat"}).exit_code != 0)
    GTEST_SKIP() << "infiniband-diags is not installed (scripts/install-deps installs it)";
  auto r = run_tool({"ibstat", "softverbs0"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("CA 'softverbs0'"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Node GUID: 0x" + guid_without_colons(record().node_guid)), std::string::npos) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("State:\\s+Active"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("Physical state:\\s+LinkUp"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("Link layer:\\s+Ethernet"))) << r.out;

  r = run_tool({"ibstatus", "softverbs0"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("Infiniband device 'softverbs0' port 1 status:"), std::string::npos) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("state:\\s+4: ACTIVE"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("default gid:\\s+fe80:"))) << r.out;

  r = run_tool({"ibstat", "nosuchdevice"});
  EXPECT_NE(r.exit_code, 0) << r.out;
}
TEST_F(RdmaTools, EnvironmentOnlyModeWhereTheDevEntryExists) {
  if (geteuid() != 0) GTEST_SKIP() << "needs /dev/infiniband/uverbsN, which root creates";
  auto r = run_tool({"sh", "-c", "echo SYSFS_PATH=$SYSFS_PATH; ibv_devinfo -v"}, {"--no-namespace"});
  expect_devinfo_output(r, record());
  EXPECT_NE(r.out.find("SYSFS_PATH=" + runtime_dir() + "/sysfs"), std::string::npos) << r.out;
}

TEST_F(RdmaTools, NonRootUserGetsTheDeviceThroughAUserNamespace) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to switch to nobody";
  // nobody has no /dev/infiniband entry of its own to rely on: the runtime
  // directory is nobody's, and the CLI must build /dev and /sys in a user
  // namespace.
  fs::path nobody_runtime = fs::path(dir_.path()) / "nobody-rt";
  fs::create_directories(nobody_runtime);
  ASSERT_EQ(chown(nobody_runtime.c_str(), 65534, 65534), 0);
  auto r = run_process({"setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", SOFTVERBS_CLI, "run", "--",
                        "sh", "-c", "id -u; ibv_devinfo -v"},
                       {"SOFTVERBS_RUNTIME_DIR=" + nobody_runtime.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_EQ(r.out.substr(0, r.out.find('\n')), "65534") << "the program keeps the caller's uid";
  auto config = DeviceConfig::parse(read_text_file(nobody_runtime / "devices/softverbs0.conf").value_or(""), nullptr);
  ASSERT_TRUE(config);
  expect_devinfo_output(r, *config);
}

TEST_F(RdmaTools, AsyncwatchSeesTheEventsThatTheCliRaises) {
  std::vector<std::string> env = {"SOFTVERBS_RUNTIME_DIR=" + runtime_dir()};
  ASSERT_EQ(run_process({SOFTVERBS_CLI, "up"}, env).exit_code, 0);
  auto watcher = std::async(std::launch::async, [&] {
    return run_process({SOFTVERBS_CLI, "run", "--", "timeout", "5", "ibv_asyncwatch", "-d", "softverbs0"}, env, 30);
  });
  // Wait until ibv_asyncwatch has the device open.
  bool listening = false;
  for (int i = 0; i < 100 && !listening; ++i) {
    listening = run_process({SOFTVERBS_CLI, "status"}, env).out.find("(ibv_asyncwatch)") != std::string::npos;
    if (!listening) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(listening);
  EXPECT_EQ(run_process({SOFTVERBS_CLI, "up"}, env).exit_code, 0) << "refresh: the GID table may have changed";
  EXPECT_EQ(run_process({SOFTVERBS_CLI, "down"}, env).exit_code, 0) << "the device is removed";
  EXPECT_EQ(run_process({SOFTVERBS_CLI, "up"}, env).exit_code, 0) << "a new device of the same name";
  ProcessResult r = watcher.get();
  EXPECT_NE(r.out.find("softverbs0: async event FD"), std::string::npos) << r.err << r.out;
  size_t gid = r.out.find("event_type IBV_EVENT_GID_CHANGE (18), port 1");
  size_t fatal = r.out.find("event_type IBV_EVENT_DEVICE_FATAL (8)");
  EXPECT_NE(gid, std::string::npos) << r.out;
  EXPECT_NE(fatal, std::string::npos) << r.out;
  EXPECT_LT(gid, fatal);
  // The removed device's contexts are dead: the new device's port coming
  // up is not theirs.
  EXPECT_EQ(r.out.find("IBV_EVENT_PORT_ACTIVE"), std::string::npos) << r.out;
}

// Opening the device prunes the records of processes that have gone,
// including one whose pid now names another process; `down` removes the
// device's memory file and its users' records.
TEST_F(RdmaTools, StaleUserRecordsArePrunedAndDownLeavesNothingBehind) {
  const std::vector<std::string> env = {"SOFTVERBS_RUNTIME_DIR=" + runtime_dir()};
  ASSERT_EQ(run_process({SOFTVERBS_CLI, "up"}, env).exit_code, 0);
  const fs::path users = runtime_dir() + "/users/softverbs0";
  fs::create_directories(users);
  const fs::path gone = users / "4194000";                   // above the default pid_max: no such process
  const fs::path reused = users / std::to_string(getpid());  // a live pid, but not the process recorded
  ASSERT_TRUE(write_text_file(gone, "start_time=1\n"));
  ASSERT_TRUE(write_text_file(reused, "start_time=1\n"));
  auto r = run_tool({"ibv_devinfo", "-d", "softverbs0"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(gone));
  EXPECT_FALSE(fs::exists(reused)) << "a reused pid is not the process that was recorded";
  EXPECT_TRUE(fs::exists(runtime_dir() + "/softverbs0.mem"));
  ASSERT_EQ(run_process({SOFTVERBS_CLI, "down"}, env).exit_code, 0);
  EXPECT_FALSE(fs::exists(runtime_dir() + "/softverbs0.mem")) << "1 GiB sparse, left behind before";
  EXPECT_FALSE(fs::exists(users));
}

TEST_F(RdmaTools, PreloadRefusesRdmaNetlinkOnlyToLibnl) {
  // On a host with ib_core, libibverbs would ask RDMA netlink (through libnl)
  // and never see the sysfs tree; the preload makes that socket fail as on a
  // host without. Other programs get one (the kernel's or the emulated one).
  auto r = run_process({NETLINK_PROBE}, {std::string("LD_PRELOAD=") + PRELOAD_LIBRARY});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("libnl NETLINK_RDMA: refused"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nNETLINK_RDMA: ok"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("NETLINK_ROUTE: ok"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("AF_INET: ok"), std::string::npos) << r.out;
}

// iproute2's `rdma` (RDMA netlink, answered by the preload where the kernel
// has none): rdma-core 56's pyverbs tests find a port's netdev with it.
TEST_F(RdmaTools, IproutesRdmaToolListsTheDeviceAndItsLink) {
  if (run_process({"sh", "-c", "command -v rdma"}).exit_code != 0) GTEST_SKIP() << "iproute2's rdma is not installed";
  if (run_process({NETLINK_PROBE}).out.find("\nNETLINK_RDMA: ok") != std::string::npos)
    GTEST_SKIP() << "this kernel has RDMA netlink (ib_core): `rdma` shows its devices, not softverbs'";
  auto r = run_tool({"rdma", "link", "show", "-j"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find(R"("ifname":"softverbs0","port":1,"state":"ACTIVE","physical_state":"LINK_UP","netdev":"lo")"),
            std::string::npos)
      << r.out;
  r = run_tool({"rdma", "link", "show", "softverbs0/1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("link softverbs0/1 state ACTIVE physical_state LINK_UP netdev lo"), std::string::npos) << r.out;
  r = run_tool({"rdma", "dev", "show"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("softverbs0: node_type ca "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" fw "), std::string::npos) << r.out;  // iproute2 6.15 prints "protocol roce" before it
  EXPECT_NE(r.out.find("node_guid " + format_guid(record().node_guid)), std::string::npos) << r.out;
  r = run_tool({"rdma", "link", "show", "nosuchdevice/1"});
  EXPECT_NE(r.exit_code, 0) << r.out;
  r = run_tool({"rdma", "resource", "show", "pd"});  // not answered: an error, not a made-up list
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_NE(r.err.find("Operation not supported"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace softverbs
