// The data path's queues through the installed libibverbs: completion
// queues and channels, shared receive queues, receive queues filled from
// several threads, the extended QP and CQ API.
//
// Started through `softverbs run` by ctest, on a shared-memory device, over
// UDP, with kernel copies and with the copy agent: the verbs_datapath_*_test
// files make one executable.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "process_signals.h"
#include "verbs_datapath.h"

namespace {

using namespace softverbs::test;
using softverbs::test::AlarmHandler;
using softverbs::test::ProcessSignaller;

// As large a CQ as mlx5 allows (libfabric's ofi_rxm asks for universe size
// times queue depth), without committing memory for entries not yet used.
TEST_F(RcDataPath, TheLargestCqCommitsMemoryOnlyAsCompletionsArrive) {
  ibv_device_attr attr{};
  ASSERT_EQ(ibv_query_device(context_, &attr), 0);
  EXPECT_EQ(attr.max_cqe, (1 << 22) - 1);
  const char* runtime = std::getenv("SOFTVERBS_RUNTIME_DIR");
  ASSERT_NE(runtime, nullptr);
  const std::string device_file = std::string(runtime) + "/softverbs0.mem";
  const auto committed = [&] {
    struct stat info {};
    return stat(device_file.c_str(), &info) == 0 ? static_cast<uint64_t>(info.st_blocks) * 512 : UINT64_MAX;
  };
  for (int round = 0; round < 2; ++round) {  // the second reuses the first's freed ring
    const uint64_t before = committed();
    ibv_cq* big = ibv_create_cq(context_, attr.max_cqe, nullptr, nullptr, 0);
    ASSERT_NE(big, nullptr) << std::strerror(errno);
    EXPECT_GE(big->cqe, attr.max_cqe);
    const uint64_t after = committed();
    EXPECT_LT(after > before ? after - before : 0, uint64_t{1} << 20)
        << "round " << round << ": a 256 MiB ring committed";
    EXPECT_EQ(ibv_destroy_cq(big), 0);
  }
  errno = 0;
  EXPECT_EQ(ibv_create_cq(context_, attr.max_cqe + 1, nullptr, nullptr, 0), nullptr);
  EXPECT_EQ(errno, EINVAL);
}

TEST_F(RcDataPath, CqInUseCannotBeDestroyed) {
  connect(IBV_QPT_RC);
  EXPECT_EQ(ibv_destroy_cq(cq_a_), EBUSY);
}

TEST_F(RcDataPath, ResizeCqKeepsWaitingCompletions) {
  // A CQ with a channel, so that each completion can be awaited as an event
  // and left in the CQ.
  ibv_comp_channel* channel = ibv_create_comp_channel(context_);
  ASSERT_NE(channel, nullptr);
  ibv_cq* cq = ibv_create_cq(context_, 64, nullptr, channel, 0);
  ASSERT_NE(cq, nullptr);
  qp_a_ = make_qp(IBV_QPT_RC, cq);
  qp_b_ = make_qp(IBV_QPT_RC, cq_b_);
  bring_up(IBV_QPT_RC);
  // Over UDP the completions come with the ACKs, from the background
  // thread: one WRITE at a time, each until its completion's event.
  for (uint64_t i = 0; i < 5; ++i) {
    ASSERT_EQ(ibv_req_notify_cq(cq, 0), 0);
    ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, i, 0, 8, addr_b(0), mr_b_->rkey), 0);
    ibv_cq* event_cq = nullptr;
    void* event_context = nullptr;
    ASSERT_EQ(ibv_get_cq_event(channel, &event_cq, &event_context), 0);
    ibv_ack_cq_events(cq, 1);
  }
  ASSERT_EQ(ibv_resize_cq(cq, 4), EINVAL) << "5 completions wait: they would not fit";
  ASSERT_EQ(ibv_resize_cq(cq, 1000), 0);
  EXPECT_GE(cq->cqe, 1000);
  auto done = poll_n(cq, 5);
  ASSERT_EQ(done.size(), 5u);
  for (uint64_t i = 0; i < 5; ++i) EXPECT_EQ(done[i].wr_id, i);
  EXPECT_EQ(ibv_destroy_qp(qp_a_), 0);
  qp_a_ = nullptr;
  EXPECT_EQ(ibv_destroy_cq(cq), 0);
  EXPECT_EQ(ibv_destroy_comp_channel(channel), 0);
}

