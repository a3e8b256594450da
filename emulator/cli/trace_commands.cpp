// `softverbs trace -o FILE -- CMD` records a program's verbs calls and
// completions (libsoftverbs-trace.so, on any device); `softverbs diff A B`
// compares two such records. See docs/comparing.md.
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <vector>

#include "cli_commands.h"
#include "library_paths.h"
#include "sandbox.h"
#include "trace_diff.h"
#include "trace_format.h"

namespace softverbs::cli {

namespace fs = std::filesystem;

namespace {

// FILE.<n> left by an earlier trace: the numbering of this run's other
// processes starts afresh.
void remove_numbered_traces(const fs::path& file) {
  std::error_code ec;
  const std::string prefix = file.filename().string() + ".";
  for (const auto& entry : fs::directory_iterator(file.parent_path(), ec)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with(prefix) || name.size() == prefix.size()) continue;
    if (name.find_first_not_of("0123456789", prefix.size()) != std::string::npos) continue;
    fs::remove(entry.path(), ec);
  }
}

}  // namespace

bool prepare_trace(const std::string& file, const fs::path& library, std::string* error) {
  if (library.empty()) {
    *error = "cannot find libsoftverbs-trace.so (build or install softverbs)";
    return false;
  }
  std::error_code ec;
  const fs::path path = fs::absolute(file, ec);  // the program may change directory
  // The header alone: a program that never opens a device leaves an empty trace.
  std::ofstream header(path, std::ios::trunc);
  header << trace::kHeaderPrefix << trace::kFormatVersion << '\n';
  header.close();
  if (!header) {
    *error = "cannot write " + path.string() + ": " + std::strerror(errno);
    return false;
  }
  remove_numbered_traces(path);
  setenv(trace::kOutputVariable, path.c_str(), 1);
  setenv(trace::kRootPidVariable, std::to_string(getpid()).c_str(), 1);  // exec keeps the pid
  setenv("LD_PRELOAD", prepend_path_list("LD_PRELOAD", library.string(), ':').c_str(), 1);
  return true;
}

int command_trace(const TraceOptions& options) {
  std::string error;
  if (!prepare_trace(options.file, locate_trace_library(), &error)) {
    report_error("trace: " + error);
    return kExitFailure;
  }
  std::vector<char*> argv;
  for (const std::string& word : options.command) argv.push_back(const_cast<char*>(word.c_str()));
  argv.push_back(nullptr);
  execvp(argv[0], argv.data());
  const int saved = errno;
  report_error(std::string("trace: cannot run '") + argv[0] + "': " + std::strerror(saved));
  return saved == ENOENT ? 127 : 126;
}

int command_diff(const DiffOptions& options) {
  std::string error;
  const auto a = trace::read_trace(options.a, &error);
  const auto b = a ? trace::read_trace(options.b, &error) : std::nullopt;
  if (!a || !b) {
    report_error("diff: " + error);
    return kExitUsage;
  }
  return trace::diff_traces(*a, *b, std::cout) ? kExitFailure : kExitOk;
}

}  // namespace softverbs::cli
