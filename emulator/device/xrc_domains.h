// XRC domains (IBA 11.2.x, ibv_open_xrcd): a domain groups XRC SRQs and
// XRC_RECV QPs, and a message to an XRC_RECV QP may land only in an SRQ of
// the QP's domain. As the kernel's uverbs keeps them, a domain opened with a
// file's descriptor is shared by every process of the device that opens the
// same inode; one opened without is the opener's alone. The table lives in
// device memory (objects_lock held by the callers); a domain goes when its
// last opener closes it or dies.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>

#include "device/qp_state_machine.h"

namespace softverbs {

// Whether a request through a QP of `role` that `qp_owner` holds may reach
// memory of `memory_owner`: its own process's only, but for an XRC_RECV QP,
// whose messages land in SRQs (and the regions of their PDs) that any
// process of its domain may own (the clients of ibv_xsrq_pingpong share one).
inline bool reaches_memory_of(pid_t memory_owner, pid_t qp_owner, XrcRole role) {
  return memory_owner == qp_owner || role == XrcRole::Recv;
}

// The inode a domain is shared by.
struct InodeKey {
  uint64_t device = 0;
  uint64_t inode = 0;
  bool operator==(const InodeKey&) const = default;
};

struct XrcDomainRecord {
  static constexpr int kMaxOpeners = 64;
  struct Opener {
    int32_t process = -1;  // ProcessTable slot
    uint32_t opens = 0;
  };
  uint32_t id = 0;  // 0: free; unique for the device's life, so a stale id names no new domain
  uint8_t by_inode = 0;
  InodeKey inode;
  Opener openers[kMaxOpeners];
};

struct XrcDomainOpen {
  int error = 0;  // 0, or the errno ibv_open_xrcd fails with
  int index = -1;
  uint32_t id = 0;
};

class XrcDomainTable {
 public:
  static constexpr int kCapacity = 1024;

  // Opens the domain of `inode` (creating it if `oflags` has O_CREAT), or a
  // new one of its own without an inode. Errors as the kernel's: EAGAIN for
  // an inode without a domain and no O_CREAT, EINVAL with O_EXCL for one
  // that has a domain, ENOMEM when the table or its openers are full.
  XrcDomainOpen open(std::optional<InodeKey> inode, int oflags, int process);
  // One close by `process`; the domain goes with its last opener.
  void close(int index, uint32_t id, int process);
  // Forgets the opens of processes `dead` says are gone.
  template <typename Dead>
  void forget_openers_if(Dead dead) {
    for (XrcDomainRecord& domain : domains_) {
      if (domain.id == 0) continue;
      for (auto& opener : domain.openers)
        if (opener.opens != 0 && dead(opener.process)) opener = {};
      free_if_unopened(domain);
    }
  }
  uint32_t live_count() const;

 private:
  void free_if_unopened(XrcDomainRecord& domain);

  uint32_t next_id_ = 1;
  XrcDomainRecord domains_[kCapacity];
};

}  // namespace softverbs
