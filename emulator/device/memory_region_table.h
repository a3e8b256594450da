// The lkey/rkey table of a device: what a key names (a process's virtual
// range, its PD, its access rights) and the checks every SGE and every remote
// access passes before a byte moves. Fixed capacity and no pointers, so the
// table can live in memory shared between processes.
#pragma once

#include <sched.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>

namespace softverbs {

// Access bits; values are the verbs ABI's (IBV_ACCESS_*).
namespace access {
inline constexpr uint32_t kLocalWrite = 1u << 0;
inline constexpr uint32_t kRemoteWrite = 1u << 1;
inline constexpr uint32_t kRemoteRead = 1u << 2;
inline constexpr uint32_t kRemoteAtomic = 1u << 3;
inline constexpr uint32_t kMwBind = 1u << 4;
inline constexpr uint32_t kZeroBased = 1u << 5;
inline constexpr uint32_t kOnDemand = 1u << 6;
inline constexpr uint32_t kHugetlb = 1u << 7;
inline constexpr uint32_t kRelaxedOrdering = 1u << 20;
// What softverbs accepts at registration.
inline constexpr uint32_t kSupported = kLocalWrite | kRemoteWrite | kRemoteRead | kRemoteAtomic | kMwBind | kZeroBased |
                                       kOnDemand | kHugetlb | kRelaxedOrdering;
}  // namespace access

// ibv_reg_mr's rule: remote write or atomic needs local write. Returns 0 or EINVAL.
int validate_registration_access(uint32_t flags);

enum class KeyCheck : uint8_t {
  Ok,
  InvalidKey,    // no such key, or a key of a deregistered region
  WrongPd,       // the key belongs to another protection domain
  OutOfBounds,   // [address, address+length) leaves the region
  AccessDenied,  // the region does not grant the access asked for
  PageFault,     // an on-demand region's page that could not be resolved (on_demand_paging.h)
};

// What a key names: a memory region (lkey and rkey), or a memory window
// (an rkey only, over part of a region; see memory_window.cpp).
enum class KeyKind : uint8_t { Region, Window };

// Where the owner's pages of a region can be mapped by peers (see
// shared_regions.h): descriptor `fd` in the owner, or the System V shared
// memory segment `sysv_shm_id` the owner attached there, maps owner
// addresses [base, base + length) from offset 0. Both -1: not shareable.
struct SharedBacking {
  int32_t fd = -1;
  int32_t sysv_shm_id = -1;
  uint64_t base = 0;
  uint64_t length = 0;
  uint64_t id = 0;  // names the backing in memfd's name and peers' caches
};

struct MemoryRegion {
  uint32_t key = 0;
  uint32_t pd_handle = 0;
  uint32_t access = 0;
  int32_t owner_pid = 0;
  int32_t owner_process = -1;  // the owner's ProcessTable record
  uint32_t reserved = 0;
  uint64_t address = 0;  // the process-virtual start of the registered range
  uint64_t iova = 0;     // where the range starts in the key's address space
  uint64_t length = 0;
  SharedBacking backing;
  KeyKind kind = KeyKind::Region;
  uint8_t window_type = 0;  // a window: 1 or 2 (IBV_MW_TYPE_*)
  uint16_t reserved2 = 0;
  // A bound window: its region (whose range, owner and backing it carries
  // from the bind on), and for type 2 the QP it serves; unbound, length 0.
  uint32_t parent_key = 0;
  uint32_t bound_qpn = 0;
  // A region: how many windows are bound to it (it cannot go while any is).
  uint32_t windows_bound = 0;
  uint32_t reserved3 = 0;
};

// A bind of a window to part of a region (ibv_bind_mw, IBV_WR_BIND_MW).
struct WindowBind {
  uint32_t window_key = 0;  // the window's key as allocated (its index and tag)
  uint32_t new_rkey = 0;    // its low 8 bits become those of the window's rkey
  uint32_t mr_lkey = 0;
  uint32_t access = 0;  // IBV_ACCESS_* of the window
  uint64_t address = 0;
  uint64_t length = 0;
  bool by_bind_verb = false;  // ibv_bind_mw (type 1), not a BIND_MW work request (type 2)
};

// Where a checked access lands in the owner's address space.
struct ResolvedRange {
  int32_t owner_pid = 0;
  uint64_t address = 0;
};

class MemoryRegionTable {
 public:
  static constexpr uint32_t kCapacity = 65536;