TEST_F(RcDataPath, CqOverrunRaisesACqErrorEvent) {
  ibv_cq* tiny = ibv_create_cq(context_, 1, nullptr, nullptr, 0);
  ASSERT_NE(tiny, nullptr);
  qp_a_ = make_qp(IBV_QPT_RC, tiny);
  qp_b_ = make_qp(IBV_QPT_RC, cq_b_);
  bring_up(IBV_QPT_RC);
  for (uint64_t i = 0; i < 3; ++i) ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, i, 0, 8, addr_b(0), mr_b_->rkey), 0);
  ibv_async_event event;
  ASSERT_EQ(ibv_get_async_event(context_, &event), 0);
  EXPECT_EQ(event.event_type, IBV_EVENT_CQ_ERR);
  EXPECT_EQ(event.element.cq, tiny);
  ibv_ack_async_event(&event);
  ASSERT_EQ(ibv_get_async_event(context_, &event), 0);
  EXPECT_EQ(event.event_type, IBV_EVENT_QP_FATAL) << "the QP whose completion was lost";
  EXPECT_EQ(event.element.qp, qp_a_);
  ibv_ack_async_event(&event);
  EXPECT_EQ(ibv_destroy_qp(qp_a_), 0);
  qp_a_ = nullptr;
  EXPECT_EQ(ibv_destroy_cq(tiny), 0);
}

ibv_qp_state state_of(ibv_qp* qp) {
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  return ibv_query_qp(qp, &attr, IBV_QP_STATE, &init) == 0 ? attr.qp_state : IBV_QPS_UNKNOWN;
}

// Waits for the async event of `type`, skipping others (acknowledged).
bool await_async_event(ibv_context* context, ibv_event_type type) {
  for (int i = 0; i < 8; ++i) {
    ibv_async_event event;
    if (ibv_get_async_event(context, &event) != 0) return false;
    const bool wanted = event.event_type == type;
    ibv_ack_async_event(&event);
    if (wanted) return true;
  }
  return false;
}

// Polls `cq` until the completion of `wr_id` (others are dropped).
std::optional<ibv_wc> await_completion(ibv_cq* cq, uint64_t wr_id) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < give_up) {
    ibv_wc wc{};
    if (ibv_poll_cq(cq, 1, &wc) == 1 && wc.wr_id == wr_id) return wc;
  }
  return std::nullopt;
}

// An HCA moves the QP whose completion a full CQ lost to ERR: its later
// work requests complete flushed (once the application makes room).
TEST_F(RcDataPath, CqOverrunOnTheSendSideMovesTheQpToErrorAndLaterSendsFlush) {
  ibv_cq* tiny = ibv_create_cq(context_, 1, nullptr, nullptr, 0);
  ASSERT_NE(tiny, nullptr);
  qp_a_ = make_qp(IBV_QPT_RC, tiny);
  qp_b_ = make_qp(IBV_QPT_RC, cq_b_);
  bring_up(IBV_QPT_RC);
  for (uint64_t i = 0; i < 3; ++i) ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, i, 0, 8, addr_b(0), mr_b_->rkey), 0);
  ASSERT_TRUE(await_async_event(context_, IBV_EVENT_QP_FATAL));
  EXPECT_EQ(state_of(qp_a_), IBV_QPS_ERR);
  auto first = await_completion(tiny, 0);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->status, IBV_WC_SUCCESS);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 9, 0, 8, addr_b(0), mr_b_->rkey), 0);
  auto later = await_completion(tiny, 9);
  ASSERT_TRUE(later.has_value()) << "the WRITE posted after the overrun completes";
  EXPECT_EQ(later->status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(ibv_destroy_qp(qp_a_), 0);
  qp_a_ = nullptr;
  EXPECT_EQ(ibv_destroy_cq(tiny), 0);
}

