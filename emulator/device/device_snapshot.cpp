#include "device/device_snapshot.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "device/device_memory.h"

namespace softverbs {

namespace {

// The file's DeviceShared, mapped read-only for as long as it lives.
class ReadOnlyMapping {
 public:
  explicit ReadOnlyMapping(const std::filesystem::path& path, std::string* error) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      *error = path.string() + ": " + std::strerror(errno);
      return;
    }
    struct stat status {};
    if (fstat(fd, &status) != 0 || static_cast<size_t>(status.st_size) < sizeof(DeviceShared)) {
      *error = path.string() + " is too short for a softverbs device memory file";
    } else {
      void* base = mmap(nullptr, sizeof(DeviceShared), PROT_READ, MAP_SHARED, fd, 0);
      if (base == MAP_FAILED)
        *error = path.string() + ": " + std::strerror(errno);
      else
        shared_ = static_cast<const DeviceShared*>(base);
    }
    ::close(fd);
  }
  ~ReadOnlyMapping() {
    if (shared_ != nullptr) munmap(const_cast<DeviceShared*>(shared_), sizeof(DeviceShared));
  }
  ReadOnlyMapping(const ReadOnlyMapping&) = delete;
  ReadOnlyMapping& operator=(const ReadOnlyMapping&) = delete;

  const DeviceShared* shared() const { return shared_; }

 private:
  const DeviceShared* shared_ = nullptr;
};

template <typename T>
T load(const T& field) {
  return std::atomic_ref<T>(const_cast<T&>(field)).load(std::memory_order_acquire);
}

}  // namespace

std::optional<DeviceSnapshot> read_device_snapshot(const std::filesystem::path& memory_file, std::string* error) {
  ReadOnlyMapping mapping(memory_file, error);
  const DeviceShared* shared = mapping.shared();
  if (shared == nullptr) return std::nullopt;
  if (load(shared->magic) != kDeviceMemoryMagic || load(shared->version) != kDeviceMemoryVersion) {
    *error = memory_file.string() + " is not a softverbs device memory file of this version";
    return std::nullopt;
  }
  DeviceSnapshot snapshot;
  for (size_t i = 0; i < kCounterCount; ++i)
    snapshot.counters.emplace_back(kCounterNames[i], shared->counters.get(static_cast<Counter>(i)));
  const ProcessTable& processes = shared->processes;
  for (int slot = 0; slot < ProcessTable::kCapacity; ++slot) {
    if (!processes.alive(slot)) continue;
    snapshot.contexts.push_back({static_cast<uint32_t>(slot), processes.pid_of(slot)});
  }
  auto owner_lives = [&](uint32_t live, int32_t owner_process) { return live != 0 && processes.alive(owner_process); };
  const uint32_t cq_marks = std::min<uint32_t>(load(shared->cq_high_water), limits::kMaxCq);
  std::vector<uint32_t> cq_users(cq_marks, 0);
  auto count_user = [&](int32_t cq) {
    if (cq >= 0 && static_cast<uint32_t>(cq) < cq_marks) ++cq_users[static_cast<size_t>(cq)];
  };
  const uint32_t srq_marks = std::min<uint32_t>(load(shared->srq_high_water), limits::kMaxSrq);
  std::vector<int32_t> listed_srq(srq_marks, -1);  // a record's place in snapshot.srqs
  for (uint32_t i = 0; i < srq_marks; ++i) {
    const SrqRecord& record = shared->srqs[i];
    if (!owner_lives(load(record.live), load(record.owner_process))) continue;
    const int32_t cq = load(record.cq);
    const bool xrc = load(record.xrcd_id) != 0;
    listed_srq[i] = static_cast<int32_t>(snapshot.srqs.size());
    snapshot.srqs.push_back(
        {load(record.srqn), xrc, load(record.pd_handle), xrc ? cq : -1, load(record.owner_pid), {}});
    count_user(cq);
  }
  const uint32_t qp_marks = std::min<uint32_t>(load(shared->qp_high_water), limits::kMaxQp);
  for (uint32_t i = 0; i < qp_marks; ++i) {
    const QpRecord& record = shared->qps[i];
    if (!owner_lives(load(record.live), load(record.owner_process))) continue;
    QpSnapshot qp;
    qp.qpn = load(record.qpn);
    qp.dest_qpn = load(record.attributes.dest_qpn);
    qp.sq_psn = load(record.attributes.sq_psn);
    qp.rq_psn = load(record.attributes.rq_psn);
    qp.pd_handle = load(record.pd_handle);
    qp.pid = load(record.owner_pid);
    qp.state = load(record.state);
    qp.type = load(record.type);
    qp.xrc = load(record.xrc);
    qp.cm_agent = load(record.gsi_agent) != 0;
    snapshot.qps.push_back(qp);
    if (const int32_t srq = load(record.srq);
        srq >= 0 && static_cast<uint32_t>(srq) < srq_marks && listed_srq[srq] >= 0)
      snapshot.srqs[static_cast<size_t>(listed_srq[srq])].qpns.push_back(qp.qpn);
    count_user(load(record.send_cq));
    count_user(load(record.recv_cq));
  }
  for (uint32_t i = 0; i < cq_marks; ++i) {
    const CqRecord& record = shared->cqs[i];
    if (!owner_lives(load(record.live), load(record.owner_process))) continue;
    snapshot.cqs.push_back({i, load(record.ring.producer.capacity), cq_users[i], load(record.owner_pid)});
  }
  shared->mrs.for_each_live_region([&](const MemoryRegionTable::ListedRegion& region) {
    if (!processes.alive(region.owner_process)) return;
    snapshot.mrs.push_back({region.index, region.key, region.pd_handle, region.owner_pid, region.iova, region.length});
  });
  std::sort(snapshot.qps.begin(), snapshot.qps.end(),
            [](const QpSnapshot& a, const QpSnapshot& b) { return a.qpn < b.qpn; });
  for (SrqSnapshot& srq : snapshot.srqs) std::sort(srq.qpns.begin(), srq.qpns.end());
  return snapshot;
}

}  // namespace softverbs