  // Registers and returns the key (lkey == rkey), or nullopt when full.
  // `owner_process` is the owner's ProcessTable record (-1: none, never
  // reclaimed).
  std::optional<uint32_t> register_region(uint32_t pd_handle, int32_t owner_pid, uint64_t address, uint64_t iova,
                                          uint64_t length, uint32_t access_flags,
                                          const SharedBacking& backing = SharedBacking{}, int32_t owner_process = -1);
  // False if `key` names no live region.
  bool deregister(uint32_t key);
  // Re-registration in place (ibv_rereg_mr): the key stays, what it names
  // changes. False if `key` names no live region.
  bool reregister(uint32_t key, const MemoryRegion& updated);
  // The live region of `key`, if any.
  std::optional<MemoryRegion> find(uint32_t key) const;

  // Whether the caller of a check holds the table's lock (the device's
  // memory_lock). Without it a check still sees each region whole, before
  // or after a concurrent change (a sequence count per slot, which every
  // change makes odd and then even): for a process's data paths over its
  // own regions, which its own deregistration waits for, so that the range
  // stays good after the check.
  enum class Lock : uint8_t { Held, NotHeld };
  // A local SGE: lkey, address and length as posted (address is an iova).
  KeyCheck check_local(uint32_t lkey, uint32_t pd_handle, uint64_t iova, uint64_t length, uint32_t needed_access,
                       ResolvedRange* resolved, Lock lock = Lock::Held) const;
  // A remote access by rkey through QP `qpn`; `needed_access` is
  // kRemoteRead/Write/Atomic. A window's rkey serves only while it is bound,
  // and a type 2 window only its QP.
  KeyCheck check_remote(uint32_t rkey, uint32_t pd_handle, uint32_t qpn, uint64_t iova, uint64_t length,
                        uint32_t needed_access, ResolvedRange* resolved, Lock lock = Lock::Held) const;

  // Memory windows (memory_window.cpp); all under the table's lock.
  // Allocates an unbound window of `type` (1 or 2); its key, or nullopt when full.
  std::optional<uint32_t> allocate_window(uint32_t pd_handle, int32_t owner_pid, int32_t owner_process, uint8_t type);
  // Unbinds (if bound) and frees the window `window_key` names; false if none.
  bool deallocate_window(uint32_t window_key);
  // The window's rkey now; nullopt if `window_key` names no window.
  std::optional<uint32_t> window_rkey(uint32_t window_key) const;
  // Executes a bind posted on QP `qpn` of PD `qp_pd`: false (the work
  // request completes with IBV_WC_MW_BIND_ERR) if the IB spec's checks fail.
  bool bind_window(const WindowBind& bind, uint32_t qp_pd, uint32_t qpn);
  // Invalidates the type 2 window of `rkey` bound to QP `qpn` (LOCAL_INV,
  // or a SEND with invalidate arriving there); false if there is none.
  bool invalidate_window(uint32_t rkey, uint32_t qp_pd, uint32_t qpn);
  // A destroyed QP's type 2 windows are unbound, so that no later QP that
  // draws the same number is served by them; returns how many.
  size_t unbind_windows_of_qp(uint32_t qpn);

  size_t live_count() const { return live_; }
  // How many live regions and windows `owner_process` owns (0 for -1 and
  // out-of-range records): a dead process that owns none needs no sweep.
  uint32_t owned_by(int32_t owner_process) const {
    return owner_process >= 0 && owner_process < kOwnerCapacity ? owned_[owner_process] : 0;
  }

  // Deregisters every region whose owner `is_gone` (given the region's
  // owner_process); returns how many.
  template <typename Predicate>
  size_t deregister_owned_if(Predicate is_gone) {
    size_t removed = 0;
    for (Slot& slot : slots_) {
      if (slot.live && is_gone(slot.region.owner_process)) {
        set_live(slot, false);
        ++removed;
      }
    }
    return removed;
  }

  // The ProcessTable's capacity: owner records are counted up to it.
  static constexpr int32_t kOwnerCapacity = 4096;

  // A live region as a listing shows it (iproute2's `rdma resource show mr`).
  struct ListedRegion {
    uint32_t index = 0;  // its slot: the kernel's MR number
    uint32_t key = 0;
    uint32_t pd_handle = 0;
    int32_t owner_pid = 0;
    int32_t owner_process = -1;
    uint64_t iova = 0;
    uint64_t length = 0;
  };
  // Calls `visit(const ListedRegion&)` for every live region (not window),
  // each read whole without the lock, so that a reader that maps the table
  // read-only can list it (device/device_snapshot.cpp). A slot a writer
  // keeps changing is left out.
  template <typename Visit>
  void for_each_live_region(Visit visit) const {
    for (uint32_t index = 0; index < kCapacity; ++index) {
      const Slot& slot = slots_[index];
      bool live = false;
      KeyKind kind = KeyKind::Region;
      ListedRegion listed;
      const bool whole = read_unlocked(slot, kListingAttempts, [&] {
        live = relaxed(slot.live);
        kind = relaxed(slot.region.kind);
        listed = {index,
                  relaxed(slot.region.key),
                  relaxed(slot.region.pd_handle),
                  relaxed(slot.region.owner_pid),
                  relaxed(slot.region.owner_process),
                  relaxed(slot.region.iova),
                  relaxed(slot.region.length)};
      });
      if (whole && live && kind == KeyKind::Region) visit(listed);
    }
  }