TEST_F(RcDataPath, CqOverrunOnTheReceiveSideMovesTheQpToErrorAndLaterReceivesFlush) {
  ibv_cq* tiny = ibv_create_cq(context_, 2, nullptr, nullptr, 0);
  ASSERT_NE(tiny, nullptr);
  ASSERT_EQ(tiny->cqe, 2);
  qp_a_ = make_qp(IBV_QPT_RC, cq_a_);
  qp_b_ = make_qp(IBV_QPT_RC, tiny);
  bring_up(IBV_QPT_RC);
  for (uint64_t i = 0; i < 4; ++i) ASSERT_EQ(post_recv_b(100 + i, 0, 64), 0);
  for (uint64_t i = 0; i < 3; ++i) ASSERT_EQ(post_a(IBV_WR_SEND, i, 0, 8), 0);
  ASSERT_TRUE(await_async_event(context_, IBV_EVENT_QP_FATAL));
  EXPECT_EQ(state_of(qp_b_), IBV_QPS_ERR);
  auto received = poll_n(tiny, 2);
  ASSERT_EQ(received.size(), 2u);
  EXPECT_EQ(received[0].wr_id, 100u);
  EXPECT_EQ(received[1].status, IBV_WC_SUCCESS);
  // Room for two: the receive still queued (where its flush was not lost)
  // and the one posted now.
  ASSERT_EQ(post_recv_b(109, 0, 64), 0);
  auto later = await_completion(tiny, 109);
  ASSERT_TRUE(later.has_value()) << "the receive posted after the overrun completes";
  EXPECT_EQ(later->status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(ibv_destroy_qp(qp_b_), 0);
  qp_b_ = nullptr;
  EXPECT_EQ(ibv_destroy_cq(tiny), 0);
}

TEST_F(RcDataPath, SolicitedOnlyArmingWaitsForASolicitedMessage) {
  ibv_comp_channel* channel = ibv_create_comp_channel(context_);
  ASSERT_NE(channel, nullptr);
  ibv_cq* evented = ibv_create_cq(context_, 8, nullptr, channel, 0);
  ibv_qp_init_attr init{};
  init.send_cq = cq_b_;
  init.recv_cq = evented;
  init.cap = {4, 4, 1, 1, 0};
  connect_rc_with(init);
  ASSERT_EQ(ibv_req_notify_cq(evented, /*solicited_only=*/1), 0);
  ASSERT_EQ(post_recv_b(1, 0, 64), 0);
  ASSERT_EQ(post_recv_b(2, 64, 64), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 10, 0, 8), 0);  // not solicited: no event
  int flags = fcntl(channel->fd, F_GETFL);
  ASSERT_EQ(fcntl(channel->fd, F_SETFL, flags | O_NONBLOCK), 0);
  ibv_cq* event_cq = nullptr;
  void* event_context = nullptr;
  EXPECT_EQ(ibv_get_cq_event(channel, &event_cq, &event_context), -1) << "no event for an unsolicited message";
  ibv_send_wr wr{};
  ibv_sge sge{reinterpret_cast<uint64_t>(buffer_a_.data()), 8, mr_a_->lkey};
  wr.wr_id = 11;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_SOLICITED;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
  ASSERT_EQ(fcntl(channel->fd, F_SETFL, flags), 0);
  ASSERT_EQ(ibv_get_cq_event(channel, &event_cq, &event_context), 0);
  EXPECT_EQ(event_cq, evented);
  ibv_ack_cq_events(evented, 1);
  EXPECT_EQ(poll_n(evented, 2).size(), 2u);
  EXPECT_EQ(ibv_destroy_qp(qp_b_), 0);
  qp_b_ = nullptr;
  EXPECT_EQ(ibv_destroy_cq(evented), 0);
  EXPECT_EQ(ibv_destroy_comp_channel(channel), 0);
}

// Two CQs on one channel, each armed: a SEND raises an event on both (the
// sender's completion and the receiver's). Over UDP one pass of the waiting
// thread may raise both; each is delivered once, and no third appears.
TEST_F(RcDataPath, OneChannelDeliversEachArmedCqsEventOnce) {
  ibv_comp_channel* channel = ibv_create_comp_channel(context_);
  ASSERT_NE(channel, nullptr) << std::strerror(errno);
  ibv_cq* sends = ibv_create_cq(context_, 8, nullptr, channel, 0);
  ibv_cq* receives = ibv_create_cq(context_, 8, nullptr, channel, 0);
  ASSERT_TRUE(sends && receives);
  ibv_qp_init_attr init{};
  init.send_cq = cq_b_;
  init.recv_cq = receives;
  init.cap = {4, 4, 1, 1, 0};
  connect_rc_with(init, sends);
  for (uint64_t round = 0; round < 3; ++round) {
    ASSERT_EQ(ibv_req_notify_cq(sends, 0), 0);
    ASSERT_EQ(ibv_req_notify_cq(receives, 0), 0);
    ASSERT_EQ(post_recv_b(round, 0, 64), 0);
    ASSERT_EQ(post_a(IBV_WR_SEND, 100 + round, 0, 16), 0);
    std::vector<ibv_cq*> woken;
    for (int event = 0; event < 2; ++event) {
      ibv_cq* event_cq = nullptr;
      void* event_context = nullptr;
      ASSERT_EQ(ibv_get_cq_event(channel, &event_cq, &event_context), 0);
      woken.push_back(event_cq);
      ibv_ack_cq_events(event_cq, 1);
    }
    std::sort(woken.begin(), woken.end());
    std::vector<ibv_cq*> expected{sends, receives};
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(woken, expected) << "round " << round;
    const int flags = fcntl(channel->fd, F_GETFL);
    ASSERT_EQ(fcntl(channel->fd, F_SETFL, flags | O_NONBLOCK), 0);
    ibv_cq* extra = nullptr;
    void* extra_context = nullptr;
    errno = 0;
    EXPECT_EQ(ibv_get_cq_event(channel, &extra, &extra_context), -1) << "round " << round << ": a third event";
    EXPECT_EQ(errno, EAGAIN);
    ASSERT_EQ(fcntl(channel->fd, F_SETFL, flags), 0);
    auto sent = poll_n(sends, 1);
    ASSERT_EQ(sent.size(), 1u);
    EXPECT_EQ(sent[0].wr_id, 100 + round);
    auto received = poll_n(receives, 1);
    ASSERT_EQ(received.size(), 1u);
    EXPECT_EQ(received[0].wr_id, round);
  }
  EXPECT_EQ(ibv_destroy_qp(qp_a_), 0);
  qp_a_ = nullptr;
  EXPECT_EQ(ibv_destroy_qp(qp_b_), 0);
  qp_b_ = nullptr;
  EXPECT_EQ(ibv_destroy_cq(sends), 0);
  EXPECT_EQ(ibv_destroy_cq(receives), 0);
  EXPECT_EQ(ibv_destroy_comp_channel(channel), 0);
}

