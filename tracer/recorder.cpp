#include "recorder.h"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "trace_format.h"

namespace softverbs::trace {

namespace {

constexpr size_t kFlushThreshold = 64 * 1024;

thread_local int call_depth = 0;

// Joins the names of the bits set in `value`; bits without a name as hex.
template <size_t N>
std::string bits_text(unsigned value, const std::pair<unsigned, const char*> (&names)[N]) {
  std::string text;
  for (const auto& [bit, name] : names) {
    if ((value & bit) == 0) continue;
    text += (text.empty() ? "" : "|") + std::string(name);
    value &= ~bit;
  }
  if (value != 0) {
    char rest[16];
    snprintf(rest, sizeof rest, "0x%x", value);
    text += (text.empty() ? "" : "|") + std::string(rest);
  }
  return text.empty() ? "-" : text;
}

void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    data.remove_prefix(static_cast<size_t>(n));
  }
}

}  // namespace

// ---- work queues ----

std::string WorkQueue::post(uint64_t wr_id) {
  const uint64_t index = next_index_++;
  // A program that never polls must not make the tracer grow without bound.
  if (outstanding_.size() < (1u << 20)) outstanding_.push_back({wr_id, index});
  return prefix_ + std::to_string(index);
}

std::string WorkQueue::complete(uint64_t wr_id, bool in_order) {
  for (auto it = outstanding_.begin(); it != outstanding_.end(); ++it) {
    if (it->wr_id != wr_id) continue;
    std::string name = prefix_ + std::to_string(it->index);
    if (in_order)
      outstanding_.erase(outstanding_.begin(), it + 1);
    else
      outstanding_.erase(it);
    return name;
  }
  return {};
}

bool WorkQueue::holds(uint64_t wr_id) const {
  for (const Posted& posted : outstanding_)
    if (posted.wr_id == wr_id) return true;
  return false;
}

// ---- the recorder ----

Recorder& Recorder::instance() {
  // Never destroyed: wrappers may run from other threads during exit.
  static Recorder* recorder = new Recorder();
  return *recorder;
}

Recorder::Recorder() {
  if (const char* path = getenv(kOutputVariable)) path_ = path;
  pthread_atfork([] { instance().before_fork(); }, [] { instance().after_fork_in_parent(); },
                 [] { instance().after_fork_in_child(); });
  atexit([] {
    Recorder& recorder = instance();
    std::lock_guard guard(recorder.mutex);
    recorder.flush();
  });
}

void Recorder::open_output() {
  if (path_.empty() || failed_) {
    failed_ = true;
    return;
  }
  const char* root = getenv(kRootPidVariable);
  const bool is_root = root == nullptr || atol(root) == static_cast<long>(getpid());
  if (is_root) {
    fd_ = open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  } else {
    // Another process of the traced program: the first free FILE.<n>.
    for (int n = 1; n < 10000 && fd_ < 0; ++n) {
      fd_ = open((path_ + "." + std::to_string(n)).c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd_ < 0 && errno != EEXIST) break;
    }
  }
  if (fd_ < 0) {
    failed_ = true;
    const std::string message = "softverbs trace: cannot write " + path_ + ": " + strerror(errno) + "\n";
    write_all(2, message);
    return;
  }
  std::string header = std::string(kHeaderPrefix) + std::to_string(kFormatVersion) + "\n";
  write_all(fd_, header);
}

void Recorder::emit(std::string_view line) {
  if (fd_ < 0 && !failed_) open_output();
  if (failed_) return;
  buffer_.append(line);
  buffer_.push_back('\n');
  if (buffer_.size() >= kFlushThreshold) flush();
}

void Recorder::flush() {
  if (fd_ >= 0 && !buffer_.empty()) write_all(fd_, buffer_);
  buffer_.clear();
}

void Recorder::before_fork() {
  mutex.lock();
  flush();
}

void Recorder::after_fork_in_parent() { mutex.unlock(); }

void Recorder::after_fork_in_child() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  failed_ = false;
  buffer_.clear();
  mutex.unlock();
}

