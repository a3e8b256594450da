#include "memory_copy.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

namespace softverbs {

namespace {

// memcpy between two iovec lists of the same total length, in this process.
void copy_vectors(std::span<const iovec> to, std::span<const iovec> from) {
  size_t to_index = 0, to_offset = 0;
  for (const iovec& source : from) {
    size_t done = 0;
    while (done < source.iov_len && to_index < to.size()) {
      size_t room = to[to_index].iov_len - to_offset;
      size_t chunk = std::min(room, source.iov_len - done);
      std::memmove(static_cast<char*>(to[to_index].iov_base) + to_offset,
                   static_cast<const char*>(source.iov_base) + done, chunk);
      done += chunk;
      to_offset += chunk;
      if (to_offset == to[to_index].iov_len) {
        ++to_index;
        to_offset = 0;
      }
    }
  }
}

size_t total(std::span<const iovec> vectors) {
  size_t sum = 0;
  for (const iovec& v : vectors) sum += v.iov_len;
  return sum;
}

// process_vm_* takes at most IOV_MAX vectors a side and may copy partially:
// loop until everything moved.
template <typename Call>
int cross_process(pid_t pid, std::span<const iovec> local, std::span<const iovec> remote, Call call) {
  size_t wanted = std::min(total(local), total(remote));
  std::vector<iovec> l(local.begin(), local.end()), r(remote.begin(), remote.end());
  size_t moved = 0;
  size_t li = 0, ri = 0;
  while (moved < wanted) {
    size_t lcount = std::min<size_t>(l.size() - li, 1024), rcount = std::min<size_t>(r.size() - ri, 1024);
    ssize_t n = call(pid, l.data() + li, lcount, r.data() + ri, rcount, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EFAULT;
    moved += static_cast<size_t>(n);
    // Advance both lists by n bytes.
    for (auto* list : {&l, &r}) {
      size_t& index = list == &l ? li : ri;
      size_t skip = static_cast<size_t>(n);
      while (skip > 0 && index < list->size()) {
        iovec& v = (*list)[index];
        size_t step = std::min(skip, v.iov_len);
        v.iov_base = static_cast<char*>(v.iov_base) + step;
        v.iov_len -= step;
        skip -= step;
        if (v.iov_len == 0) ++index;
      }
      while (index < list->size() && (*list)[index].iov_len == 0) ++index;
    }
  }
  return 0;
}

}  // namespace

int copy_to_process(pid_t pid, std::span<const iovec> local, std::span<const iovec> remote) {
  if (pid == getpid()) {
    copy_vectors(remote, local);
    return 0;
  }
  return cross_process(pid, local, remote, process_vm_writev);
}

int copy_from_process(pid_t pid, std::span<const iovec> local, std::span<const iovec> remote) {
  if (pid == getpid()) {
    copy_vectors(local, remote);
    return 0;
  }
  return cross_process(pid, local, remote, process_vm_readv);
}

}  // namespace softverbs