TEST_F(RcDataPath, CompletionChannelWakesTheWaiter) {
  EventedReceives evented = connect_with_evented_receives();
  ASSERT_NE(evented.cq, nullptr);
  ASSERT_EQ(post_recv_b(3, 0, 64), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 4, 0, 16), 0);
  ibv_cq* event_cq = nullptr;
  void* event_context = nullptr;
  ASSERT_EQ(ibv_get_cq_event(evented.channel, &event_cq, &event_context), 0);
  EXPECT_EQ(event_cq, evented.cq);
  ibv_ack_cq_events(event_cq, 1);
  expect_one_receive(evented, 3);
  destroy(evented);
}

// What the kernel's channel does, and qperf's latency tests count on (their
// SIGALRM ends the test; they hung when softverbs read again): a handler
// without SA_RESTART ends a blocking ibv_get_cq_event or ibv_get_async_event
// with EINTR, and no event is lost by it.
TEST_F(RcDataPath, ASignalInterruptsAWaitForAnEventWithEintr) {
  EventedReceives evented = connect_with_evented_receives();
  ASSERT_NE(evented.cq, nullptr);
  ASSERT_EQ(post_recv_b(1, 0, 64), 0);
  {
    AlarmHandler handler(/*restart=*/false);
    ibv_cq* event_cq = nullptr;
    void* event_context = nullptr;
    int result, error;
    {
      ProcessSignaller signaller(SIGALRM, std::chrono::seconds(5), [&] { post_a(IBV_WR_SEND, 2, 0, 8); });
      errno = 0;
      result = ibv_get_cq_event(evented.channel, &event_cq, &event_context);
      error = errno;
    }
    EXPECT_EQ(result, -1) << "the wait outlived the signals (the backstop SEND ended it)";
    EXPECT_EQ(error, EINTR) << std::strerror(error);
    EXPECT_GE(handler.count(), 1);

    ibv_async_event async{};
    {
      // No async event comes by itself: a wait the signals did not end would
      // never return, so the process ends, saying why.
      ProcessSignaller signaller(SIGALRM, std::chrono::seconds(5), [] {
        std::fputs("ibv_get_async_event outlived 100 SIGALRMs without SA_RESTART\n", stderr);
        std::_Exit(3);
      });
      errno = 0;
      result = ibv_get_async_event(context_, &async);
      error = errno;
    }
    EXPECT_EQ(result, -1) << "the async wait outlived the signals";
    EXPECT_EQ(error, EINTR) << std::strerror(error);
  }
  // The event that comes after the signal is there.
  ASSERT_EQ(post_a(IBV_WR_SEND, 3, 0, 8), 0);
  ibv_cq* event_cq = nullptr;
  void* event_context = nullptr;
  ASSERT_EQ(ibv_get_cq_event(evented.channel, &event_cq, &event_context), 0);
  EXPECT_EQ(event_cq, evented.cq);
  ibv_ack_cq_events(evented.cq, 1);
  expect_one_receive(evented, 1);
  destroy(evented);
}

// With SA_RESTART the kernel restarts the channel's read: the handler runs,
// and the wait goes on until the event.
TEST_F(RcDataPath, ASignalWhoseHandlerRestartsLeavesTheWaitForAnEventWaiting) {
  EventedReceives evented = connect_with_evented_receives();
  ASSERT_NE(evented.cq, nullptr);
  ASSERT_EQ(post_recv_b(1, 0, 64), 0);
  AlarmHandler handler(/*restart=*/true);
  ibv_cq* event_cq = nullptr;
  void* event_context = nullptr;
  int result;
  {
    ProcessSignaller signaller(SIGALRM, std::chrono::milliseconds(300), [&] { post_a(IBV_WR_SEND, 2, 0, 8); });
    result = ibv_get_cq_event(evented.channel, &event_cq, &event_context);
  }
  ASSERT_EQ(result, 0) << std::strerror(errno);
  EXPECT_EQ(event_cq, evented.cq);
  EXPECT_GE(handler.count(), 1);
  ibv_ack_cq_events(evented.cq, 1);
  expect_one_receive(evented, 1);
  destroy(evented);
}