std::string Recorder::add(const void* object, Kind kind) {
  static const std::map<Kind, const char*> prefixes = {{Kind::Device, "dev"},         {Kind::ProtectionDomain, "pd"},
                                                       {Kind::MemoryRegion, "mr"},    {Kind::MemoryWindow, "mw"},
                                                       {Kind::CompletionQueue, "cq"}, {Kind::CompletionChannel, "ch"},
                                                       {Kind::QueuePair, "qp"},       {Kind::SharedReceiveQueue, "srq"},
                                                       {Kind::AddressHandle, "ah"},   {Kind::XrcDomain, "xrcd"}};
  std::string name = prefixes.at(kind) + std::to_string(++counters_[kind]);
  names_[object] = name;
  return name;
}

std::string Recorder::name(const void* object) const {
  if (object == nullptr) return "-";
  auto it = names_.find(object);
  return it == names_.end() ? "?" : it->second;
}

void Recorder::remove(const void* object) {
  names_.erase(object);
  auto qp = queue_pairs_.find(object);
  if (qp != queue_pairs_.end()) {
    for (auto it = by_number_.begin(); it != by_number_.end(); ++it) {
      if (it->second != object) continue;
      by_number_.erase(it);
      break;
    }
    queue_pairs_.erase(qp);
  }
  shared_receive_queues_.erase(object);
}

QueuePairState* Recorder::add_queue_pair(const ibv_qp* qp, const ibv_srq* srq) {
  QueuePairState& state = queue_pairs_[qp];
  state.name = add(qp, Kind::QueuePair);
  state.srq = srq;
  state.type = qp->qp_type;
  by_number_[qp->qp_num] = qp;
  return &state;
}

QueuePairState* Recorder::queue_pair(const void* qp) {
  auto it = queue_pairs_.find(qp);
  return it == queue_pairs_.end() ? nullptr : &it->second;
}

QueuePairState* Recorder::queue_pair_with_number(uint32_t qp_num) {
  auto it = by_number_.find(qp_num);
  return it == by_number_.end() ? nullptr : queue_pair(it->second);
}

std::string Recorder::queue_pair_by_number(uint32_t qp_num) const {
  auto it = by_number_.find(qp_num);
  return it == by_number_.end() ? "remote" : name(it->second);
}

WorkQueue* Recorder::shared_receive_queue(const void* srq) {
  auto it = shared_receive_queues_.find(srq);
  if (it != shared_receive_queues_.end()) return &it->second;
  if (names_.find(srq) == names_.end()) return nullptr;
  return &shared_receive_queues_.emplace(srq, WorkQueue(name(srq) + ".r")).first->second;
}

// ---- call depth ----

CallScope::CallScope() : outermost_(call_depth++ == 0) {}
CallScope::~CallScope() { --call_depth; }

// ---- text ----

std::string errno_name(int error) {
  if (const char* name = strerrorname_np(error)) return name;
  return "errno" + std::to_string(error);
}

std::string result_code(int rc) {
  if (rc == 0) return "0";
  if (rc == -1) return errno_name(errno);
  return errno_name(rc < 0 ? -rc : rc);
}

std::string wc_status_name(ibv_wc_status status) {
  static const char* const names[] = {"SUCCESS",
                                      "LOC_LEN_ERR",
                                      "LOC_QP_OP_ERR",
                                      "LOC_EEC_OP_ERR",
                                      "LOC_PROT_ERR",
                                      "WR_FLUSH_ERR",
                                      "MW_BIND_ERR",
                                      "BAD_RESP_ERR",
                                      "LOC_ACCESS_ERR",
                                      "REM_INV_REQ_ERR",
                                      "REM_ACCESS_ERR",
                                      "REM_OP_ERR",
                                      "RETRY_EXC_ERR",
                                      "RNR_RETRY_EXC_ERR",
                                      "LOC_RDD_VIOL_ERR",
                                      "REM_INV_RD_REQ_ERR",
                                      "REM_ABORT_ERR",
                                      "INV_EECN_ERR",
                                      "INV_EEC_STATE_ERR",
                                      "FATAL_ERR",
                                      "RESP_TIMEOUT_ERR",
                                      "GENERAL_ERR",
                                      "TM_ERR",
                                      "TM_RNDV_INCOMPLETE"};
  const auto index = static_cast<size_t>(status);
  return index < std::size(names) ? names[index] : "status" + std::to_string(index);
}

