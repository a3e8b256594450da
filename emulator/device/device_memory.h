// The device's state shared by every process that opens it, as an HCA's
// memory is: QP and CQ records, receive queues, completion rings and the MR
// table, all in one file-backed mapping. Records refer to each other by index
// and to heap blocks by offset, never by pointer, since each process maps the
// file at its own address.
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>

#include "device/cm_routing.h"
#include "device/completion_ring.h"
#include "device/device_limits.h"
#include "device/device_memory_allocation.h"
#include "device/event_socket.h"
#include "device/memory_region_table.h"
#include "device/multicast_table.h"
#include "device/process_table.h"
#include "device/qp_state_machine.h"
#include "device/shared_mutex.h"
#include "device/transport_counters.h"
#include "device/work_request.h"
#include "device/xrc_domains.h"
#include "udp/fault_injection.h"

namespace softverbs {

// A QPN is its record's index in the low kQpnIndexBits and a tag, drawn at
// random at each creation, above them: QPNs are hard to guess and a stale
// QPN names no new QP. The tag is never 0 (QPs 0 and 1 are special) nor
// all ones with the last index (0xffffff is the multicast QPN).
inline constexpr unsigned kQpnIndexBits = 14;
static_assert((1 << kQpnIndexBits) == limits::kMaxQp);
inline constexpr uint32_t kQpnTagLimit = (1u << (24 - kQpnIndexBits)) - 1;  // tags 1 .. kQpnTagLimit - 1

// An SRQ's number (ibv_get_srq_num, the XRCETH's SRQN) is made the same way.
inline constexpr unsigned kSrqnIndexBits = 12;
static_assert((1 << kSrqnIndexBits) == limits::kMaxSrq);
inline constexpr uint32_t kSrqnTagLimit = (1u << (24 - kSrqnIndexBits)) - 1;

// A receive queue (a QP's own or an SRQ): a ring of RecvWqe slots, each
// followed by max_sge SGEs. Takers (whoever delivers a SEND, a flush) hold
// the queue's lock (the QP's or the SRQ's) and find the next entry by its
// sequence number. A QP's poster holds only its QP's receive_post_lock,
// which no other process takes, and writes only the slot and its own line:
// a SEND stream's posts and takes touch different slots instead of both
// moving the QP lock's line between the cores for every message. (An SRQ's
// poster holds the SRQ's lock, as its takers do.)
struct RecvQueue {
  uint64_t ring_offset = 0;
  uint32_t capacity = 0;
  uint32_t max_sge = 0;
  uint32_t slot_size = 0;
  uint32_t reserved = 0;
  // Entries ever consumed: the takers' line.
  alignas(64) uint64_t consumed = 0;
  // Entries ever posted, and the poster's last look at `consumed` (read
  // again only when the ring looks full): the poster's line.
  alignas(64) uint64_t posted = 0;
  uint64_t consumed_seen = 0;
};

enum class CqArm : uint32_t { None = 0, NextCompletion = 1, SolicitedOnly = 2 };

struct CqRecord {
  SharedMutex lock;  // producers, arming, resizing; the owner's polls take the ring's poll lock
  uint32_t live = 0;
  int32_t owner_pid = 0;
  int32_t owner_process = -1;  // the owner's ProcessTable record
  uint64_t owner_handle = 0;   // the ibv_cq pointer in the owner, for events
  uint64_t ring_offset = 0;    // CompletionSlots
  uint64_t ring_bytes = 0;
  CqArm armed = CqArm::None;
  // Set for a CQ made with completion timestamps: deliveries stamp the
  // device clock (device_clock.h).
  uint32_t stamps_completions = 0;
  SocketAddress channel;      // the owner's completion channel; length 0: none
  SocketAddress owner_async;  // the owner's async event socket (CQ errors)
  // Completions lost to an overrun (the ring was full), and the first of
  // them: what the owner's checker reports (`softverbs run --check`).
  uint32_t lost_completions = 0;
  Completion first_lost;
  CompletionRingHeader ring;  // its producers' and its consumer's halves on lines of their own
};

struct SrqRecord {
  SharedMutex lock;
  uint32_t live = 0;
  int32_t owner_pid = 0;
  int32_t owner_process = -1;
  uint32_t pd_handle = 0;
  uint32_t limit = 0;         // armed limit; 0: not armed
  uint64_t owner_handle = 0;  // the ibv_srq pointer in the owner, for events
  SocketAddress owner_async;
  RecvQueue rq;
  uint32_t srqn = 0;
  // An XRC SRQ: its domain's id and the CQ its receives complete on (fixed
  // while it lives); 0 and -1 for a basic SRQ.
  uint32_t xrcd_id = 0;
  int32_t cq = -1;
};

// What Modify QP sets and Query QP reports, besides the state.
struct QpAttributes {
  uint32_t qkey = 0;
  uint32_t rq_psn = 0;
  uint32_t sq_psn = 0;
  uint32_t dest_qpn = 0;
  uint32_t access_flags = 0;
  uint16_t pkey_index = 0;
  uint8_t port = 1;
  uint8_t path_mtu = 0;
  uint8_t timeout = 0;
  uint8_t retry_count = 0;
  uint8_t rnr_retry = 0;
  uint8_t min_rnr_timer = 0;
  uint8_t max_rd_atomic = 0;
  uint8_t max_dest_rd_atomic = 0;
  uint8_t sq_draining = 0;
  uint8_t sgid_index = 0;
  uint8_t hop_limit = 0;
  uint8_t traffic_class = 0;
  uint8_t service_level = 0;
  uint8_t is_global = 0;
  uint32_t flow_label = 0;
  uint8_t dgid[16] = {};
  uint16_t dlid = 0;
};

struct QpCapacities {
  uint32_t max_send_wr = 0;
  uint32_t max_recv_wr = 0;
  uint32_t max_send_sge = 0;
  uint32_t max_recv_sge = 0;
  uint32_t max_inline_data = 0;
};

struct alignas(64) QpRecord {
  SharedMutex lock;  // state, attributes and the receive queue
  // The lock has its cache line to itself: in a ping-pong the peer that
  // delivers into this QP takes it while the owner's posts read the fields
  // below, and sharing one line moved it between the two cores twice an
  // iteration.
  alignas(64) uint32_t live = 0;
  uint32_t qpn = 0;
  QpType type = QpType::Rc;
  QpState state = QpState::Reset;
  uint8_t signal_all = 0;
  uint8_t gsi_agent = 0;  // a CM agent: a UD QP that sends and receives as QP1 (cm_routing.h)
  // An XRC QP (type Rc: the transport is RC's): its role and, for
  // XRC_RECV, its domain's id.
  XrcRole xrc = XrcRole::None;
  uint32_t xrcd_id = 0;
  int32_t owner_pid = 0;
  int32_t owner_process = -1;  // the owner's ProcessTable record: whether it lives
  uint32_t pd_handle = 0;
  int32_t send_cq = -1;
  int32_t recv_cq = -1;
  int32_t srq = -1;
  uint64_t owner_handle = 0;  // the ibv_qp pointer in the owner, for events
  SocketAddress owner_async;
  // The owner's UDP transport takes packets for this QP that another
  // process of the device received on 127.0.0.1:forward_port; 0: none.
  uint16_t forward_port = 0;
  QpCapacities caps;
  QpAttributes attributes;
  RecvQueue rq;
  SharedMutex receive_post_lock;  // the owner's threads posting receives take turns
};

// A QP's state read without its lock, as a post needs it: a snapshot that
// may change right after, as one read under the lock may too. A post that
// took the lock to read it pulled the QP record's cache line away from the
// peer that had just locked it to deliver into this QP (on 2 cores, a
// cache-line transfer each way of every shared-memory ib_write_lat
// iteration). Every change of the state goes through set_state, under the
// lock.
inline QpState load_state(const QpRecord& qp) {
  return std::atomic_ref<QpState>(const_cast<QpState&>(qp.state)).load(std::memory_order_acquire);
}
inline void set_state(QpRecord& qp, QpState state) {
  std::atomic_ref<QpState>(qp.state).store(state, std::memory_order_release);
}

// What a device memory file begins with: a file of another layout is
// refused (or replaced when no process uses it).
inline constexpr uint64_t kDeviceMemoryMagic = 0x736f667476726273ull;  // "softvrbs"
inline constexpr uint32_t kDeviceMemoryVersion = 23;

struct DeviceShared {
  uint64_t magic = 0;
  uint32_t version = 0;
  uint32_t reserved = 0;
  uint64_t instance_id = 0;     // random, names this device memory's copy agents
  uint64_t forward_secret = 0;  // random, proves a forwarded UDP packet came from a process of this device
  // Set by `softverbs down`: the device is gone, as an HCA that was removed.
  // Every post reads it: a line of its own, which nothing else writes.
  alignas(64) std::atomic<uint32_t> removed{0};
  alignas(64) uint32_t reserved_after_removed = 0;
  SharedMutex objects_lock;     // records, handles and the heap
  ReadMostlyMutex memory_lock;  // the MR table: a reader across every data copy, a writer to change it
  SharedMutex atomics_lock;     // makes atomics atomic with respect to each other
  uint32_t next_pd_handle = 0;
  XrcDomainTable xrc_domains;  // under objects_lock
  uint64_t heap_start = 0;
  uint64_t heap_next = 0;
  uint64_t heap_end = 0;
  uint64_t free_lists[40] = {};  // by power-of-two size class
  // Records are allocated lowest first; none at or above its mark was ever
  // live, so sweeps stop there. Raised under objects_lock.
  uint32_t qp_high_water = 0;
  uint32_t cq_high_water = 0;
  uint32_t srq_high_water = 0;
  QpRecord qps[limits::kMaxQp];
  CqRecord cqs[limits::kMaxCq];
  SrqRecord srqs[limits::kMaxSrq];
  MemoryRegionTable mrs;
  MulticastTable multicast;  // under memory_lock
  CmListenerTable cm_listeners;
  CmConnectionTable cm_connections;
  ProcessTable processes;  // claims under objects_lock
  // The UDP transport's counters, fault settings and capture switch.
  TransportCounters counters;
  SharedFaultSettings faults;
  CaptureControl capture;
  DeviceMemoryAllocations device_memory;  // ibv_alloc_dm's, under objects_lock
};

// What a device holds now: `softverbs stat` shows it, and tests check that
// it returns to where it was once the processes that used it are gone.
struct DeviceUsage {
  uint32_t processes = 0;  // joined and alive
  uint32_t qps = 0, cqs = 0, srqs = 0, mrs = 0, xrc_domains = 0;
  uint64_t heap_bytes = 0;  // rings and receive queues, in blocks handed out
};

class DeviceMemory : public std::enable_shared_from_this<DeviceMemory> {
 public:
  // Maps (creating and initializing on first use) the device memory file.
  static std::shared_ptr<DeviceMemory> open(const std::filesystem::path& path, std::string* error);
  // One mapping per file per process, shared by all its contexts.
  static std::shared_ptr<DeviceMemory> open_shared(const std::filesystem::path& path, std::string* error);
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  DeviceShared& shared() { return *reinterpret_cast<DeviceShared*>(base_); }
  template <typename T>
  T* at(uint64_t offset) {
    return reinterpret_cast<T*>(base_ + offset);
  }