// The threads softverbs starts in a process (its presence and copy agent,
// the UDP io thread, the background thread) take no signal of the
// application's: a process-wide SIGALRM must reach the thread that waits.
TEST_F(RcDataPath, SoftverbsThreadsBlockTheApplicationsSignals) {
  connect(IBV_QPT_RC);
  ASSERT_EQ(post_recv_b(1, 0, 64), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 2, 0, 8), 0);
  ASSERT_EQ(poll_n(cq_b_, 1).size(), 1u);
  const pid_t self = static_cast<pid_t>(syscall(SYS_gettid));
  int others = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    if (task.path().filename() == std::to_string(self)) continue;
    std::ifstream status(task.path() / "status");
    std::string line, name, blocked;
    while (std::getline(status, line)) {
      if (line.rfind("Name:", 0) == 0) name = line.substr(5);
      if (line.rfind("SigBlk:", 0) == 0) blocked = line.substr(7);
    }
    ++others;
    const unsigned long long mask = std::stoull(blocked, nullptr, 16);
    for (int signal : {SIGALRM, SIGINT, SIGTERM, SIGUSR1, SIGCHLD, SIGIO})
      EXPECT_NE(mask & (1ull << (signal - 1)), 0u) << "thread" << name << " takes signal " << signal;
  }
  EXPECT_GE(others, 1) << "softverbs starts its presence thread at the first QP";
}

TEST_F(RcDataPath, SharedReceiveQueueFeedsSeveralQpsAndRaisesItsLimitEvent) {
  ibv_srq* srq = connect_rc_on_srq(8);
  ASSERT_NE(srq, nullptr);
  EXPECT_EQ(post_recv_b(1, 0, 8), EINVAL) << "a QP on an SRQ takes no receives of its own";
  for (uint32_t i = 0; i < 3; ++i) ASSERT_EQ(post_recv_b(100 + i, 64 * i, 64, srq), 0);
  ibv_srq_attr limit{};
  limit.srq_limit = 2;
  ASSERT_EQ(ibv_modify_srq(srq, &limit, IBV_SRQ_LIMIT), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 1, 0, 16), 0);  // 2 left: not below the limit
  ASSERT_EQ(post_a(IBV_WR_SEND, 2, 0, 16), 0);  // 1 left: below
  auto received = poll_n(cq_b_, 2);
  ASSERT_EQ(received.size(), 2u);
  EXPECT_EQ(received[0].wr_id, 100u);
  EXPECT_EQ(received[1].wr_id, 101u);
  ibv_async_event event;
  ASSERT_EQ(ibv_get_async_event(context_, &event), 0);
  EXPECT_EQ(event.event_type, IBV_EVENT_SRQ_LIMIT_REACHED);
  EXPECT_EQ(event.element.srq, srq);
  ibv_ack_async_event(&event);
  ibv_srq_attr now{};
  ASSERT_EQ(ibv_query_srq(srq, &now), 0);
  EXPECT_EQ(now.srq_limit, 0u) << "the limit disarms when it fires";
  EXPECT_EQ(now.max_wr, 8u);
  EXPECT_EQ(ibv_destroy_srq(srq), EBUSY) << "a QP still uses it";
  // Moving the QP to ERR reports its last WQE.
  ibv_qp_attr error{};
  error.qp_state = IBV_QPS_ERR;
  ASSERT_EQ(ibv_modify_qp(qp_b_, &error, IBV_QP_STATE), 0);
  ASSERT_EQ(ibv_get_async_event(context_, &event), 0);
  EXPECT_EQ(event.event_type, IBV_EVENT_QP_LAST_WQE_REACHED);
  EXPECT_EQ(event.element.qp, qp_b_);
  ibv_ack_async_event(&event);
  // Once per move to ERR: not again from the UDP transport as it flushes
  // (UCX asserts on a second one), nor for a move from ERR to ERR.
  ASSERT_EQ(ibv_modify_qp(qp_b_, &error, IBV_QP_STATE), 0);
  pollfd more{context_->async_fd, POLLIN, 0};
  EXPECT_EQ(poll(&more, 1, 200), 0) << "a second asynchronous event";
  EXPECT_EQ(ibv_destroy_qp(qp_b_), 0);
  qp_b_ = nullptr;
  EXPECT_EQ(ibv_destroy_srq(srq), 0);
}

