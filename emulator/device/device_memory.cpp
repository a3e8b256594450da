#include "device/device_memory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "support/internal_mappings.h"
#include "support/process_id.h"
#include "support/random_bits.h"

namespace softverbs {

namespace {

// Sparse: pages are committed only as rings and queues use them, so the
// heap can hold rings as large as the device allows (a 4 Mi-entry CQ is
// 256 MiB of address space).
constexpr uint64_t kHeapBytes = uint64_t{8} << 30;
constexpr unsigned kMinBlockShift = 12;
constexpr uint64_t kReleaseBlockBytes = uint64_t{1} << 16;

static_assert(MemoryRegionTable::kOwnerCapacity == ProcessTable::kCapacity);

// Called under objects_lock with the index just allocated.
void raise_high_water(uint32_t& high_water, int index) {
  const auto next = static_cast<uint32_t>(index) + 1;
  if (next > high_water) std::atomic_ref<uint32_t>(high_water).store(next, std::memory_order_release);
}

uint64_t round_up(uint64_t value, uint64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

unsigned size_class(uint64_t bytes) {
  uint64_t block = std::max<uint64_t>(bytes, uint64_t{1} << kMinBlockShift);
  return static_cast<unsigned>(std::bit_width(block - 1));
}

void initialize(DeviceShared* shared, uint64_t total_size) {
  std::construct_at(shared);
  shared->objects_lock.initialize();
  shared->memory_lock.initialize();
  shared->atomics_lock.initialize();
  shared->cm_listeners.lock.initialize();
  shared->cm_connections.lock.initialize();
  for (auto& qp : shared->qps) {
    qp.lock.initialize();
    qp.receive_post_lock.initialize();
  }
  for (auto& cq : shared->cqs) cq.lock.initialize();
  for (auto& srq : shared->srqs) srq.lock.initialize();
  std::construct_at(&shared->mrs);
  std::construct_at(&shared->multicast);
  shared->processes.initialize();
  shared->next_pd_handle = 1;
  shared->instance_id = random_u64();
  shared->forward_secret = random_u64();
  shared->heap_start = round_up(sizeof(DeviceShared), 4096);
  shared->heap_next = shared->heap_start;
  shared->heap_end = total_size;
  shared->version = kDeviceMemoryVersion;
  std::atomic_thread_fence(std::memory_order_release);
  shared->magic = kDeviceMemoryMagic;
}

}  // namespace

std::shared_ptr<DeviceMemory> DeviceMemory::open(const std::filesystem::path& path, std::string* error) {
  return open_or_recreate(path, error, true);
}

std::shared_ptr<DeviceMemory> DeviceMemory::open_shared(const std::filesystem::path& path, std::string* error) {
  static std::mutex mutex;
  static std::map<std::filesystem::path, std::weak_ptr<DeviceMemory>> mappings;
  std::lock_guard guard(mutex);
  if (auto existing = mappings[path].lock()) return existing;
  auto memory = open(path, error);
  if (memory) mappings[path] = memory;
  return memory;
}

std::shared_ptr<DeviceMemory> DeviceMemory::open_or_recreate(const std::filesystem::path& path, std::string* error,
                                                             bool may_recreate) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    *error = "cannot open " + path.string() + ": " + std::strerror(errno);
    return nullptr;
  }
  flock(fd, LOCK_EX);  // one initializer
  const uint64_t total = round_up(sizeof(DeviceShared), 4096) + kHeapBytes;
  struct stat info {};
  fstat(fd, &info);
  bool fresh = info.st_size == 0;
  if (fresh && ftruncate(fd, static_cast<off_t>(total)) != 0) {
    *error = "cannot size " + path.string() + ": " + std::strerror(errno);
    close(fd);
    return nullptr;
  }
  if (!fresh && static_cast<uint64_t>(info.st_size) != total) {
    // Left by another softverbs version: its processes cannot talk to ours
    // anyway, so start a fresh device memory beside them.
    close(fd);
    if (may_recreate && unlink(path.c_str()) == 0) return open_or_recreate(path, error, false);
    *error = path.string() + " belongs to another softverbs version and cannot be replaced";
    return nullptr;
  }
  void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    *error = "cannot map " + path.string() + ": " + std::strerror(errno);
    close(fd);
    return nullptr;
  }
  auto* shared = static_cast<DeviceShared*>(base);
  if (fresh) initialize(shared, total);
  bool valid = shared->magic == kDeviceMemoryMagic && shared->version == kDeviceMemoryVersion;
  flock(fd, LOCK_UN);
  close(fd);
  if (!valid) {
    munmap(base, total);
    if (may_recreate && unlink(path.c_str()) == 0) return open_or_recreate(path, error, false);
    *error = path.string() + " is not a softverbs device memory file of this version";
    return nullptr;
  }
  return std::shared_ptr<DeviceMemory>(new DeviceMemory(static_cast<char*>(base), total));
}

