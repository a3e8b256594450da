// The `softverbs` command: brings emulated RDMA devices up and down, runs
// programs on them and shows their state. CLI11 parses and checks the
// command line and writes every --help; the commands get checked values.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cli_commands.h"
#include "host/device_config.h"
#include "host/netdev.h"
#include "install_paths.h"
#include "support/random_bits.h"
#include "udp/fault_injection.h"

namespace {

using namespace softverbs;
using namespace softverbs::cli;

const CLI::Validator kDeviceName(device_name_problem, "NAME");
const CLI::Validator kNetdev(netdev_problem, "IF");

const CLI::Validator kFaultSpec(
    [](std::string& spec) {
      std::string why;
      return FaultSettings::parse(spec, &why) ? std::string() : why;
    },
    "SPEC");

// The command line: every command with its options (CLI11), and what was
// given once parsed.
class CommandLine {
 public:
  CommandLine()
      : app_(
            "Emulated RDMA devices: bring them up and down, run unmodified RDMA programs on them, and show their "
            "state, counters and traffic.",
            "softverbs") {
    app_.set_version_flag("--version", std::string("softverbs ") + SOFTVERBS_VERSION);
    app_.require_subcommand(1, 1);
    app_.footer("`softverbs COMMAND --help` describes each command.");
    declare_up();
    declare_down();
    declare_status();
    declare_env();
    declare_run();
    declare_stat();
    declare_faults();
    declare_capture();
    declare_trace();
    declare_diff();
    version_command = app_.add_subcommand("version", "print the version");
    // Started by `up` and `run` (cm_watcher.cpp), not by users: no group, so not listed.
    cm_watcher_command = app_.add_subcommand("cm-watcher", "");
    cm_watcher_command->group("");
    cm_watcher_command->add_option("name", cm_watcher_name)->required();
  }

  // nullopt once parsed; else the exit code (help or version printed, or a
  // usage error reported).
  std::optional<int> parse(int argc, char** argv) {
    // `run`'s and `trace`'s command starts at `--` or at the first word
    // that is not one of their options (nor an option's value); CLI11 parses
    // only what comes before it.
    int parsed_argc = argc;
    const std::string_view verb = argc > 1 ? argv[1] : "";
    if (verb == "run" || verb == "trace") {
      const std::vector<std::string_view> with_value = verb == "run"
                                                           ? std::vector<std::string_view>{"--trace", "--check-report"}
                                                           : std::vector<std::string_view>{"-o", "--output"};
      std::vector<std::string>& command = verb == "run" ? run.command : trace.command;
      for (int i = 2; i < argc; ++i) {
        const std::string_view word = argv[i];
        if (word != "--" && word.starts_with('-')) {
          if (std::find(with_value.begin(), with_value.end(), word) != with_value.end()) ++i;
          continue;
        }
        command.assign(argv + i + (word == "--" ? 1 : 0), argv + argc);
        parsed_argc = i;
        break;
      }
    }
    try {
      app_.parse(parsed_argc, argv);
      return std::nullopt;
    } catch (const CLI::ParseError& e) {
      if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app_.exit(e);  // --help, --version
      if (app_.get_subcommands().empty()) {
        report_error(argc > 1 && argv[1][0] != '-' ? std::string("unknown command '") + argv[1] + "'" : e.what());
        std::cerr << '\n' << app_.help();
        return kExitUsage;
      }
      return usage_error(*app_.get_subcommands().front(), e.what());
    }
  }

  // Reports `message` for `command` and shows its help: exit code 2.
  static int usage_error(const CLI::App& command, const std::string& message) {
    report_error(command.get_name() + ": " + message);
    std::cerr << '\n' << command.help("softverbs");
    return kExitUsage;
  }

  UpOptions up;
  std::string check_text;  // run --check's value: empty (report), report or error
  std::string transport_text, faults_text;
  DownOptions down;
  std::string status_name;
  RunOptions run;
  bool no_namespace = false;
  std::string adversarial_text;
  CLI::Option* adversarial_option = nullptr;
  StatOptions stat;
  std::array<std::string, 2> faults_words;
  CaptureOptions capture;
  TraceOptions trace;
  std::string run_trace_file;
  DiffOptions diff;
  CLI::App *trace_command = nullptr, *diff_command = nullptr;
  CLI::App *up_command = nullptr, *down_command = nullptr, *status_command = nullptr, *env_command = nullptr,
           *run_command = nullptr, *stat_command = nullptr, *faults_command = nullptr, *capture_command = nullptr,
           *version_command = nullptr, *cm_watcher_command = nullptr;
  std::string cm_watcher_name;