TEST_F(RcDataPath, ResizingAnSrqKeepsItsQueuedReceivesInOrder) {
  ibv_srq* srq = connect_rc_on_srq(4);
  ASSERT_NE(srq, nullptr);
  auto post_srq = [&](uint64_t wr_id) { return post_recv_b(wr_id, static_cast<uint32_t>(64 * (wr_id % 16)), 64, srq); };
  // Three taken and three posted again first, so that the queue's head is
  // not at the start of its ring when it moves.
  for (uint64_t i = 0; i < 4; ++i) ASSERT_EQ(post_srq(100 + i), 0);
  EXPECT_EQ(post_srq(999), ENOMEM);
  for (uint64_t i = 0; i < 3; ++i) ASSERT_EQ(post_a(IBV_WR_SEND, i, 0, 16), 0);
  ASSERT_EQ(poll_n(cq_b_, 3).size(), 3u);
  ASSERT_EQ(poll_n(cq_a_, 3).size(), 3u);
  for (uint64_t i = 4; i < 7; ++i) ASSERT_EQ(post_srq(100 + i), 0);
  ibv_srq_attr grow{};
  grow.max_wr = 16;
  ASSERT_EQ(ibv_modify_srq(srq, &grow, IBV_SRQ_MAX_WR), 0);
  for (uint64_t i = 7; i < 15; ++i) ASSERT_EQ(post_srq(100 + i), 0);
  for (uint64_t i = 0; i < 12; ++i) ASSERT_EQ(post_a(IBV_WR_SEND, 3 + i, 0, 16), 0) << i;
  auto received = poll_n(cq_b_, 12);
  ASSERT_EQ(received.size(), 12u);
  for (uint64_t i = 0; i < 12; ++i) {
    EXPECT_EQ(received[i].status, IBV_WC_SUCCESS) << i;
    EXPECT_EQ(received[i].wr_id, 103 + i) << "the moved receives first, in order, then the new ones";
  }
  EXPECT_TRUE(poll_n(cq_b_, 1, std::chrono::milliseconds(50)).empty());
  ASSERT_EQ(poll_n(cq_a_, 12).size(), 12u);
  ASSERT_EQ(ibv_destroy_qp(qp_b_), 0);
  qp_b_ = nullptr;
  EXPECT_EQ(ibv_destroy_srq(srq), 0);
}

TEST_F(RcDataPath, SrqLimitsAreValidated) {
  ibv_srq_init_attr init{};
  init.attr = {0, 1, 0};
  EXPECT_EQ(ibv_create_srq(pd_, &init), nullptr);
  init.attr = {1u << 20, 1, 0};
  EXPECT_EQ(ibv_create_srq(pd_, &init), nullptr);
  init.attr = {4, 1, 5};
  EXPECT_EQ(ibv_create_srq(pd_, &init), nullptr) << "limit above max_wr";
}

TEST_F(RcDataPath, ReceivesPostedFromTwoThreadsAreEachTakenOnceInOrder) {
  // ibv_post_recv is thread-safe: two threads fill one receive queue at the
  // same time, then SENDs drain it; twice, so that the ring wraps. Every
  // SEND lands in exactly one WQE, in the order they were sent, and each
  // thread's WQEs are used in the order it posted them.
  constexpr uint64_t kPerThread = 1000;
  ibv_cq* receive_cq = ibv_create_cq(context_, 2 * kPerThread, nullptr, nullptr, 0);
  ASSERT_NE(receive_cq, nullptr);
  ibv_qp_init_attr init{};
  init.send_cq = cq_b_;
  init.recv_cq = receive_cq;
  init.cap = {4, 3 * kPerThread / 2, 1, 1, 0};  // the second round wraps the ring
  connect_rc_with(init);
  uint64_t next_of[2] = {0, 0};
  for (uint32_t round = 0; round < 2; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::atomic<int> ready{0};
    std::atomic<bool> failed{false};
    auto poster = [&](uint64_t thread) {
      ++ready;
      while (ready < 2) {
      }
      for (uint64_t i = round * kPerThread / 2; i < (round + 1) * kPerThread / 2; ++i)
        if (post_recv_b(thread << 32 | i, static_cast<uint32_t>(8 * thread), 8) != 0) failed = true;
    };
    std::thread first(poster, 0), second(poster, 1);
    first.join();
    second.join();
    ASSERT_FALSE(failed) << "a post failed";
    std::vector<ibv_wc> received;
    uint32_t sent = 0, send_completions = 0;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (received.size() < kPerThread && std::chrono::steady_clock::now() < deadline) {
      if (sent < kPerThread && sent - send_completions < 4) {
        ASSERT_EQ(post_a(IBV_WR_SEND_WITH_IMM, sent, 0, 8, 0, 0, 0, sent), 0);  // its number as immediate data
        ++sent;
      }
      ibv_wc wc[16];
      int got = ibv_poll_cq(cq_a_, 16, wc);
      for (int i = 0; i < got; ++i) EXPECT_EQ(wc[i].status, IBV_WC_SUCCESS);
      send_completions += static_cast<uint32_t>(std::max(got, 0));
      got = ibv_poll_cq(receive_cq, 16, wc);
      for (int i = 0; i < got; ++i) received.push_back(wc[i]);
    }
    ASSERT_EQ(received.size(), kPerThread);
    for (size_t k = 0; k < received.size(); ++k) {
      const ibv_wc& wc = received[k];
      ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << k;
      EXPECT_EQ(ntohl(wc.imm_data), k) << "SENDs land in the order they were sent";
      EXPECT_EQ(wc.byte_len, 8u);
      const uint64_t thread = wc.wr_id >> 32;
      ASSERT_LT(thread, 2u);
      EXPECT_EQ(wc.wr_id & 0xffffffffu, next_of[thread]++) << "each thread's WQEs once each, in its order";
    }
    EXPECT_EQ(next_of[0], (round + 1) * kPerThread / 2);
    EXPECT_EQ(next_of[1], (round + 1) * kPerThread / 2);
    while (send_completions < sent) {
      auto done = poll_n(cq_a_, 1);
      ASSERT_FALSE(done.empty());
      for (const ibv_wc& wc : done) EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
      send_completions += static_cast<uint32_t>(done.size());
    }
  }
  ASSERT_EQ(ibv_destroy_qp(qp_b_), 0);
  qp_b_ = nullptr;
  EXPECT_EQ(ibv_destroy_cq(receive_cq), 0);
}