DeviceMemory::DeviceMemory(char* base, size_t size) : base_(base), size_(size) { note_internal_mapping(base, size); }

DeviceMemory::~DeviceMemory() {
  forget_internal_mapping(base_);
  munmap(base_, size_);
}

void DeviceMemory::install_completion_ring(CqRecord& cq, uint64_t offset, uint32_t capacity) {
  cq.ring_offset = offset;
  cq.ring_bytes = completion_ring_bytes(capacity);
  CompletionRing::initialize(cq.ring, std::span(at<CompletionSlot>(offset), capacity));
}

bool DeviceMemory::allocate_completion_ring(CqRecord& cq, uint32_t capacity) {
  const uint64_t offset = allocate(completion_ring_bytes(capacity));
  if (offset == 0) return false;
  install_completion_ring(cq, offset, capacity);
  return true;
}

uint64_t DeviceMemory::allocate(uint64_t bytes) {
  unsigned cls = size_class(bytes);
  if (cls >= std::size(shared().free_lists)) return 0;
  uint64_t block = uint64_t{1} << cls;
  SharedLock lock(shared().objects_lock);
  DeviceShared& s = shared();
  if (uint64_t head = s.free_lists[cls]; head != 0) {
    s.free_lists[cls] = *at<uint64_t>(head);
    // Zeroed again; a large block by giving its pages back (they read as
    // zeros and are committed only when written), as a fresh one is.
    if (block < kReleaseBlockBytes || madvise(base_ + head, block, MADV_REMOVE) != 0)
      std::memset(base_ + head, 0, block);
    return head;
  }
  uint64_t offset = round_up(s.heap_next, std::min<uint64_t>(block, 1 << 21));
  if (offset + block > s.heap_end) return 0;
  // The alignment gap goes to the free lists, as blocks aligned to their
  // size, rather than being lost for the device's life.
  for (uint64_t gap = s.heap_next; gap < offset;) {
    uint64_t piece = uint64_t{1} << kMinBlockShift;
    while ((gap % (piece * 2)) == 0 && gap + piece * 2 <= offset) piece *= 2;
    const unsigned piece_class = size_class(piece);
    *at<uint64_t>(gap) = s.free_lists[piece_class];
    s.free_lists[piece_class] = gap;
    gap += piece;
  }
  s.heap_next = offset + block;
  return offset;  // never used before: zero
}

void DeviceMemory::release(uint64_t offset, uint64_t bytes) {
  if (offset == 0) return;
  unsigned cls = size_class(bytes);
  SharedLock lock(shared().objects_lock);
  *at<uint64_t>(offset) = shared().free_lists[cls];
  shared().free_lists[cls] = offset;
}