 private:
  void declare_up() {
    up_command = app_.add_subcommand("up", "create or refresh an emulated RDMA device");
    up_command->footer(
        "Creates the device NAME on network device IF, or refreshes it if it exists (its GIDs follow IF's current\n"
        "addresses). Run as root it also creates /dev/infiniband/uverbsN, which lets programs use the device\n"
        "without `softverbs run` (see `softverbs env`). A refresh without --transport or --faults keeps the\n"
        "device's settings.");
    up_command->add_option("--name", up.name, "the device's name")->capture_default_str()->check(kDeviceName);
    up_command->add_option("--netdev", up.netdev, "the network device its port sits on")
        ->capture_default_str()
        ->check(kNetdev);
    up_command
        ->add_option("--transport", transport_text,
                     "auto: shared memory for peers on this device, UDP (RoCEv2) for GIDs elsewhere when IF is not a "
                     "loopback device (a new device's default); shm: shared memory only; udp: RoCEv2 over UDP port "
                     "4791 for every connection, even on this host")
        ->check(CLI::IsMember({"auto", "shm", "udp"}));
    up_command->add_option("--faults", faults_text, "fault injection on the UDP transport (see `softverbs faults`)")
        ->check(kFaultSpec);
  }

  void declare_down() {
    down_command = app_.add_subcommand("down", "remove a device");
    down_command->footer(
        "Programs that have the device open see what an HCA's removal gives them: IBV_EVENT_DEVICE_FATAL,\n"
        "their QPs in the error state with their work flushed, and EIO from verbs that create objects.");
    CLI::Option* down_name =
        down_command->add_option("NAME", down.name, "the device")->capture_default_str()->check(kDeviceName);
    down_command->add_flag("--all", down.all, "every device")->excludes(down_name);
  }

  void declare_status() {
    status_command = app_.add_subcommand("status", "show devices, ports, GIDs and the processes using them");
    status_command->add_option("NAME", status_name, "only this device")->check(kDeviceName);
  }

  void declare_env() {
    env_command = app_.add_subcommand("env", "print export lines for `eval \"$(softverbs env)\"`");
    env_command->footer(
        "The lines make libibverbs in this shell find softverbs devices. Programs started this way need\n"
        "/dev/infiniband/uverbsN (`sudo softverbs up` creates it); `softverbs run` needs neither.");
  }

  void declare_run() {
    run_command =
        app_.add_subcommand("run", "run an unmodified RDMA program with the devices available: run [--] CMD [ARGS...]");
    run_command->footer(
        "Runs CMD (softverbs0 on lo is brought up first if no device is up) in a private mount namespace in\n"
        "which the devices appear under /sys/class/infiniband and /dev/infiniband, so tools that read /sys\n"
        "directly see them too; a non-root user gets a user namespace for that and keeps their uid inside.\n"
        "Exit status: CMD's; 127 if CMD cannot be found, 126 if it cannot be run, 1 if the devices cannot\n"
        "be provided, 2 on bad usage. With --check=error: 1 if CMD exited 0 but the checker reported\n"
        "something in any of its processes (128+N if CMD was killed by signal N).");
    run_command->add_flag("--no-namespace", no_namespace,
                          "use only environment variables (SYSFS_PATH, RDMAV_DRIVERS, LD_PRELOAD); needs "
                          "/dev/infiniband/uverbsN (`sudo softverbs up`)");
    run_command->add_flag("--rsockets", run.rsockets,
                          "run CMD's TCP sockets over rsockets (RDMA) with librspreload (docs/rdmacm.md)");
    run_command
        ->add_option("--trace", run_trace_file,
                     "record CMD's verbs calls and completions in FILE (as "
                     "`softverbs trace -o FILE`)")
        ->type_name("FILE");
    adversarial_option =
        run_command
            ->add_option("--adversarial", adversarial_text,
                         "behave as unkindly as the IB spec allows (completions delayed, reordered across QPs and "
                         "returned a few at a time, data placed in pieces, spurious events, RNR on first SENDs, "
                         "UDP loss and duplicates, a slow peer), reproducibly from SEED (printed; random if not "
                         "given): --adversarial=SEED")
            ->expected(0, 1)
            ->check(CLI::Validator(
                [](std::string& text) {
                  const bool digits = text.size() <= 19 && text.find_first_not_of("0123456789") == std::string::npos;
                  return digits ? std::string() : "SEED must be a whole number";
                },
                "SEED"));
    run_command
        ->add_option("--check", check_text,
                     "check the program's use of the verbs and report misuse on stderr (docs/checking.md); "
                     "--check=error also makes the exit status non-zero if anything was reported")
        ->expected(0, 1)
        ->check(CLI::IsMember({"", "report", "error"}));
    run_command
        ->add_option("--check-report", run.check_report, "with --check: also append each report to FILE as a JSON line")
        ->type_name("FILE");
    // CMD and everything after it are CMD's, its options included: they are
    // split off before CLI11 parses (see below), which sees run's own options.
    run_command->add_option("CMD", run_placeholder, "the program and its arguments (after `--` if it starts with -)");
  }