TEST_F(RcDataPath, ReceivesPostedAcrossTheMoveToErrorOrResetAreFlushedOrGone) {
  // A thread posts receives while the QP moves to ERR (every WQE that was
  // accepted completes once, flushed) or to RESET (every one is gone: the
  // first SEND after the QP is connected again takes a WQE posted after).
  ibv_qp_init_attr init{};
  init.send_cq = cq_b_;
  init.recv_cq = cq_b_;
  init.cap = {4, 64, 1, 1, 0};  // room for every receive of a round
  connect_rc_with(init);
  constexpr uint64_t kPosts = 48;  // cq_b_ holds 64
  for (uint64_t round = 0; round < 40; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const bool to_error = round % 2 == 0;
    std::atomic<uint64_t> attempted{0};
    std::vector<uint64_t> accepted;
    std::thread poster([&] {
      for (uint64_t i = 0; i < kPosts; ++i) {
        if (post_recv_b(round << 32 | i, 0, 8) == 0) accepted.push_back(round << 32 | i);
        attempted = i + 1;
      }
    });
    // The move lands at a different point of the posts in each round.
    while (attempted < (round * 7) % kPosts) {
    }
    ibv_qp_attr attr{};
    attr.qp_state = to_error ? IBV_QPS_ERR : IBV_QPS_RESET;
    ASSERT_EQ(ibv_modify_qp(qp_b_, &attr, IBV_QP_STATE), 0);
    poster.join();
    if (to_error) {
      EXPECT_EQ(accepted.size(), kPosts) << "a QP in ERR takes receives and flushes them";
      auto flushed = poll_n(cq_b_, static_cast<int>(accepted.size()));
      ASSERT_EQ(flushed.size(), accepted.size());
      for (size_t k = 0; k < flushed.size(); ++k) {
        EXPECT_EQ(flushed[k].status, IBV_WC_WR_FLUSH_ERR);
        EXPECT_EQ(flushed[k].wr_id, accepted[k]) << "each accepted WQE once, in order";
      }
      attr.qp_state = IBV_QPS_RESET;
      ASSERT_EQ(ibv_modify_qp(qp_b_, &attr, IBV_QP_STATE), 0);
    }
    EXPECT_TRUE(poll_n(cq_b_, 1, std::chrono::milliseconds(1)).empty()) << "nothing more, nothing from RESET";
    // Connected again: the queue starts empty.
    attr.qp_state = IBV_QPS_RESET;
    ASSERT_EQ(ibv_modify_qp(qp_a_, &attr, IBV_QP_STATE), 0);
    poll_n(cq_a_, 64, std::chrono::milliseconds(1));
    bring_up(IBV_QPT_RC);
    ASSERT_EQ(post_recv_b(0xfeed, 0, 8), 0);
    ASSERT_EQ(post_a(IBV_WR_SEND, 1, 0, 8), 0);
    auto received = poll_n(cq_b_, 1);
    ASSERT_EQ(received.size(), 1u);
    EXPECT_EQ(received[0].status, IBV_WC_SUCCESS);
    EXPECT_EQ(received[0].wr_id, 0xfeedu) << "a WQE from before the reset took the SEND";
    ASSERT_EQ(poll_n(cq_a_, 1).size(), 1u);
  }
}

