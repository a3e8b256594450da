#include "checker/report.h"

#include <dlfcn.h>
#include <elf.h>
#include <execinfo.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <link.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

extern char** environ;

namespace softverbs::provider::check {

namespace {

// The output of `argv` (stdout only), or empty if it cannot run. The child
// gets no LD_PRELOAD and none of the checker's settings: addr2line is not
// to run under softverbs.
std::string output_of(const std::vector<std::string>& argv) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return {};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  std::vector<char*> args;
  for (const std::string& word : argv) args.push_back(const_cast<char*>(word.c_str()));
  args.push_back(nullptr);
  std::vector<char*> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string_view variable = *entry;
    if (variable.starts_with("LD_PRELOAD=") || variable.starts_with("SOFTVERBS_")) continue;
    env.push_back(*entry);
  }
  env.push_back(nullptr);
  pid_t child = -1;
  const int spawned = posix_spawnp(&child, args[0], &actions, nullptr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[1]);
  std::string out;
  if (spawned == 0) {
    char buffer[4096];
    ssize_t got;
    while ((got = read(pipe_fds[0], buffer, sizeof buffer)) > 0 || (got < 0 && errno == EINTR))
      if (got > 0) out.append(buffer, static_cast<size_t>(got));
    int status = 0;
    while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) out.clear();
  }
  close(pipe_fds[0]);
  return out;
}

std::string object_path(const Dl_info& info) {
  if (info.dli_fname != nullptr && info.dli_fname[0] == '/') return info.dli_fname;
  char path[4096];
  const ssize_t length = readlink("/proc/self/exe", path, sizeof path - 1);  // the main program's name is relative
  if (length <= 0) return info.dli_fname != nullptr ? info.dli_fname : "";
  return std::string(path, static_cast<size_t>(length));
}

// addr2line -i prints a function and a file:line for each inlined level,
// innermost first: the first one that is not a system header's (verbs.h's
// ibv_post_send is inlined into the caller) is the application's.
void apply_addr2line(const std::string& output, CodeLocation& location) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < output.size()) {
    size_t end = output.find('\n', start);
    if (end == std::string::npos) end = output.size();
    lines.push_back(output.substr(start, end - start));
    start = end + 1;
  }
  for (size_t i = 0; i + 1 < lines.size(); i += 2) {
    const std::string& where = lines[i + 1];
    const size_t colon = where.rfind(':');
    if (colon == std::string::npos || where.starts_with("??")) continue;
    const std::string file = where.substr(0, colon);
    const unsigned line = static_cast<unsigned>(std::strtoul(where.c_str() + colon + 1, nullptr, 10));
    const bool system_header = file.starts_with("/usr/include/");
    if (location.file.empty() || !system_header) {
      location.file = file;
      location.line = line;
      if (lines[i] != "??") location.function = lines[i];
    }
    if (!system_header) break;
  }
}

}  // namespace

CodeLocation locate_call(const void* return_address) {
  CodeLocation location;
  if (return_address == nullptr) return location;
  // The call instruction is just before the return address.
  const auto address = reinterpret_cast<uintptr_t>(return_address) - 1;
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(address), &info) == 0 || info.dli_fbase == nullptr) {
    char text[32];
    std::snprintf(text, sizeof text, "0x%lx", static_cast<unsigned long>(address));
    location.object = text;
    return location;
  }
  location.object = object_path(info);
  if (info.dli_sname != nullptr) location.function = info.dli_sname;
  // addr2line wants the address as the ELF file has it: relative to the
  // load base for a shared object or PIE, absolute for a fixed executable.
  const auto* header = static_cast<const ElfW(Ehdr)*>(info.dli_fbase);
  const auto base = reinterpret_cast<uintptr_t>(info.dli_fbase);
  location.offset_in_object = header->e_type == ET_EXEC ? address : address - base;
  char hex[32];
  std::snprintf(hex, sizeof hex, "0x%lx", static_cast<unsigned long>(location.offset_in_object));
  apply_addr2line(output_of({"addr2line", "-C", "-f", "-i", "-e", location.object, hex}), location);
  return location;
}

const bool detail::kEnabled = std::getenv("SOFTVERBS_CHECK") != nullptr;

namespace {

std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string describe(const CodeLocation& location) {
  std::string text = location.function.empty() ? "??" : location.function;
  if (!location.file.empty()) text += " at " + location.file + ":" + std::to_string(location.line);
  char offset[32];
  std::snprintf(offset, sizeof offset, "+0x%lx", static_cast<unsigned long>(location.offset_in_object));
  return text + " (" + location.object + offset + ")";
}

std::string location_json(const CodeLocation& location) {
  return "{\"object\":" + json_string(location.object) + ",\"function\":" + json_string(location.function) +
         ",\"file\":" + json_string(location.file) + ",\"line\":" + std::to_string(location.line) + "}";
}

// The reporting thread's stack from the first frame outside the provider.
std::vector<CodeLocation> caller_stack() {
  void* frames[32];
  const int count = backtrace(frames, 32);
  Dl_info self{};
  dladdr(reinterpret_cast<const void*>(&caller_stack), &self);
  std::vector<CodeLocation> stack;
  for (int i = 0; i < count && stack.size() < 12; ++i) {
    Dl_info info{};
    if (dladdr(frames[i], &info) != 0 && info.dli_fbase == self.dli_fbase) continue;
    stack.push_back(locate_call(frames[i]));
  }
  return stack;
}

// One write(2) each, O_APPEND: reports of several processes never interleave.
void append_to(const char* path, const std::string& text) {
  if (path == nullptr || *path == '\0') return;
  const int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return;
  [[maybe_unused]] const ssize_t written = write(fd, text.data(), text.size());
  close(fd);
}

}  // namespace

