#include "cross_user_helpers.h"

#include <grp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

namespace softverbs::test {

namespace fs = std::filesystem;

bool can_switch_user() { return geteuid() == 0; }

int run_as_nobody(const std::function<int()>& body) {
  const pid_t child = fork();
  if (child == 0) {
    if (setgroups(0, nullptr) != 0 || setgid(kNobody) != 0 || setuid(kNobody) != 0) _exit(120);
    if (getuid() != kNobody || geteuid() != kNobody) _exit(121);
    _exit(body());
  }
  int status = 0;
  waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::vector<std::string> abstract_sockets_of(pid_t pid) {
  std::set<std::string> inodes;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(fs::path("/proc") / std::to_string(pid) / "fd", ec)) {
    std::error_code link_error;
    const std::string target = fs::read_symlink(entry.path(), link_error).string();
    static const std::regex socket_link("socket:\\[([0-9]+)\\]");
    std::smatch match;
    if (!link_error && std::regex_match(target, match, socket_link)) inodes.insert(match[1].str());
  }
  // /proc/net/unix: Num RefCount Protocol Flags Type St Inode Path
  std::vector<std::string> names;
  std::ifstream table("/proc/net/unix");
  std::string line;
  std::getline(table, line);  // the heading
  while (std::getline(table, line)) {
    std::istringstream fields(line);
    std::string num, refcount, protocol, flags, type, state, inode, path;
    if (!(fields >> num >> refcount >> protocol >> flags >> type >> state >> inode >> path)) continue;
    if (path.size() > 1 && path[0] == '@' && inodes.count(inode)) names.push_back(path.substr(1));
  }
  return names;
}

bool send_to_abstract(const std::string& name, const void* bytes, size_t length) {
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (name.size() + 1 > sizeof address.sun_path) {
    close(fd);
    return false;
  }
  std::memcpy(address.sun_path + 1, name.data(), name.size());
  const ssize_t sent = sendto(fd, bytes, length, MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&address),
                              static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size()));
  close(fd);
  return sent == static_cast<ssize_t>(length);
}

pid_t pid_in_status(const std::string& status_output, const std::string& command) {
  const std::regex process("([0-9]+) \\(" + command + "\\)");
  std::smatch match;
  if (!std::regex_search(status_output, match, process)) return 0;
  return static_cast<pid_t>(std::stol(match[1].str()));
}

}  // namespace softverbs::test
