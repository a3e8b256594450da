// A second, unprivileged user for the tests that play a hostile local user
// against root's RDMA processes: its abstract sockets are found as anyone
// finds them (/proc/net/unix), and datagrams are sent to them from a child
// process that has become user nobody.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace softverbs::test {

inline constexpr uid_t kNobody = 65534;

// Whether this process may become another user (root).
bool can_switch_user();

// Runs `body` in a child process that has dropped to user and group
// nobody; returns its exit status (or 128 + signal).
int run_as_nobody(const std::function<int()>& body);

// The abstract AF_UNIX socket names (without the leading '@') that process
// `pid` holds.
std::vector<std::string> abstract_sockets_of(pid_t pid);

// Sends one datagram to the abstract socket `name`; false if the kernel
// refused it.
bool send_to_abstract(const std::string& name, const void* bytes, size_t length);

// The pid of the process named `command` in `softverbs status` output, or 0.
pid_t pid_in_status(const std::string& status_output, const std::string& command);

}  // namespace softverbs::test