  void declare_stat() {
    stat_command =
        app_.add_subcommand("stat", "show the UDP transport's counters (packets, retransmissions, NAKs, drops)");
    stat_command->footer(
        "The counters are summed over every process that used the device: packets and bytes sent and\n"
        "received, retransmissions, ACK timeouts, NAKs sent and received (PSN sequence, RNR, errors),\n"
        "duplicates, drops (bad ICRC, malformed, unknown QP, wrong source, UD with no receive posted) and\n"
        "injected faults; then what the device holds: live processes, QPs, CQs, SRQs, MRs and the bytes of\n"
        "device memory in use.");
    stat_command->add_option("NAME", stat.name, "only this device (default: every device)")->check(kDeviceName);
    stat_command->add_flag("--reset", stat.reset, "set the counters to zero");
  }

  void declare_faults() {
    faults_command =
        app_.add_subcommand("faults", "show or set fault injection (loss, duplicate, reorder, delay, corrupt)");
    faults_command->footer(
        "Running processes follow a change at once. SPEC is a comma-separated list of KEY=VALUE, or `none`:\n"
        "  loss=R       drop a packet           duplicate=R  send a packet twice\n"
        "  reorder=R    hold a packet back behind the next one of its QP\n"
        "  delay=R      hold a packet for delay_us microseconds (default 1000)\n"
        "  corrupt=R    flip a byte (the receiver's ICRC check drops it and counts it)\n"
        "  seed=N       the generator's seed: the same seed and traffic, the same faults\n"
        "Rates R are fractions (0.1) or percentages (10%) of the packets each QP sends.\n"
        "SOFTVERBS_FAULTS=SPEC in a program's environment overrides the device's setting for that program.");
    // Either may come alone: faults_options() tells a SPEC from a NAME.
    faults_command->add_option("NAME", faults_words[0], "the device (default softverbs0)");
    faults_command->add_option("SPEC", faults_words[1], "the settings to apply (default: show them)");
  }

  void declare_capture() {
    capture_command = app_.add_subcommand("capture", "write the device's RoCEv2 traffic to a pcap file");
    capture_command->footer(
        "Writes the RoCEv2 packets the device sends and receives over UDP, in every process that uses it,\n"
        "to FILE (pcap, raw IP frames) until interrupted (Ctrl-C) or for SECONDS. tshark and Wireshark\n"
        "decode them as InfiniBand over UDP port 4791. The shared-memory transport sends no packets.");
    capture_command->add_option("NAME", capture.name, "the device")->capture_default_str()->check(kDeviceName);
    capture_command->add_option("-w", capture.file, "the pcap file")->required()->type_name("FILE");
    capture_command->add_option("--duration", capture.seconds, "stop after this many seconds (default: at Ctrl-C)")
        ->check(CLI::PositiveNumber);
  }

  void declare_trace() {
    trace_command = app_.add_subcommand(
        "trace", "record a program's verbs calls and completions: trace -o FILE [--] CMD [ARGS...]");
    trace_command->footer(
        "Runs CMD with libsoftverbs-trace.so preloaded, on any device (a real HCA too; softverbs devices\n"
        "through `softverbs run -- softverbs trace ...` or `softverbs run --trace FILE`). FILE gets the\n"
        "verbs calls of CMD with their results and every completion, without times, addresses, keys, QP\n"
        "numbers or GIDs, so that two runs compare with `softverbs diff`. Other processes of CMD that use\n"
        "verbs (forked or started by it) write FILE.1, FILE.2, ... in the order they start; old FILE.<n>\n"
        "are removed first. See docs/comparing.md. Exit status: CMD's; 127/126 if it cannot be run.");
    trace_command->add_option("-o,--output", trace.file, "the trace file")->required()->type_name("FILE");
    trace_command->add_option("CMD", trace_placeholder,
                              "the program and its arguments (after `--` if it starts with -)");
  }

