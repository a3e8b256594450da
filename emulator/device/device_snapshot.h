// A read-only look at a device's memory for a program that does not use the
// device: the preload answers iproute2's `rdma statistic` and `rdma
// resource` from it (provider/rdma_netlink.cpp). Nothing is written or
// locked, so a program that only looks cannot disturb the device; what it
// sees may be a moment old, as the kernel's answers are.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "device/qp_state_machine.h"

namespace softverbs {

struct QpSnapshot {
  uint32_t qpn = 0;
  uint32_t dest_qpn = 0;
  uint32_t sq_psn = 0;
  uint32_t rq_psn = 0;
  uint32_t pd_handle = 0;
  int32_t pid = 0;
  QpState state = QpState::Reset;
  QpType type = QpType::Rc;
  XrcRole xrc = XrcRole::None;
  bool cm_agent = false;  // the rdma_cm shim's QP1 stand-in (a UD QP)
};

struct CqSnapshot {
  uint32_t cqn = 0;    // its record's index
  uint32_t cqe = 0;    // its capacity
  uint32_t users = 0;  // references by QPs (as send and as receive CQ) and XRC SRQs
  int32_t pid = 0;
};

struct MrSnapshot {
  uint32_t mrn = 0;  // its slot in the key table
  uint32_t key = 0;  // lkey and rkey alike
  uint32_t pd_handle = 0;
  int32_t pid = 0;
  uint64_t iova = 0;
  uint64_t length = 0;
};

struct SrqSnapshot {
  uint32_t srqn = 0;
  bool xrc = false;
  uint32_t pd_handle = 0;
  int32_t cqn = -1;  // an XRC SRQ's CQ; -1 for a basic SRQ
  int32_t pid = 0;
  std::vector<uint32_t> qpns;  // the QPs that receive from it
};

// A process using the device: as the kernel lists each open context.
struct ContextSnapshot {
  uint32_t ctxn = 0;  // its record in the device's process table
  int32_t pid = 0;
};

struct DeviceSnapshot {
  // Every transport counter, summed over the processes that used the device.
  std::vector<std::pair<std::string, uint64_t>> counters;
  // The objects of live processes: an exited process's are not counted,
  // whether or not they were reclaimed yet.
  std::vector<ContextSnapshot> contexts;  // by ctxn
  std::vector<SrqSnapshot> srqs;          // by SRQ record
  std::vector<QpSnapshot> qps;            // by QPN
  std::vector<CqSnapshot> cqs;            // by CQN
  std::vector<MrSnapshot> mrs;            // by MR number (windows are not MRs)
};

// nullopt, with the reason in `error`, when `memory_file` cannot be read or
// is no device memory of this softverbs version.
std::optional<DeviceSnapshot> read_device_snapshot(const std::filesystem::path& memory_file, std::string* error);

}  // namespace softverbs