std::string wc_opcode_name(ibv_wc_opcode opcode) {
  switch (opcode) {
    case IBV_WC_SEND:
      return "SEND";
    case IBV_WC_RDMA_WRITE:
      return "RDMA_WRITE";
    case IBV_WC_RDMA_READ:
      return "RDMA_READ";
    case IBV_WC_COMP_SWAP:
      return "COMP_SWAP";
    case IBV_WC_FETCH_ADD:
      return "FETCH_ADD";
    case IBV_WC_BIND_MW:
      return "BIND_MW";
    case IBV_WC_LOCAL_INV:
      return "LOCAL_INV";
    case IBV_WC_TSO:
      return "TSO";
    case IBV_WC_ATOMIC_WRITE:
      return "ATOMIC_WRITE";
    case IBV_WC_RECV:
      return "RECV";
    case IBV_WC_RECV_RDMA_WITH_IMM:
      return "RECV_RDMA_WITH_IMM";
    case IBV_WC_TM_ADD:
      return "TM_ADD";
    case IBV_WC_TM_DEL:
      return "TM_DEL";
    case IBV_WC_TM_SYNC:
      return "TM_SYNC";
    case IBV_WC_TM_RECV:
      return "TM_RECV";
    case IBV_WC_TM_NO_TAG:
      return "TM_NO_TAG";
    default:
      return "opcode" + std::to_string(static_cast<int>(opcode));
  }
}

std::string wr_opcode_name(ibv_wr_opcode opcode) {
  switch (opcode) {
    case IBV_WR_RDMA_WRITE:
      return "RDMA_WRITE";
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return "RDMA_WRITE_WITH_IMM";
    case IBV_WR_SEND:
      return "SEND";
    case IBV_WR_SEND_WITH_IMM:
      return "SEND_WITH_IMM";
    case IBV_WR_RDMA_READ:
      return "RDMA_READ";
    case IBV_WR_ATOMIC_CMP_AND_SWP:
      return "ATOMIC_CMP_AND_SWP";
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      return "ATOMIC_FETCH_AND_ADD";
    case IBV_WR_LOCAL_INV:
      return "LOCAL_INV";
    case IBV_WR_BIND_MW:
      return "BIND_MW";
    case IBV_WR_SEND_WITH_INV:
      return "SEND_WITH_INV";
    case IBV_WR_TSO:
      return "TSO";
    case IBV_WR_DRIVER1:
      return "DRIVER1";
    case IBV_WR_ATOMIC_WRITE:
      return "ATOMIC_WRITE";
    default:
      return "opcode" + std::to_string(static_cast<int>(opcode));
  }
}

std::string send_flags_text(unsigned flags) {
  static const std::pair<unsigned, const char*> names[] = {{IBV_SEND_FENCE, "FENCE"},
                                                           {IBV_SEND_SIGNALED, "SIGNALED"},
                                                           {IBV_SEND_SOLICITED, "SOLICITED"},
                                                           {IBV_SEND_INLINE, "INLINE"},
                                                           {IBV_SEND_IP_CSUM, "IP_CSUM"}};
  return bits_text(flags, names);
}

std::string wc_flags_text(unsigned flags) {
  // IP_CSUM_OK is a device's offload, not the program's doing: left out.
  static const std::pair<unsigned, const char*> names[] = {
      {IBV_WC_GRH, "GRH"},           {IBV_WC_WITH_IMM, "WITH_IMM"},
      {IBV_WC_WITH_INV, "WITH_INV"}, {IBV_WC_TM_SYNC_REQ, "TM_SYNC_REQ"},
      {IBV_WC_TM_MATCH, "TM_MATCH"}, {IBV_WC_TM_DATA_VALID, "TM_DATA_VALID"}};
  return bits_text(flags & ~static_cast<unsigned>(IBV_WC_IP_CSUM_OK), names);
}