int DeviceMemory::allocate_qp() {
  const int process = process_slot();
  if (process < 0) return -1;
  SharedLock lock(shared().objects_lock);
  for (int i = 0; i < limits::kMaxQp; ++i) {
    QpRecord& qp = shared().qps[i];
    if (qp.live) continue;
    // Keep the lock object; reset everything else.
    qp.live = 1;
    uint32_t tag;
    do tag = random_between(1, kQpnTagLimit - 1);
    while (tag == qp.qpn >> kQpnIndexBits);
    qp.qpn = tag << kQpnIndexBits | static_cast<uint32_t>(i);
    qp.type = QpType::Rc;
    set_state(qp, QpState::Reset);
    qp.signal_all = 0;
    qp.gsi_agent = 0;
    qp.xrc = XrcRole::None;
    qp.xrcd_id = 0;
    qp.owner_pid = current_pid();
    qp.owner_process = process;
    qp.pd_handle = 0;
    qp.send_cq = qp.recv_cq = qp.srq = -1;
    qp.owner_handle = 0;
    qp.owner_async = {};
    qp.forward_port = 0;
    qp.caps = {};
    qp.attributes = {};
    qp.rq = {};
    raise_high_water(shared().qp_high_water, i);
    return i;
  }
  return -1;
}

int DeviceMemory::allocate_cq() {
  const int process = process_slot();
  if (process < 0) return -1;
  SharedLock lock(shared().objects_lock);
  for (int i = 0; i < limits::kMaxCq; ++i) {
    CqRecord& cq = shared().cqs[i];
    if (cq.live) continue;
    cq.live = 1;
    cq.owner_pid = current_pid();
    cq.owner_process = process;
    cq.owner_handle = 0;
    cq.ring_offset = 0;
    cq.ring_bytes = 0;
    // Keep the poll lock object; reset everything else.
    cq.ring.producer = {};
    cq.ring.consumer.capacity = 0;
    cq.ring.consumer.consumed = 0;
    cq.armed = CqArm::None;
    cq.channel = {};
    cq.owner_async = {};
    raise_high_water(shared().cq_high_water, i);
    return i;
  }
  return -1;
}

int DeviceMemory::allocate_srq() {
  const int process = process_slot();
  if (process < 0) return -1;
  SharedLock lock(shared().objects_lock);
  for (int i = 0; i < limits::kMaxSrq; ++i) {
    SrqRecord& srq = shared().srqs[i];
    if (srq.live) continue;
    srq.live = 1;
    uint32_t tag;
    do tag = random_between(1, kSrqnTagLimit - 1);
    while (tag == srq.srqn >> kSrqnIndexBits);
    srq.srqn = tag << kSrqnIndexBits | static_cast<uint32_t>(i);
    srq.xrcd_id = 0;
    srq.cq = -1;
    srq.owner_pid = current_pid();
    srq.owner_process = process;
    srq.pd_handle = 0;
    srq.limit = 0;
    srq.owner_handle = 0;
    srq.owner_async = {};
    srq.rq = {};
    raise_high_water(shared().srq_high_water, i);
    return i;
  }
  return -1;
}

uint32_t DeviceMemory::allocate_pd_handle() {
  SharedLock lock(shared().objects_lock);
  return shared().next_pd_handle++;
}

size_t DeviceMemory::memory_lock_slot() {
  const auto pid = static_cast<uint32_t>(current_pid());
  const uint64_t known = memory_lock_slot_.load(std::memory_order_relaxed);
  if (known >> 32 == pid) return static_cast<size_t>(known & 0xffffffffu);
  // Threads that get here together claim the same slot: claim() finds the
  // one the first took.
  const size_t slot = shared().memory_lock.claim(static_cast<int32_t>(pid));
  memory_lock_slot_.store(uint64_t{pid} << 32 | slot, std::memory_order_relaxed);
  return slot;
}

SrqRecord* DeviceMemory::srq_by_number(uint32_t srqn) {
  SrqRecord& srq = shared().srqs[srqn & ((1u << kSrqnIndexBits) - 1)];
  // Unlocked, as qp_by_number.
  return srq.live && srq.srqn == srqn ? &srq : nullptr;
}

QpRecord* DeviceMemory::qp_by_number(uint32_t qpn) {
  QpRecord& qp = shared().qps[qpn & ((1u << kQpnIndexBits) - 1)];
  // Unlocked: a QP that goes right after is found gone under its lock.
  return qp.live && qp.qpn == qpn ? &qp : nullptr;
}

