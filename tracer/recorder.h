// The trace library's state: the output file, the names given to verbs
// objects (kind and creation order: qp1, cq2), and the outstanding work
// requests of each queue, by which a completion is named after the post it
// completes (s3: the third send posted on its QP). All of it is guarded by
// one mutex; the wrappers take it only when they have something to record.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

namespace softverbs::trace {

enum class Kind {
  Device,
  ProtectionDomain,
  MemoryRegion,
  MemoryWindow,
  CompletionQueue,
  CompletionChannel,
  QueuePair,
  SharedReceiveQueue,
  AddressHandle,
  XrcDomain
};

// A send queue, a receive queue or an SRQ: the work posted and not yet
// completed, oldest first.
class WorkQueue {
 public:
  explicit WorkQueue(std::string prefix) : prefix_(std::move(prefix)) {}
  // The name of the work request just posted (s4).
  std::string post(uint64_t wr_id);
  // The name of the work request a completion with `wr_id` retires, or
  // empty if none is outstanding. `in_order`: the queue completes in post
  // order (a send queue), so earlier unsignaled requests retire with it.
  std::string complete(uint64_t wr_id, bool in_order);
  bool front_is(uint64_t wr_id) const { return !outstanding_.empty() && outstanding_.front().wr_id == wr_id; }
  bool holds(uint64_t wr_id) const;

 private:
  struct Posted {
    uint64_t wr_id;
    uint64_t index;
  };
  std::string prefix_;
  std::deque<Posted> outstanding_;
  uint64_t next_index_ = 1;
};

struct QueuePairState {
  std::string name;
  ibv_qp_type type = IBV_QPT_RC;
  WorkQueue send{"s"};
  WorkQueue receive{"r"};
  const ibv_srq* srq = nullptr;  // receives come from it instead
};

class Recorder {
 public:
  static Recorder& instance();

  std::mutex mutex;

  // Appends one event line (no newline) to the trace. Caller holds mutex.
  void emit(std::string_view line);
  // Writes what is buffered. Caller holds mutex.
  void flush();

  // Names a new object of `kind`. Caller holds mutex.
  std::string add(const void* object, Kind kind);
  // The object's name: "-" for none, "?" for an object made before tracing.
  std::string name(const void* object) const;
  void remove(const void* object);

  QueuePairState* add_queue_pair(const ibv_qp* qp, const ibv_srq* srq);
  QueuePairState* queue_pair(const void* qp);
  QueuePairState* queue_pair_with_number(uint32_t qp_num);
  // A local QP's name by number, else "remote": QP numbers differ between
  // devices, names do not.
  std::string queue_pair_by_number(uint32_t qp_num) const;
  WorkQueue* shared_receive_queue(const void* srq);

  // The fork handlers: the child starts a trace file of its own.
  void before_fork();
  void after_fork_in_parent();
  void after_fork_in_child();

 private:
  Recorder();
  void open_output();

  std::string path_;
  int fd_ = -1;
  bool failed_ = false;
  std::string buffer_;
  std::map<Kind, uint64_t> counters_;
  std::unordered_map<const void*, std::string> names_;
  std::unordered_map<const void*, QueuePairState> queue_pairs_;
  std::unordered_map<uint32_t, const ibv_qp*> by_number_;
  std::unordered_map<const void*, WorkQueue> shared_receive_queues_;
};

// Text for the record.
std::string errno_name(int error);
std::string result_code(int rc);  // "0" or the errno name of a positive or -1/errno result
std::string wc_status_name(ibv_wc_status status);
std::string wc_opcode_name(ibv_wc_opcode opcode);
std::string wr_opcode_name(ibv_wr_opcode opcode);
std::string send_flags_text(unsigned flags);
std::string wc_flags_text(unsigned flags);
std::string access_text(unsigned access);
std::string qp_type_name(ibv_qp_type type);
std::string qp_state_name(ibv_qp_state state);
std::string qp_attr_mask_text(int mask);

// The per-thread depth of traced calls: calls libibverbs or a provider make
// inside a traced call are not the program's and are not recorded.
class CallScope {
 public:
  CallScope();
  ~CallScope();
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
  bool outermost() const { return outermost_; }

 private:
  bool outermost_;
};

}  // namespace softverbs::trace