// As rxe leaves them (mlx5 takes them out): libfabric's ofi_rxm destroys a
// connection's QP when the peer disconnects and reads its CQ after that, and
// the peer's last message must still be there.
TEST_F(RcDataPath, DestroyingAQpLeavesItsCompletionsInTheCq) {
  connect(IBV_QPT_RC);
  for (uint64_t i = 0; i < 2; ++i) ASSERT_EQ(post_recv_b(100 + i, 64 * i, 64), 0);
  for (uint64_t i = 0; i < 2; ++i) ASSERT_EQ(post_a(IBV_WR_SEND, i, 0, 8 + i), 0);
  auto sent = poll_n(cq_a_, 2);  // ACKed: both landed in B's receives
  ASSERT_EQ(sent.size(), 2u);
  const uint32_t dead_qpn = qp_b_->qp_num;
  ASSERT_EQ(ibv_destroy_qp(qp_b_), 0);
  qp_b_ = nullptr;
  auto received = poll_n(cq_b_, 2);
  ASSERT_EQ(received.size(), 2u) << "the destroyed QP's completions are still in its CQ";
  for (uint64_t i = 0; i < 2; ++i) {
    EXPECT_EQ(received[i].wr_id, 100 + i);
    EXPECT_EQ(received[i].status, IBV_WC_SUCCESS);
    EXPECT_EQ(received[i].opcode, IBV_WC_RECV);
    EXPECT_EQ(received[i].byte_len, 8 + i);
    EXPECT_EQ(received[i].qp_num, dead_qpn);
  }
  EXPECT_TRUE(poll_n(cq_b_, 1, std::chrono::milliseconds(1)).empty());
}

TEST_F(RcDataPath, ExtendedQpAndCqApis) {
  ibv_cq_init_attr_ex cq_attr{};
  cq_attr.cqe = 16;
  cq_attr.wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_QP_NUM | IBV_WC_EX_WITH_IMM;
  ibv_cq_ex* cq_ex = ibv_create_cq_ex(context_, &cq_attr);
  ASSERT_NE(cq_ex, nullptr) << std::strerror(errno);
  ibv_cq_init_attr_ex flow_tagged = cq_attr;
  flow_tagged.wc_flags |= IBV_WC_EX_WITH_FLOW_TAG;
  errno = 0;
  EXPECT_EQ(ibv_create_cq_ex(context_, &flow_tagged), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP) << "flow tags are not emulated";

  ibv_qp_init_attr_ex init{};
  init.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  init.pd = pd_;
  init.send_cq = ibv_cq_ex_to_cq(cq_ex);
  init.recv_cq = ibv_cq_ex_to_cq(cq_ex);
  init.qp_type = IBV_QPT_RC;
  init.cap = {8, 8, 2, 2, 64};
  init.send_ops_flags = IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD;
  qp_a_ = ibv_create_qp_ex(context_, &init);
  ASSERT_NE(qp_a_, nullptr) << std::strerror(errno);
  ibv_qp_ex* ex = ibv_qp_to_qp_ex(qp_a_);
  ASSERT_NE(ex, nullptr);
  qp_b_ = make_qp(IBV_QPT_RC, cq_b_);
  bring_up(IBV_QPT_RC);
  ASSERT_EQ(post_recv_b(50, 0, 64), 0);

  const char text[] = "inline hello";
  ibv_wr_start(ex);
  ex->wr_id = 1;
  ex->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_rdma_write(ex, mr_b_->rkey, addr_b(1000));
  ibv_wr_set_sge(ex, mr_a_->lkey, reinterpret_cast<uint64_t>(buffer_a_.data()), 32);
  ex->wr_id = 2;
  ibv_wr_send_imm(ex, htonl(7));
  ibv_wr_set_inline_data(ex, const_cast<char*>(text), sizeof text);
  ASSERT_EQ(ibv_wr_complete(ex), 0);

  ibv_poll_cq_attr poll{};
  std::vector<std::pair<uint64_t, ibv_wc_status>> seen;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (seen.size() < 2 && std::chrono::steady_clock::now() < deadline) {
    if (ibv_start_poll(cq_ex, &poll) != 0) continue;
    do {
      seen.emplace_back(cq_ex->wr_id, cq_ex->status);
      EXPECT_EQ(ibv_wc_read_qp_num(cq_ex), qp_a_->qp_num);
    } while (ibv_next_poll(cq_ex) == 0);
    ibv_end_poll(cq_ex);
  }
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0], std::make_pair(uint64_t{1}, IBV_WC_SUCCESS));
  EXPECT_EQ(seen[1], std::make_pair(uint64_t{2}, IBV_WC_SUCCESS));
  auto received = poll_n(cq_b_, 1);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(buffer_b_.data())), text);
  EXPECT_EQ(ntohl(received[0].imm_data), 7u);

  // A setter with no work request open fails the batch at completion.
  ibv_wr_start(ex);
  ibv_wr_set_sge(ex, mr_a_->lkey, reinterpret_cast<uint64_t>(buffer_a_.data()), 8);
  EXPECT_EQ(ibv_wr_complete(ex), EINVAL);

  EXPECT_EQ(ibv_destroy_qp(qp_a_), 0);
  qp_a_ = nullptr;
  EXPECT_EQ(ibv_destroy_cq(ibv_cq_ex_to_cq(cq_ex)), 0);
}

}  // namespace