  // Heap blocks for rings; 0 when exhausted. Callers hold no lock.
  uint64_t allocate(uint64_t bytes);
  void release(uint64_t offset, uint64_t bytes);

  // Record allocation for this process; -1 when the device's limit is
  // reached (or the process cannot join the device: see process_slot).
  int allocate_qp();
  int allocate_cq();
  int allocate_srq();
  uint32_t allocate_pd_handle();

  QpRecord* qp_by_number(uint32_t qpn);
  SrqRecord* srq_by_number(uint32_t srqn);

  // The records that were ever allocated (live or not): a walk over them
  // misses no live one and reads none of the rest of the tables.
  std::span<QpRecord> qps_ever_used() { return ever_used(shared().qps, shared().qp_high_water); }
  std::span<CqRecord> cqs_ever_used() { return ever_used(shared().cqs, shared().cq_high_water); }
  std::span<SrqRecord> srqs_ever_used() { return ever_used(shared().srqs, shared().srq_high_water); }

  // This process's record in the device's ProcessTable: the process joins
  // the device on first use (and again in a forked child), which starts
  // the thread that holds the record's life mutex and serves as its copy
  // agent (memory_copy.h). -1 if the device has no free record.
  int process_slot();
  // Whether the process of a record's owner_process still lives.
  bool owner_alive(int process_slot) const {
    return const_cast<DeviceMemory*>(this)->shared().processes.alive(process_slot);
  }
  // Whether `softverbs down` removed the device.
  bool removed() { return shared().removed.load(std::memory_order_acquire) != 0; }