std::string describe_call_site(const void* return_address) { return describe(locate_call(return_address)); }

void report(const Finding& finding) {
  static std::mutex reporting;  // one report at a time: addr2line is spawned for each
  std::lock_guard guard(reporting);
  std::string line = "softverbs check: " + std::string(finding.check) + ": " + finding.what;
  if (finding.qp_num != 0) {
    char qpn[32];
    std::snprintf(qpn, sizeof qpn, " (QP 0x%06x", finding.qp_num);
    line += qpn;
    if (finding.wr_id) line += ", WR id " + std::to_string(*finding.wr_id);
    if (!finding.opcode.empty()) line += ", " + std::string(finding.opcode);
    line += ")";
  } else if (finding.wr_id) {
    line += " (WR id " + std::to_string(*finding.wr_id) + ")";
  }
  line += "\n";
  std::optional<CodeLocation> site;
  if (finding.call_site != nullptr) {
    site = locate_call(finding.call_site);
    line += (finding.wr_id ? "    posted at " : "    called at ") + describe(*site) + "\n";
  }
  std::vector<CodeLocation> stack;
  if (finding.backtrace_of_caller) {
    stack = caller_stack();
    line += "    reported in:\n";
    for (size_t i = 0; i < stack.size(); ++i) line += "      #" + std::to_string(i) + " " + describe(stack[i]) + "\n";
  }
  [[maybe_unused]] const ssize_t written = write(STDERR_FILENO, line.data(), line.size());

  if (const char* path = std::getenv("SOFTVERBS_CHECK_REPORT")) {
    std::string json = "{\"check\":" + json_string(finding.check) + ",\"what\":" + json_string(finding.what) +
                       ",\"pid\":" + std::to_string(getpid());
    if (finding.qp_num != 0) json += ",\"qp_num\":" + std::to_string(finding.qp_num);
    if (finding.wr_id) json += ",\"wr_id\":" + std::to_string(*finding.wr_id);
    if (!finding.opcode.empty()) json += ",\"opcode\":" + json_string(finding.opcode);
    if (site) json += ",\"call_site\":" + location_json(*site);
    if (!stack.empty()) {
      json += ",\"stack\":[";
      for (size_t i = 0; i < stack.size(); ++i) json += (i ? "," : "") + location_json(stack[i]);
      json += "]";
    }
    append_to(path, json + "}\n");
  }
  append_to(std::getenv("SOFTVERBS_CHECK_COUNT"), "x");
}

std::string_view send_opcode_name(int opcode) {
  switch (opcode) {
    case IBV_WR_RDMA_WRITE:
      return "IBV_WR_RDMA_WRITE";
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return "IBV_WR_RDMA_WRITE_WITH_IMM";
    case IBV_WR_SEND:
      return "IBV_WR_SEND";
    case IBV_WR_SEND_WITH_IMM:
      return "IBV_WR_SEND_WITH_IMM";
    case IBV_WR_RDMA_READ:
      return "IBV_WR_RDMA_READ";
    case IBV_WR_ATOMIC_CMP_AND_SWP:
      return "IBV_WR_ATOMIC_CMP_AND_SWP";
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      return "IBV_WR_ATOMIC_FETCH_AND_ADD";
    case IBV_WR_LOCAL_INV:
      return "IBV_WR_LOCAL_INV";
    case IBV_WR_BIND_MW:
      return "IBV_WR_BIND_MW";
    case IBV_WR_SEND_WITH_INV:
      return "IBV_WR_SEND_WITH_INV";
    case IBV_WR_TSO:
      return "IBV_WR_TSO";
    case IBV_WR_DRIVER1:
      return "IBV_WR_DRIVER1";
    case IBV_WR_ATOMIC_WRITE:
      return "IBV_WR_ATOMIC_WRITE";
    default:
      return "unknown opcode";
  }
}

std::string_view completion_opcode_name(int opcode) {
  switch (opcode) {
    case IBV_WC_SEND:
      return "IBV_WC_SEND";
    case IBV_WC_RDMA_WRITE:
      return "IBV_WC_RDMA_WRITE";
    case IBV_WC_RDMA_READ:
      return "IBV_WC_RDMA_READ";
    case IBV_WC_COMP_SWAP:
      return "IBV_WC_COMP_SWAP";
    case IBV_WC_FETCH_ADD:
      return "IBV_WC_FETCH_ADD";
    case IBV_WC_BIND_MW:
      return "IBV_WC_BIND_MW";
    case IBV_WC_LOCAL_INV:
      return "IBV_WC_LOCAL_INV";
    case IBV_WC_TSO:
      return "IBV_WC_TSO";
    case IBV_WC_ATOMIC_WRITE:
      return "IBV_WC_ATOMIC_WRITE";
    case IBV_WC_RECV:
      return "IBV_WC_RECV";
    case IBV_WC_RECV_RDMA_WITH_IMM:
      return "IBV_WC_RECV_RDMA_WITH_IMM";
    default:
      return "unknown opcode";
  }
}

}  // namespace softverbs::provider::check