 private:
  // A key is its slot's index in bits 8-23 and a random tag around it (the
  // top 8 bits and the low 8), as rxe puts random bits in every key: a peer
  // cannot guess a key from another it has seen. The low 8 bits are a
  // window's consumer key, which each bind may change (ibv_inc_rkey).
  static constexpr unsigned kIndexBits = 16;
  static constexpr unsigned kIndexShift = 8;
  static_assert(kCapacity == 1u << kIndexBits);
  static uint32_t index_of(uint32_t key) { return (key >> kIndexShift) & (kCapacity - 1); }
  static uint32_t key_of(uint32_t index, uint16_t tag) {
    return (uint32_t{tag} >> 8 << 24) | (index << kIndexShift) | (tag & 0xffu);
  }

  struct Slot {
    MemoryRegion region;
    bool live = false;
    uint16_t tag = 0;       // drawn anew at every reuse, never the same twice running: a stale key stays invalid
    uint32_t sequence = 0;  // odd while a change is being written
  };
  // What the checks read of a slot.
  struct Checked {
    bool live;
    uint32_t key, pd_handle, access;
    int32_t owner_pid;
    uint64_t address, iova, length;
    KeyKind kind;
    uint8_t window_type;
    uint32_t bound_qpn;
  };
  // Who uses a key: a local SGE (regions only), or a remote access by a QP.
  struct Use {
    bool remote;
    uint32_t qpn;
  };
  static KeyCheck check_against(const Checked& region, uint32_t key, uint32_t pd_handle, Use use, uint64_t iova,
                                uint64_t length, uint32_t needed_access, ResolvedRange* resolved);
  KeyCheck check(uint32_t key, uint32_t pd_handle, Use use, uint64_t iova, uint64_t length, uint32_t needed_access,
                 ResolvedRange* resolved, Lock lock) const;
  // The slot of the live window `window_key` names, whatever its low 8 bits.
  Slot* window_slot(uint32_t window_key);
  const Slot* window_slot(uint32_t window_key) const;
  // Takes a free slot and draws its new tag; nullptr when full.
  Slot* take_free_slot(uint32_t& index);
  // A slot's fields as they are (the table's lock held).
  static Checked read(const Slot& slot);
  // A consistent copy without the lock; none if a writer keeps it changing.
  static std::optional<Checked> read_consistent(const Slot& slot);
  template <typename T>
  static T relaxed(const T& field) {
    return std::atomic_ref<T>(const_cast<T&>(field)).load(std::memory_order_relaxed);
  }
  // The reader's side of the slot's sequence lock: `read_fields` (relaxed
  // loads) until the count was the same even number before and after;
  // false if a writer kept it odd `attempts` times (one that was preempted
  // is let run; one killed mid-change leaves the slot unusable until its
  // next change, and refusing the key harms nothing).
  template <typename ReadFields>
  static bool read_unlocked(const Slot& slot, uint64_t attempts, ReadFields read_fields) {
    std::atomic_ref<uint32_t> sequence(const_cast<uint32_t&>(slot.sequence));
    for (uint64_t attempt = 0;; ++attempt) {
      const uint32_t before = sequence.load(std::memory_order_acquire);
      if (before & 1) {
        if (attempt >= attempts) return false;
        if (attempt >= 64) sched_yield();
        continue;
      }
      read_fields();
      std::atomic_thread_fence(std::memory_order_acquire);
      if (sequence.load(std::memory_order_relaxed) == before) return true;
    }
  }
  // A listing does not wait long for a slot: it shows a moment of the table.
  static constexpr uint64_t kListingAttempts = 256;
  const Slot* slot_of(uint32_t key) const;
  // Writers (all under the table's lock) change a slot only through these,
  // which keep the sequence count, store what read_consistent reads
  // atomically, and keep the live counts.
  void write_slot(Slot& slot, const MemoryRegion& region, bool live);
  void set_live(Slot& slot, bool live);
  void count(const Slot& slot, int change);

  Slot slots_[kCapacity];
  uint32_t next_free_hint_ = 0;
  size_t live_ = 0;
  uint32_t owned_[kOwnerCapacity] = {};
};

}  // namespace softverbs