std::string access_text(unsigned access) {
  static const std::pair<unsigned, const char*> names[] = {{IBV_ACCESS_LOCAL_WRITE, "LOCAL_WRITE"},
                                                           {IBV_ACCESS_REMOTE_WRITE, "REMOTE_WRITE"},
                                                           {IBV_ACCESS_REMOTE_READ, "REMOTE_READ"},
                                                           {IBV_ACCESS_REMOTE_ATOMIC, "REMOTE_ATOMIC"},
                                                           {IBV_ACCESS_MW_BIND, "MW_BIND"},
                                                           {IBV_ACCESS_ZERO_BASED, "ZERO_BASED"},
                                                           {IBV_ACCESS_ON_DEMAND, "ON_DEMAND"},
                                                           {IBV_ACCESS_HUGETLB, "HUGETLB"},
                                                           {IBV_ACCESS_RELAXED_ORDERING, "RELAXED_ORDERING"}};
  return bits_text(access, names);
}

std::string qp_type_name(ibv_qp_type type) {
  switch (type) {
    case IBV_QPT_RC:
      return "RC";
    case IBV_QPT_UC:
      return "UC";
    case IBV_QPT_UD:
      return "UD";
    case IBV_QPT_RAW_PACKET:
      return "RAW_PACKET";
    case IBV_QPT_XRC_SEND:
      return "XRC_SEND";
    case IBV_QPT_XRC_RECV:
      return "XRC_RECV";
    case IBV_QPT_DRIVER:
      return "DRIVER";
    default:
      return "type" + std::to_string(static_cast<int>(type));
  }
}

std::string qp_state_name(ibv_qp_state state) {
  static const char* const names[] = {"RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR", "UNKNOWN"};
  const auto index = static_cast<size_t>(state);
  return index < std::size(names) ? names[index] : "state" + std::to_string(index);
}

std::string qp_attr_mask_text(int mask) {
  static const std::pair<unsigned, const char*> names[] = {{IBV_QP_STATE, "STATE"},
                                                           {IBV_QP_CUR_STATE, "CUR_STATE"},
                                                           {IBV_QP_EN_SQD_ASYNC_NOTIFY, "EN_SQD_ASYNC_NOTIFY"},
                                                           {IBV_QP_ACCESS_FLAGS, "ACCESS_FLAGS"},
                                                           {IBV_QP_PKEY_INDEX, "PKEY_INDEX"},
                                                           {IBV_QP_PORT, "PORT"},
                                                           {IBV_QP_QKEY, "QKEY"},
                                                           {IBV_QP_AV, "AV"},
                                                           {IBV_QP_PATH_MTU, "PATH_MTU"},
                                                           {IBV_QP_TIMEOUT, "TIMEOUT"},
                                                           {IBV_QP_RETRY_CNT, "RETRY_CNT"},
                                                           {IBV_QP_RNR_RETRY, "RNR_RETRY"},
                                                           {IBV_QP_RQ_PSN, "RQ_PSN"},
                                                           {IBV_QP_MAX_QP_RD_ATOMIC, "MAX_QP_RD_ATOMIC"},
                                                           {IBV_QP_ALT_PATH, "ALT_PATH"},
                                                           {IBV_QP_MIN_RNR_TIMER, "MIN_RNR_TIMER"},
                                                           {IBV_QP_SQ_PSN, "SQ_PSN"},
                                                           {IBV_QP_MAX_DEST_RD_ATOMIC, "MAX_DEST_RD_ATOMIC"},
                                                           {IBV_QP_PATH_MIG_STATE, "PATH_MIG_STATE"},
                                                           {IBV_QP_CAP, "CAP"},
                                                           {IBV_QP_DEST_QPN, "DEST_QPN"},
                                                           {IBV_QP_RATE_LIMIT, "RATE_LIMIT"}};
  return bits_text(static_cast<unsigned>(mask), names);
}

}  // namespace softverbs::trace