  // Frees the records of processes that exited without cleaning up, and
  // then their ProcessTable records.
  void reclaim_dead_owners();
  DeviceUsage usage();

  // A CQ's ring of `capacity` slots (a power of two) in device memory.
  // install_completion_ring points the record at slots allocate() gave and
  // empties them; callers hold the CQ's poll lock and lock where another
  // process may see the record. allocate_completion_ring does both for a
  // CQ that no other process sees yet (false: device memory is full).
  static uint64_t completion_ring_bytes(uint32_t capacity) { return uint64_t{capacity} * sizeof(CompletionSlot); }
  void install_completion_ring(CqRecord& cq, uint64_t offset, uint32_t capacity);
  [[nodiscard]] bool allocate_completion_ring(CqRecord& cq, uint32_t capacity);
  // The ring as its producers see it (its size read from their own cache
  // line). The owner's polls keep the slots' offset in process memory
  // instead: the record's line is the one producers lock.
  CompletionRing completion_ring(CqRecord& cq) {
    return CompletionRing(cq.ring, std::span(at<CompletionSlot>(cq.ring_offset), cq.ring.producer.capacity));
  }

  RecvWqe* recv_slot(RecvQueue& queue, uint64_t sequence) {
    return at<RecvWqe>(queue.ring_offset + (sequence % queue.capacity) * queue.slot_size);
  }
  static Sge* sges_of(RecvWqe* wqe) { return reinterpret_cast<Sge*>(wqe + 1); }

  // This process's slot of memory_lock (claimed on first use, and again in
  // a forked child, whose process id differs).
  size_t memory_lock_slot();

 private:
  DeviceMemory(char* base, size_t size);
  static std::shared_ptr<DeviceMemory> open_or_recreate(const std::filesystem::path& path, std::string* error,
                                                        bool may_recreate);
  template <typename Record, size_t N>
  static std::span<Record> ever_used(Record (&records)[N], uint32_t& high_water) {
    const uint32_t used = std::atomic_ref<uint32_t>(high_water).load(std::memory_order_acquire);
    return std::span<Record>(records, std::min<size_t>(used, N));
  }
  char* base_;
  size_t size_;
  std::atomic<uint64_t> memory_lock_slot_{0};  // pid << 32 | slot; 0: none yet
  std::atomic<uint64_t> process_slot_{0};      // pid << 32 | ProcessTable slot; 0: not joined
};

// Holds the device's memory_lock as a reader: the keys and the regions they
// name stay as they are until it goes.
class MemoryReadLock {
 public:
  explicit MemoryReadLock(DeviceMemory& memory)
      : lock_(memory.shared().memory_lock.reader(memory.memory_lock_slot())) {}

 private:
  SharedLock lock_;
};

}  // namespace softverbs