void DeviceMemory::reclaim_dead_owners() {
  // Only the records of processes dead before the sweep are freed after it:
  // one that dies during it may own objects the sweep has passed.
  std::vector<int> dead_before;
  for (int slot = 0; slot < ProcessTable::kCapacity; ++slot)
    if (shared().processes.pid_of(slot) != 0 && !owner_alive(slot)) dead_before.push_back(slot);
  // Objects outlive their process's record only until a sweep: with no dead
  // record there is nothing to reclaim, and the tables (~27 MB) stay
  // untouched by this process.
  if (dead_before.empty()) return;
  // A record whose owner never joined (-1) is not reclaimed here.
  const auto dead = [this](int process) { return process >= 0 && !owner_alive(process); };
  for (auto& qp : qps_ever_used()) {
    if (!qp.live || !dead(qp.owner_process)) continue;
    uint64_t ring = 0, bytes = 0;
    {
      SharedLock lock(qp.lock);
      if (!qp.live || !dead(qp.owner_process)) continue;
      ring = qp.rq.ring_offset;
      bytes = uint64_t{qp.rq.capacity} * qp.rq.slot_size;
      qp.live = 0;
    }
    release(ring, bytes);
    ExclusiveLock memory_lock(shared().memory_lock);
    shared().multicast.detach_everywhere(qp.qpn);
  }
  for (auto& cq : cqs_ever_used()) {
    if (!cq.live || !dead(cq.owner_process)) continue;
    uint64_t ring = 0, bytes = 0;
    {
      SharedLock lock(cq.lock);
      if (!cq.live || !dead(cq.owner_process)) continue;
      ring = cq.ring_offset;
      bytes = cq.ring_bytes;
      cq.live = 0;
    }
    release(ring, bytes);
  }
  for (auto& srq : srqs_ever_used()) {
    if (!srq.live || !dead(srq.owner_process)) continue;
    uint64_t ring = 0, bytes = 0;
    {
      SharedLock lock(srq.lock);
      if (!srq.live || !dead(srq.owner_process)) continue;
      ring = srq.rq.ring_offset;
      bytes = uint64_t{srq.rq.capacity} * srq.rq.slot_size;
      srq.live = 0;
    }
    release(ring, bytes);
  }
  // The MR table's slots rotate through all 65,536 (~7.5 MB): walked only
  // for a dead process that still owns a region or window.
  const auto owns_keys = [this](int slot) { return shared().mrs.owned_by(slot) != 0; };
  if (std::any_of(dead_before.begin(), dead_before.end(), owns_keys)) {
    ExclusiveLock lock(shared().memory_lock);
    shared().mrs.deregister_owned_if(dead);
  }
  // Nothing refers to a dead process's record now: it can be claimed again.
  SharedLock lock(shared().objects_lock);
  shared().xrc_domains.forget_openers_if(dead);
  shared().device_memory.release_owned_if(dead);
  for (int slot : dead_before) shared().processes.release_if_dead(slot);
}

DeviceUsage DeviceMemory::usage() {
  DeviceUsage usage;
  DeviceShared& s = shared();
  for (int slot = 0; slot < ProcessTable::kCapacity; ++slot) usage.processes += owner_alive(slot);
  for (const QpRecord& qp : qps_ever_used()) usage.qps += qp.live != 0;
  for (const CqRecord& cq : cqs_ever_used()) usage.cqs += cq.live != 0;
  for (const SrqRecord& srq : srqs_ever_used()) usage.srqs += srq.live != 0;
  usage.mrs = static_cast<uint32_t>(s.mrs.live_count());
  SharedLock lock(s.objects_lock);
  usage.xrc_domains = s.xrc_domains.live_count();
  uint64_t free_bytes = 0;
  for (size_t cls = 0; cls < std::size(s.free_lists); ++cls)
    for (uint64_t block = s.free_lists[cls]; block != 0; block = *at<uint64_t>(block)) free_bytes += uint64_t{1} << cls;
  usage.heap_bytes = s.heap_next - s.heap_start - free_bytes;
  return usage;
}

}  // namespace softverbs
