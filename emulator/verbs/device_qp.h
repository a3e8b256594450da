// The part of a QP that lives in the process that made it: its send queue
// on the shared-memory transport (a send that meets an RNR, or a peer not
// ready yet, waits and is retried as an HCA's requester would), the choice
// of transport at RTR, and what each state change does to queued work.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "device/device_memory.h"
#include "device/event_socket.h"
#include "device/work_request.h"

namespace softverbs {

class DeviceContext;

// What a QP is created with, checked by the caller against the device's
// limits.
struct QpSetup {
  QpType type = QpType::Rc;
  uint32_t pd_handle = 0;
  bool signal_all = false;
  int send_cq = -1, recv_cq = -1;
  int srq = -1;  // none: the QP has a receive queue of its own
  QpCapacities caps;
  SocketAddress owner_async;  // where its async events go
  // An XRC QP has no receive queue (nor, XRC_RECV, a send queue or CQs);
  // an XRC_RECV QP belongs to the domain `xrcd_id`.
  XrcRole xrc = XrcRole::None;
  uint32_t xrcd_id = 0;
};

class DeviceQp {
 public:
  using Clock = std::chrono::steady_clock;

  // Makes the QP in the device: its record and receive queue. `caps` comes
  // back as the QP has them; nullptr and errno ENOMEM when full.
  static std::unique_ptr<DeviceQp> create(DeviceContext& context, QpSetup& setup);
  DeviceQp(DeviceContext& context, int index, int send_cq, bool on_srq);
  // Destroys the QP as the device sees it: its UDP state, its multicast
  // memberships, its completions still queued.
  ~DeviceQp();
  DeviceQp(const DeviceQp&) = delete;
  DeviceQp& operator=(const DeviceQp&) = delete;

  QpRecord& record() const;
  int index() const { return index_; }
  uint32_t qpn() const { return qpn_; }
  // The provider's handle for the QP, which its async events name.
  void set_owner_handle(uint64_t handle);
  // Serializes the send queue and state changes.
  std::mutex& mutex() { return mutex_; }
  // The send work requests posted and not yet completed by the device
  // (whether or not their completions were polled): the verbs checker's
  // question at destroy and deregistration.
  size_t outstanding_sends();

  // Under mutex(): takes the QP from `current` to `target` with attributes
  // `next` (already checked against the state machine). At INIT->RTR this
  // picks the transport. 0, or an errno and nothing changed.
  int change_state(QpState current, QpState target, const QpAttributes& next);

  // Holds the QP's lock across one ibv_post_send chain and asks the retry
  // timer once it is released (a retry pass takes QP locks).
  class PostBatch {
   public:
    explicit PostBatch(DeviceQp& qp);
    ~PostBatch();
    PostBatch(const PostBatch&) = delete;
    PostBatch& operator=(const PostBatch&) = delete;
    // The QP's scratch WQE, blank, for the caller to fill and post (its
    // vectors keep their buffers from post to post).
    SendWqe& blank_wqe();
    // Checks the QP's state and starts `wqe` (the scratch WQE, filled): 0, or
    // the errno the post fails with. An inline send's bytes need to live
    // only through this call.
    int post(SendWqe& wqe);

   private:
    DeviceQp& qp_;
    std::unique_lock<std::mutex> lock_;
    Clock::time_point due_ = Clock::time_point::max();
  };

 private:
  friend class DeviceContext;
  int choose_transport(const QpAttributes& next, bool& over_udp) const;
  bool goes_over_udp(const SendWqe& wqe) const;
  void prepare_for_udp(SendWqe& wqe);
  bool attempt(SendWqe& wqe);
  bool first_send_meets_rnr(const QpRecord& qp, const SendWqe& send);
  void complete(const Completion& completion);
  void complete_flushed(uint64_t wr_id);  // a send that ends with the QP in ERR
  void purge_own_completions();           // from both CQs (RESET)
  void enter_error_state();
  void flush_waiting_sends();
  void drop_waiting_sends();
  void fail_after_removal();
  Clock::time_point retry_due();
  // Puts the QP on its context's list of QPs with waiting sends, or takes
  // it off, as waiting_ is now (called under mutex_ after waiting_ changed).
  void update_waiting_listing();

  DeviceContext& context_;
  DeviceMemory& memory_;
  const int index_;
  const int send_cq_;
  const bool on_srq_;
  const uint32_t qpn_;
  const pid_t maker_;  // a forked child holds a copy it must not destroy
  std::mutex mutex_;
  // Sends that could not run yet on shared memory: the receiver had no WQE
  // posted (RNR), or the peer QP was not ready (RC retries until timeout x
  // retry_cnt runs out).
  std::deque<SendWqe> waiting_;
  bool waiting_listed_ = false;  // on context_.waiting_qps_ (under its waiting_qps_mutex_)
  // RC/UC: connected over UDP (chosen at RTR). UD: also receives over UDP,
  // and sends there to GIDs that are not this device's.
  bool over_udp_ = false;
  bool removal_handled_ = false;
  SendWqe scratch_;  // see PostBatch::blank_wqe
};

}  // namespace softverbs
