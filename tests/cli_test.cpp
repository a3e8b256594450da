// The `softverbs` command as a user meets it: a real process per call, with
// its own runtime directory.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <thread>
#include <vector>

#include "host/device_config.h"
#include "process_runner.h"
#include "support/file_util.h"

namespace softverbs {
namespace {

namespace fs = std::filesystem;
using test::ProcessResult;
using test::run_process;
using test::TemporaryDirectory;

class Cli : public ::testing::Test {
 protected:
  ProcessResult softverbs(std::vector<std::string> args) {
    args.insert(args.begin(), SOFTVERBS_CLI);
    return run_process(args, {"SOFTVERBS_RUNTIME_DIR=" + runtime_dir()});
  }
  std::string runtime_dir() const { return dir_.path() + "/rt"; }

  TemporaryDirectory dir_;
};

TEST_F(Cli, NoArgumentsIsAUsageError) {
  auto r = softverbs({});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("A subcommand is required"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("Usage: softverbs [OPTIONS] SUBCOMMAND"), std::string::npos) << r.err;
}

TEST_F(Cli, UnknownCommand) {
  auto r = softverbs({"frobnicate"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("unknown command 'frobnicate'"), std::string::npos);
}

TEST_F(Cli, EveryVerbHasHelp) {
  for (const char* verb : {"up", "down", "status", "env", "run", "stat", "faults", "capture"}) {
    auto r = softverbs({verb, "--help"});
    EXPECT_EQ(r.exit_code, 0) << verb;
    EXPECT_NE(r.out.find(std::string("Usage: softverbs ") + verb), std::string::npos) << verb << ": " << r.out;
  }
  auto r = softverbs({"--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("Subcommands:"), std::string::npos);
  for (const char* verb : {"up", "down", "status", "env", "run", "stat", "faults", "capture", "version"})
    EXPECT_NE(r.out.find(std::string("\n  ") + verb + " "), std::string::npos) << verb << " is listed: " << r.out;
}

// A UDP device has a CM watcher (it sends the DREQs of a killed rdma_cm
// process): one per device however often `up` and `run` start it, shown by
// `status`, gone after `down`. A shared-memory device has none.
TEST_F(Cli, AUdpDeviceHasOneCmWatcherUntilItGoesDown) {
  const auto watcher_of = [](const std::string& status) -> pid_t {
    const size_t at = status.find("CM watcher: ");
    return at == std::string::npos ? 0 : std::atoi(status.c_str() + at + 12);
  };
  const auto is_watcher = [](pid_t pid) {
    return read_text_file("/proc/" + std::to_string(pid) + "/cmdline").value_or("").find("cm-watcher") !=
           std::string::npos;
  };
  ASSERT_EQ(softverbs({"up", "--name", "shm0"}).exit_code, 0);
  EXPECT_EQ(softverbs({"status", "shm0"}).out.find("CM watcher"), std::string::npos);
  ASSERT_EQ(softverbs({"up", "--name", "udp0", "--transport", "udp"}).exit_code, 0);
  // `up` starts it detached: it holds its lock and writes its pid soon after.
  pid_t first = 0;
  for (int i = 0; i < 60 && first == 0; ++i) {
    first = watcher_of(softverbs({"status", "udp0"}).out);
    if (first == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GT(first, 0) << softverbs({"status", "udp0"}).out;
  EXPECT_TRUE(is_watcher(first));
  ASSERT_EQ(softverbs({"up", "--name", "udp0", "--transport", "udp"}).exit_code, 0);
  ASSERT_EQ(softverbs({"run", "--", "true"}).exit_code, 0);
  EXPECT_EQ(watcher_of(softverbs({"status", "udp0"}).out), first) << "the same one";
  ASSERT_EQ(softverbs({"down", "udp0"}).exit_code, 0);
  for (int i = 0; i < 60 && is_watcher(first); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(is_watcher(first)) << "still running after `down`";
}

TEST_F(Cli, UpRejectsBadArguments) {
  auto r = softverbs({"up", "--netdev", "nosuchif0"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("no network device 'nosuchif0'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("lo"), std::string::npos) << "lists the netdevs that exist: " << r.err;

  r = softverbs({"up", "--name", "bad/name"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("invalid device name"), std::string::npos) << r.err;

  r = softverbs({"up", "--transport", "carrier-pigeon"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("up: --transport: carrier-pigeon not in {auto,shm,udp}"), std::string::npos) << r.err;

  r = softverbs({"up", "--name", "-x"});
  EXPECT_EQ(r.exit_code, 2) << "a name that reads as an option could not be taken down again";
  EXPECT_NE(r.err.find("up: --name"), std::string::npos) << r.err;

  r = softverbs({"up", "--name"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("up: --name: 1 required"), std::string::npos) << r.err;

  r = softverbs({"up", "extra"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("not expected: extra"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(runtime_dir() + "/devices/softverbs0.conf")) << "a rejected call changes nothing";
}

// One device per netdev where both would use its RoCEv2 port, as rxe: the
// second could not start its UDP transport in a program that opens both
// (UCX opens every device). Shared memory uses no port, and neither does
// an auto device on a loopback netdev.
TEST_F(Cli, ASecondDeviceOnANetdevWhoseRoceV2PortIsTakenIsRefused) {
  ASSERT_EQ(softverbs({"up", "--name", "roce1", "--transport", "udp"}).exit_code, 0);
  auto r = softverbs({"up", "--name", "roce2", "--transport", "udp"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("lo already carries roce1"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(runtime_dir() + "/devices/roce2.conf"));
  EXPECT_EQ(softverbs({"up", "--name", "shm1", "--transport", "shm"}).exit_code, 0) << "shm uses no UDP port";
  EXPECT_EQ(softverbs({"up", "--name", "roce1"}).exit_code, 0) << "refreshing the device itself is fine";
  ASSERT_EQ(softverbs({"down", "roce1"}).exit_code, 0);
  EXPECT_EQ(softverbs({"up", "--name", "auto1"}).exit_code, 0);
  EXPECT_EQ(softverbs({"up", "--name", "auto2"}).exit_code, 0) << "auto on lo: no UDP, no conflict";
}

TEST_F(Cli, TransportAndFaultSettingsPersistAndShow) {
  ASSERT_EQ(softverbs({"up", "--transport", "udp", "--faults", "loss=10%,seed=3"}).exit_code, 0);
  auto status = softverbs({"status"});
  EXPECT_NE(status.out.find("transport udp"), std::string::npos) << status.out;
  EXPECT_NE(status.out.find("fault injection: loss=0.1,"), std::string::npos) << status.out;
  auto shown = softverbs({"faults"});
  EXPECT_EQ(shown.exit_code, 0);
  EXPECT_NE(shown.out.find("softverbs0: loss=0.1,duplicate=0,"), std::string::npos) << shown.out;
  EXPECT_NE(shown.out.find("seed=3"), std::string::npos) << shown.out;
  // A refresh without the options keeps them.
  ASSERT_EQ(softverbs({"up"}).exit_code, 0);
  EXPECT_NE(softverbs({"status"}).out.find("transport udp"), std::string::npos);
  EXPECT_NE(softverbs({"faults"}).out.find("loss=0.1"), std::string::npos);
  ASSERT_EQ(softverbs({"faults", "softverbs0", "none"}).exit_code, 0);
  EXPECT_EQ(softverbs({"faults"}).out, "softverbs0: none\n");
  auto stat = softverbs({"stat"});
  EXPECT_EQ(stat.exit_code, 0);
  for (const char* name : {"tx_packets", "retransmissions", "icrc_errors", "faults_corrupted"})
    EXPECT_NE(stat.out.find(name), std::string::npos) << name << " in\n" << stat.out;
}

TEST_F(Cli, TransportVerbsRejectBadArguments) {
  ASSERT_EQ(softverbs({"up"}).exit_code, 0);
  auto r = softverbs({"faults", "softverbs0", "loss=2"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("loss='2' is not a fraction"), std::string::npos) << r.err;
  r = softverbs({"faults", "softverbs0", "drop=0.1"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("unknown fault setting 'drop'"), std::string::npos) << r.err;
  r = softverbs({"up", "--faults", "loss"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("not KEY=VALUE"), std::string::npos) << r.err;
  r = softverbs({"faults", "softverbs0", "loss=0.1,,"});
  EXPECT_EQ(r.exit_code, 2) << "a typo is not taken silently";
  EXPECT_NE(r.err.find("empty fault setting"), std::string::npos) << r.err;
  EXPECT_EQ(softverbs({"faults"}).out, "softverbs0: none\n") << "and changes nothing";
  r = softverbs({"up", "--transport", "tcp"});
  EXPECT_EQ(r.exit_code, 2);
  r = softverbs({"faults", "nosuchdevice"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("no device named 'nosuchdevice'"), std::string::npos) << r.err;
  r = softverbs({"stat", "nosuchdevice"});
  EXPECT_EQ(r.exit_code, 1);
  r = softverbs({"capture"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("capture: -w is required"), std::string::npos) << r.err;
  r = softverbs({"capture", "-w", dir_.path() + "/x.pcap", "--duration", "soon"});
  EXPECT_EQ(r.exit_code, 2);
  r = softverbs({"capture", "-w", "/nonexistent-dir/x.pcap", "--duration", "0.1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("cannot create /nonexistent-dir/x.pcap"), std::string::npos) << r.err;
}

TEST_F(Cli, CaptureWritesAPcapHeaderAndStopsAfterItsDuration) {
  ASSERT_EQ(softverbs({"up"}).exit_code, 0);
  std::string file = dir_.path() + "/empty.pcap";
  auto r = softverbs({"capture", "-w", file, "--duration", "0.2"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("0 packets captured"), std::string::npos) << r.err;
  EXPECT_EQ(fs::file_size(file), 24u) << "the pcap global header alone";
  auto decoded = run_process({"tshark", "-r", file});
  EXPECT_EQ(decoded.exit_code, 0) << decoded.err;
}

TEST_F(Cli, UpStatusDownLifecycle) {
  auto r = softverbs({"status"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("no softverbs device is up"), std::string::npos);

  r = softverbs({"up", "--name=test1", "--transport", "shm"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("test1 is up on lo"), std::string::npos) << r.out;
  auto record = DeviceConfig::parse(read_text_file(runtime_dir() + "/devices/test1.conf").value_or(""), nullptr);
  ASSERT_TRUE(record);
  EXPECT_EQ(record->transport, TransportChoice::SharedMemory);
  EXPECT_TRUE(fs::exists(runtime_dir() + "/sysfs/class/infiniband/test1/ports/1/gids/0"));
  EXPECT_TRUE(fs::exists(runtime_dir() + "/sysfs/class/infiniband_verbs/" + record->uverbs_name() + "/ibdev"));

  // Refreshing keeps the identity of the device.
  r = softverbs({"up", "--name", "test1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto again = DeviceConfig::parse(read_text_file(runtime_dir() + "/devices/test1.conf").value_or(""), nullptr);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->node_guid, record->node_guid);
  EXPECT_EQ(again->uverbs_index, record->uverbs_index);

  r = softverbs({"up", "--name", "test2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;

  r = softverbs({"status"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("test1: " + record->uverbs_name()), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("test2: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("0000:0000:0000:0000:0000:ffff:7f00:0001  RoCE v2  lo"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("processes: none"), std::string::npos) << r.out;

  r = softverbs({"status", "test2"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out.find("test1"), std::string::npos) << r.out;

  r = softverbs({"status", "nosuch"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("no device named 'nosuch'"), std::string::npos) << r.err;

  r = softverbs({"down", "test1"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(runtime_dir() + "/sysfs/class/infiniband/test1"));
  EXPECT_FALSE(fs::exists(runtime_dir() + "/devices/test1.conf"));

  r = softverbs({"down", "test1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("no device named 'test1' (devices up: test2)"), std::string::npos) << r.err;

  r = softverbs({"down", "--all"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("test2 is down"), std::string::npos);

  r = softverbs({"down", "test2", "--all"});
  EXPECT_EQ(r.exit_code, 2);
}

TEST_F(Cli, EnvPrintsExportsAndBringsUpTheDefaultDevice) {
  auto r = softverbs({"env"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("export SYSFS_PATH='" + runtime_dir() + "/sysfs'"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("export RDMAV_DRIVERS='"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("libsoftverbs'"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("export LD_PRELOAD='"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("libsoftverbs-preload.so"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(runtime_dir() + "/devices/softverbs0.conf"));

  // The printed lines are valid shell that a program can then use.
  auto shell = run_process({"sh", "-c", "eval \"$(" SOFTVERBS_CLI " env)\" && echo \"$SYSFS_PATH\""},
                           {"SOFTVERBS_RUNTIME_DIR=" + runtime_dir()});
  EXPECT_EQ(shell.exit_code, 0) << shell.err;
  EXPECT_EQ(shell.out, runtime_dir() + "/sysfs\n");
  EXPECT_NE(softverbs({"env", "--bogus"}).exit_code, 0);
}

TEST_F(Cli, RunUsageErrors) {
  auto r = softverbs({"run"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("no command given"), std::string::npos) << r.err;
  r = softverbs({"run", "--frob", "true"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("run: The following argument was not expected: --frob"), std::string::npos) << r.err;
}

TEST_F(Cli, RunReportsAMissingCommandLikeAShell) {
  auto r = softverbs({"run", "--", "/nonexistent/program"});
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_NE(r.err.find("cannot run '/nonexistent/program'"), std::string::npos) << r.err;
}

TEST_F(Cli, RunPassesTheExitCodeThrough) {
  auto r = softverbs({"run", "--", "sh", "-c", "exit 7"});
  EXPECT_EQ(r.exit_code, 7) << r.err;
}

TEST_F(Cli, ConcurrentRunsInOneRuntimeDirectory) {
  ASSERT_EQ(softverbs({"up"}).exit_code, 0);
  std::vector<std::future<ProcessResult>> runs;
  for (int i = 0; i < 8; ++i)
    runs.push_back(std::async(std::launch::async, [&] {
      return softverbs({"run", "--", "cat", "/sys/class/infiniband/softverbs0/node_type"});
    }));
  for (auto& run : runs) {
    ProcessResult r = run.get();
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, "1: CA\n");
  }
}

TEST_F(Cli, RunPresentsTheTreeAtTheRealSysfsPaths) {
  // Tools that read /sys directly (not $SYSFS_PATH) see the device too.
  auto r = softverbs({"run", "--", "sh", "-c",
                      "cat /sys/class/infiniband/softverbs0/node_guid && ls /sys/class/net && "
                      "test -c /dev/infiniband/uverbs64 && echo SYSFS_PATH=${SYSFS_PATH:-unset}"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto record = DeviceConfig::parse(read_text_file(runtime_dir() + "/devices/softverbs0.conf").value_or(""), nullptr);
  ASSERT_TRUE(record);
  EXPECT_NE(r.out.find(format_guid(record->node_guid)), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("lo"), std::string::npos) << "the real classes stay visible: " << r.out;
  EXPECT_NE(r.out.find("SYSFS_PATH=unset"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace softverbs