  void declare_diff() {
    diff_command = app_.add_subcommand("diff", "show where two traces of `softverbs trace` differ");
    diff_command->footer(
        "Compares the traces object by object (qp1, cq2, ...): a QP's posted sends, send completions,\n"
        "posted receives and receive completions each in order, but not how they interleave, nor how\n"
        "different objects' calls interleave: that is timing. Output as unified-diff hunks under a\n"
        "\"=== <object> <stream>\" header. Exit status as diff(1): 0 same, 1 different, 2 trouble (a file\n"
        "unreadable, not a trace, or of another trace format version).");
    diff_command->add_option("A", diff.a, "the first trace")->required()->type_name("FILE");
    diff_command->add_option("B", diff.b, "the second trace")->required()->type_name("FILE");
  }

  CLI::App app_;
  std::vector<std::string> run_placeholder;    // CMD's place in run's help
  std::vector<std::string> trace_placeholder;  // and in trace's
};

// The parsed `faults` words: a SPEC has '=' or is "none"; anything else
// names the device.
std::optional<FaultsOptions> faults_options(const std::array<std::string, 2>& words) {
  FaultsOptions faults;
  bool named = false;
  for (const std::string& word : words) {
    if (word.empty()) continue;
    const bool spec = word.find('=') != std::string::npos || word == "none";
    std::string* slot =
        spec ? (faults.spec ? nullptr : &faults.spec.emplace()) : (std::exchange(named, true) ? nullptr : &faults.name);
    if (slot == nullptr) return std::nullopt;
    *slot = word;
  }
  return faults;
}

}  // namespace

int main(int argc, char** argv) {
  CommandLine line;
  if (auto exit_code = line.parse(argc, argv)) return *exit_code;
  if (line.up_command->parsed()) {
    if (!line.transport_text.empty()) line.up.transport = parse_transport(line.transport_text);
    if (!line.faults_text.empty()) {
      std::string unused;  // checked by kFaultSpec
      const auto settings = FaultSettings::parse(line.faults_text, &unused);
      line.up.faults = settings->any() ? settings->to_string() : "none";
    }
    return command_up(line.up);
  }
  if (line.down_command->parsed()) return command_down(line.down);
  if (line.status_command->parsed()) return command_status(line.status_name);
  if (line.env_command->parsed()) return command_env();
  if (line.run_command->parsed()) {
    line.run.use_namespace = !line.no_namespace;
    if (!line.run_trace_file.empty()) line.run.trace_file = line.run_trace_file;
    if (line.adversarial_option->count() > 0)
      line.run.adversarial_seed =
          line.adversarial_text.empty() ? random_u64() >> 1 : std::stoull(line.adversarial_text);
    if (line.run_command->count("--check") > 0)
      line.run.check = line.check_text == "error" ? CheckMode::Error : CheckMode::Report;
    if (!line.run.check_report.empty() && line.run.check == CheckMode::Off)
      return CommandLine::usage_error(*line.run_command, "--check-report needs --check");
    if (line.run.command.empty()) return CommandLine::usage_error(*line.run_command, "no command given");
    return command_run(line.run);
  }
  if (line.stat_command->parsed()) return command_stat(line.stat);
  if (line.faults_command->parsed()) {
    const auto faults = faults_options(line.faults_words);
    if (!faults) return CommandLine::usage_error(*line.faults_command, "give at most one NAME and one SPEC");
    return command_faults(*faults);
  }
  if (line.capture_command->parsed()) return command_capture(line.capture);
  if (line.trace_command->parsed()) {
    if (line.trace.command.empty()) return CommandLine::usage_error(*line.trace_command, "no command given");
    return command_trace(line.trace);
  }
  if (line.diff_command->parsed()) return command_diff(line.diff);
  if (line.cm_watcher_command->parsed()) return command_cm_watcher(line.cm_watcher_name);
  std::cout << "softverbs " << SOFTVERBS_VERSION << '\n';  // version
  return kExitOk;
}
