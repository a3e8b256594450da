// The rdma_cm API and the rdma_verbs.h helpers through real rdma_cm_ids
// between two processes. ctest starts this binary through `softverbs run`,
// so it links against the stock librdmacm and gets ours at run time.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netdb.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "process_signals.h"
#include "task_state.h"

namespace {

// What the passive side tells the active one in the accept's private data.
struct Advert {
  uint64_t address;
  uint32_t rkey;
  uint32_t length;
};

constexpr size_t kBuffer = 4096;

rdma_addrinfo* address_info(const char* port, bool passive) {
  rdma_addrinfo hints{};
  hints.ai_port_space = RDMA_PS_TCP;
  hints.ai_flags = passive ? RAI_PASSIVE : 0;
  rdma_addrinfo* info = nullptr;
  if (rdma_getaddrinfo("127.0.0.1", port, &hints, &info) != 0) return nullptr;
  return info;
}

ibv_qp_init_attr qp_attributes() {
  ibv_qp_init_attr attr{};
  attr.cap.max_send_wr = attr.cap.max_recv_wr = 8;
  attr.cap.max_send_sge = attr.cap.max_recv_sge = 2;
  attr.sq_sig_all = 1;
  return attr;
}

// An asynchronous id on `channel` whose address and route to
// 127.0.0.1:`port` are resolved (each event checked and acked), or nullptr.
rdma_cm_id* resolved_id(rdma_event_channel* channel, uint16_t port) {
  rdma_cm_id* id = nullptr;
  if (rdma_create_id(channel, &id, nullptr, RDMA_PS_TCP) != 0) return nullptr;
  sockaddr_in destination{};
  destination.sin_family = AF_INET;
  destination.sin_port = htons(port);
  destination.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  rdma_cm_event* event = nullptr;
  if (rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&destination), 1000) != 0 ||
      rdma_get_cm_event(channel, &event) != 0)
    return nullptr;
  const bool address = event->event == RDMA_CM_EVENT_ADDR_RESOLVED;
  rdma_ack_cm_event(event);
  if (!address || rdma_resolve_route(id, 1000) != 0 || rdma_get_cm_event(channel, &event) != 0) return nullptr;
  const bool route = event->event == RDMA_CM_EVENT_ROUTE_RESOLVED;
  rdma_ack_cm_event(event);
  return route ? id : nullptr;
}

// The same, connecting (its REQ sent).
rdma_cm_id* connecting_id(rdma_event_channel* channel, uint16_t port) {
  rdma_cm_id* id = resolved_id(channel, port);
  rdma_conn_param param{};
  if (id == nullptr || rdma_connect(id, &param) != 0) return nullptr;
  return id;
}

// A listener on its own channel, bound to 127.0.0.1:`port`.
rdma_cm_id* listening_id(rdma_event_channel* channel, uint16_t port) {
  rdma_cm_id* listener = nullptr;
  if (rdma_create_id(channel, &listener, nullptr, RDMA_PS_TCP) != 0) return nullptr;
  sockaddr_in local{};
  local.sin_family = AF_INET;
  local.sin_port = htons(port);
  local.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (rdma_bind_addr(listener, reinterpret_cast<sockaddr*>(&local)) != 0 || rdma_listen(listener, 4) != 0)
    return nullptr;
  return listener;
}

// The passive side, in a child process: accepts one connection, advertises
// a buffer for RDMA WRITE/READ, receives into two scattered buffers and a
// too-small one, then echoes what it got and waits for the disconnect.
// Exit code 0: everything it saw was as expected.
[[noreturn]] void run_passive(const char* port, int ready_fd) {
  auto fail = [](int code) { _exit(code); };
  rdma_addrinfo* info = address_info(port, true);
  if (!info) fail(2);
  ibv_qp_init_attr attr = qp_attributes();
  rdma_cm_id* listen_id = nullptr;
  if (rdma_create_ep(&listen_id, info, nullptr, &attr) != 0) fail(3);
  if (rdma_listen(listen_id, 1) != 0) fail(4);
  char ready = 'r';
  if (write(ready_fd, &ready, 1) != 1) fail(5);
  rdma_cm_id* id = nullptr;
  if (rdma_get_request(listen_id, &id) != 0) fail(6);
  // The REQ's private data arrives in the full 56-byte area.
  if (id->event == nullptr || id->event->param.conn.private_data_len != 56 ||
      std::memcmp(id->event->param.conn.private_data, "hello", 6) != 0)
    fail(7);
  std::vector<char> remote(kBuffer, 0), first(16, 0), second(16, 0), small(4, 0);
  ibv_mr* remote_mr = rdma_reg_write(id, remote.data(), remote.size());
  ibv_mr* read_mr = remote_mr ? ibv_reg_mr(id->pd, remote.data(), remote.size(),
                                           IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE)
                              : nullptr;
  ibv_mr* first_mr = rdma_reg_msgs(id, first.data(), first.size());
  ibv_mr* second_mr = rdma_reg_msgs(id, second.data(), second.size());
  ibv_mr* small_mr = rdma_reg_msgs(id, small.data(), small.size());
  if (!remote_mr || !read_mr || !first_mr || !second_mr || !small_mr) fail(8);
  ibv_sge scattered[2] = {{reinterpret_cast<uint64_t>(first.data()), 10, first_mr->lkey},
                          {reinterpret_cast<uint64_t>(second.data()), 16, second_mr->lkey}};
  if (rdma_post_recvv(id, reinterpret_cast<void*>(0xaa), scattered, 2) != 0) fail(9);
  if (rdma_post_recv(id, reinterpret_cast<void*>(0xbb), small.data(), small.size(), small_mr) != 0) fail(10);
  std::memcpy(remote.data(), "server bytes", 13);
  Advert advert{reinterpret_cast<uint64_t>(remote.data()), read_mr->rkey, static_cast<uint32_t>(kBuffer)};
  rdma_conn_param param{};
  param.private_data = &advert;
  param.private_data_len = sizeof advert;
  param.responder_resources = param.initiator_depth = 1;
  if (rdma_accept(id, &param) != 0) fail(11);
  ibv_wc wc{};
  // 1: a 20-byte SEND scattered over 10 + 16 bytes.
  if (rdma_get_recv_comp(id, &wc) != 1 || wc.status != IBV_WC_SUCCESS || wc.wr_id != 0xaa || wc.byte_len != 20 ||
      std::memcmp(first.data(), "0123456789", 10) != 0 || std::memcmp(second.data(), "abcdefghij", 10) != 0)
    fail(12);
  // 2: too long for its 4-byte buffer: a local length error here.
  if (rdma_get_recv_comp(id, &wc) != 1 || wc.status != IBV_WC_LOC_LEN_ERR || wc.wr_id != 0xbb) fail(13);
  // The QP is in error now; wait for the peer to disconnect.
  rdma_cm_event* event = nullptr;
  // A synchronous id has a channel of its own, as with librdmacm.
  if (id->channel == nullptr || id->channel == listen_id->channel) fail(15);
  if (rdma_get_cm_event(id->channel, &event) != 0 || event->event != RDMA_CM_EVENT_DISCONNECTED) fail(16);
  rdma_ack_cm_event(event);
  bool written = std::memcmp(remote.data() + 100, "written!", 9) == 0;
  rdma_disconnect(id);
  rdma_dereg_mr(remote_mr);
  rdma_dereg_mr(read_mr);
  rdma_dereg_mr(first_mr);
  rdma_dereg_mr(second_mr);
  rdma_dereg_mr(small_mr);
  rdma_destroy_ep(id);
  rdma_destroy_ep(listen_id);
  rdma_freeaddrinfo(info);
  _exit(written ? 0 : 14);
}

class RdmaCm : public ::testing::Test {
 protected:
  void start_passive(const char* port) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    passive_ = fork();
    if (passive_ == 0) run_passive(port, fds[1]);
    char ready;
    ASSERT_EQ(read(fds[0], &ready, 1), 1);
    close(fds[0]);
    close(fds[1]);
  }
  // An active id connected to the passive side at `info` (a REQ with
  // "hello"), or nullptr.
  rdma_cm_id* connect_to_passive(rdma_addrinfo* info) {
    ibv_qp_init_attr attr = qp_attributes();
    rdma_cm_id* id = nullptr;
    if (rdma_create_ep(&id, info, nullptr, &attr) != 0) return nullptr;
    rdma_conn_param param{};
    param.private_data = "hello";
    param.private_data_len = 6;
    param.responder_resources = param.initiator_depth = 1;
    param.retry_count = param.rnr_retry_count = 7;
    if (rdma_connect(id, &param) != 0) {
      rdma_destroy_ep(id);
      return nullptr;
    }
    return id;
  }
  int passive_exit_code() {
    int status = 0;
    waitpid(passive_, &status, 0);
    passive_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  void TearDown() override {
    if (passive_ > 0) {
      kill(passive_, SIGKILL);
      waitpid(passive_, nullptr, 0);
    }
  }
  pid_t passive_ = -1;
};

// rdma_post_write, _read, _readv and _writev on the buffer the passive
// side advertised, from `local` (registered as `local_mr` for reads and, at
// +32, as `sink_mr` for what is read).
void write_and_read_the_advertised_buffer(rdma_cm_id* id, const Advert& advert, char* local, ibv_mr* local_mr,
                                          ibv_mr* sink_mr) {
  ibv_wc wc{};
  ASSERT_EQ(rdma_post_write(id, reinterpret_cast<void*>(0x2), local, 9, local_mr, 0, advert.address + 100, advert.rkey),
            0);
  ASSERT_EQ(rdma_get_send_comp(id, &wc), 1);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.wr_id, 0x2u);
  ASSERT_EQ(rdma_post_read(id, reinterpret_cast<void*>(0x3), local + 32, 13, sink_mr, 0, advert.address, advert.rkey),
            0);
  ASSERT_EQ(rdma_get_send_comp(id, &wc), 1);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.opcode, IBV_WC_RDMA_READ);
  EXPECT_STREQ(local + 32, "server bytes");
  // rdma_post_readv into two pieces.
  std::memset(local + 32, 0, 32);
  ibv_sge pieces[2] = {{reinterpret_cast<uint64_t>(local + 32), 6, sink_mr->lkey},
                       {reinterpret_cast<uint64_t>(local + 48), 7, sink_mr->lkey}};
  ASSERT_EQ(rdma_post_readv(id, reinterpret_cast<void*>(0x4), pieces, 2, 0, advert.address, advert.rkey), 0);
  ASSERT_EQ(rdma_get_send_comp(id, &wc), 1);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(std::string(local + 32, 6), "server");
  EXPECT_EQ(std::string(local + 48, 7), std::string(" bytes\0", 7));
  // rdma_post_writev from two pieces.
  ibv_sge sources[2] = {{reinterpret_cast<uint64_t>(local), 4, local_mr->lkey},
                        {reinterpret_cast<uint64_t>(local + 4), 5, local_mr->lkey}};
  ASSERT_EQ(rdma_post_writev(id, reinterpret_cast<void*>(0x5), sources, 2, 0, advert.address + 100, advert.rkey), 0);
  ASSERT_EQ(rdma_get_send_comp(id, &wc), 1);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
}

TEST_F(RdmaCm, SeedCallsBetweenTwoProcesses) {
  start_passive("7401");
  rdma_addrinfo* info = address_info("7401", false);
  ASSERT_NE(info, nullptr);
  ibv_qp_init_attr attr = qp_attributes();
  rdma_cm_id* id = nullptr;
  ASSERT_EQ(rdma_create_ep(&id, info, nullptr, &attr), 0) << std::strerror(errno);
  ASSERT_NE(id->qp, nullptr);
  ASSERT_NE(id->send_cq, nullptr) << "rdma_create_ep made CQs with channels";
  ASSERT_NE(id->recv_cq_channel, nullptr);

  char message[32] = "0123456789abcdefghij";
  ibv_mr* message_mr = rdma_reg_msgs(id, message, sizeof message);
  ASSERT_NE(message_mr, nullptr);
  // Before the connection the QP is not ready to send.
  EXPECT_NE(rdma_post_send(id, nullptr, message, 4, message_mr, 0), 0);

  rdma_conn_param param{};
  const char hello[] = "hello";
  param.private_data = hello;
  param.private_data_len = sizeof hello;
  param.responder_resources = param.initiator_depth = 1;
  param.retry_count = param.rnr_retry_count = 7;
  ASSERT_EQ(rdma_connect(id, &param), 0) << std::strerror(errno);
  ASSERT_NE(id->event, nullptr);
  ASSERT_EQ(id->event->param.conn.private_data_len, 196) << "a REP's whole private data area";
  Advert advert;
  std::memcpy(&advert, id->event->param.conn.private_data, sizeof advert);
  // The QP got what the kernel's CM would give it: the connection's retry
  // counts and the longest RNR NAK delay.
  ibv_qp_attr connected{};
  ibv_qp_init_attr created{};
  ASSERT_EQ(ibv_query_qp(id->qp, &connected, IBV_QP_STATE | IBV_QP_MIN_RNR_TIMER | IBV_QP_RNR_RETRY | IBV_QP_RETRY_CNT,
                         &created),
            0);
  EXPECT_EQ(connected.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(connected.min_rnr_timer, 0) << "655.36 ms, as an RC QP's RTR attributes from the IB CM";
  EXPECT_EQ(connected.rnr_retry, 7);
  EXPECT_EQ(connected.retry_cnt, 7);

  ibv_wc wc{};
  // rdma_post_sendv: two SGEs, 10 + 10 bytes; the context comes back as wr_id.
  ibv_sge gather[2] = {{reinterpret_cast<uint64_t>(message), 10, message_mr->lkey},
                       {reinterpret_cast<uint64_t>(message + 10), 10, message_mr->lkey}};
  ASSERT_EQ(rdma_post_sendv(id, reinterpret_cast<void*>(0x1234), gather, 2, 0), 0);
  ASSERT_EQ(rdma_get_send_comp(id, &wc), 1);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.wr_id, 0x1234u);

  // rdma_post_write / rdma_post_read on the advertised buffer.
  char local[64] = "written!";
  ibv_mr* local_mr = rdma_reg_read(id, local, sizeof local);
  ibv_mr* sink_mr = rdma_reg_msgs(id, local + 32, 32);
  ASSERT_TRUE(local_mr && sink_mr);
  ASSERT_NO_FATAL_FAILURE(write_and_read_the_advertised_buffer(id, advert, local, local_mr, sink_mr));

  // A SEND too long for the peer's posted receive.
  ASSERT_EQ(rdma_post_send(id, reinterpret_cast<void*>(0x6), message, 20, message_mr, 0), 0);
  ASSERT_EQ(rdma_get_send_comp(id, &wc), 1);
  EXPECT_EQ(wc.status, IBV_WC_REM_INV_REQ_ERR);
  EXPECT_EQ(wc.wr_id, 0x6u);

  rdma_disconnect(id);
  EXPECT_EQ(passive_exit_code(), 0) << "the passive side's checks (see run_passive)";
  rdma_dereg_mr(message_mr);
  rdma_dereg_mr(local_mr);
  rdma_dereg_mr(sink_mr);
  rdma_destroy_ep(id);
  rdma_freeaddrinfo(info);
}

// A wrong rkey and an unregistered buffer, through the helpers.
TEST_F(RdmaCm, ErrorsComeBackAsCompletionStatuses) {
  start_passive("7402");
  rdma_addrinfo* info = address_info("7402", false);
  rdma_cm_id* id = connect_to_passive(info);
  ASSERT_NE(id, nullptr) << std::strerror(errno);
  Advert advert;
  std::memcpy(&advert, id->event->param.conn.private_data, sizeof advert);
  char local[16] = "x";
  ibv_mr* mr = rdma_reg_msgs(id, local, sizeof local);
  ibv_wc wc{};
  ASSERT_EQ(rdma_post_read(id, reinterpret_cast<void*>(0x7), local, 8, mr, 0, advert.address, advert.rkey ^ 0x40), 0);
  ASSERT_EQ(rdma_get_send_comp(id, &wc), 1);
  EXPECT_EQ(wc.status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(wc.wr_id, 0x7u);
  rdma_destroy_ep(id);  // the passive side exits when we go away
  rdma_dereg_mr(mr);
  rdma_freeaddrinfo(info);
}

// An application may destroy an id's QP with ibv_destroy_qp, behind the
// shim's back (perftest does), and the peer may go away afterwards: the
// shim's connection thread must not touch that QP then, since librdmacm,
// whose DISCONNECTED leaves the QP alone, would not either. (It used to move
// the QP to ERR: a use after free, which ASan reports and which crashed
// 1 in ~30 runs of the perftest -R pairs.)
TEST_F(RdmaCm, PeerGoingAwayAfterIbvDestroyQpTouchesNoQp) {
  start_passive("7403");
  rdma_addrinfo* info = address_info("7403", false);
  rdma_cm_id* id = connect_to_passive(info);
  ASSERT_NE(id, nullptr) << std::strerror(errno);
  // As perftest tears down: verbs objects with ibv_*, id->qp left as it
  // was, the id last with rdma_destroy_id.
  ASSERT_EQ(ibv_destroy_qp(id->qp), 0);
  ASSERT_EQ(ibv_destroy_cq(id->send_cq), 0);
  if (id->recv_cq != id->send_cq) {
    ASSERT_EQ(ibv_destroy_cq(id->recv_cq), 0);
  }
  ASSERT_EQ(ibv_destroy_comp_channel(id->send_cq_channel), 0);
  if (id->recv_cq_channel != id->send_cq_channel) {
    ASSERT_EQ(ibv_destroy_comp_channel(id->recv_cq_channel), 0);
  }
  // The peer's process dies: its shim's connection closes under ours.
  kill(passive_, SIGKILL);
  EXPECT_EQ(passive_exit_code(), 128 + SIGKILL);
  EXPECT_EQ(rdma_destroy_id(id), 0);
  rdma_freeaddrinfo(info);
}

// rping's CM thread loops in rdma_get_cm_event while its main thread tears
// down and destroys the channel: on the kernel's channel that thread stays
// blocked until the process exits, whether it was already waiting or gets
// there a moment later; it must not come back with an error (rping exits
// with it). The thread that destroyed the channel gets EBADF, as a closed
// descriptor would give it.
// The thread that destroys a channel gets EBADF from it; another that
// calls on it afterwards (rping's CM thread, when its main thread tears
// down first) blocks for good, as on the kernel's channel, rather than
// return or spin: it reaches a futex wait and stays there. In a child
// process, whose exit ends the blocked thread.
TEST(RdmaCmAlone, AChannelDestroyedUnderAnotherThreadKeepsItBlocked) {
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    rdma_event_channel* channel = rdma_create_event_channel();
    if (channel == nullptr) _exit(errno == 0 ? 10 : 100 + errno % 100);
    rdma_destroy_event_channel(channel);
    rdma_cm_event* event = nullptr;
    errno = 0;
    if (rdma_get_cm_event(channel, &event) != -1 || errno != EBADF) _exit(11);
    std::atomic<pid_t> tid{0};
    std::atomic<bool> returned{false};
    std::thread late([&] {
      tid = gettid();
      rdma_cm_event* ignored = nullptr;
      rdma_get_cm_event(channel, &ignored);
      returned = true;
    });
    while (tid == 0) std::this_thread::yield();
    const bool blocked =
        softverbs::test::wait_until_sleeping_in_futex(tid, [&] { return returned.load(); }) && !returned;
    _exit(blocked ? 0 : 12);  // `late` ends with the process
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "10, 1xx: no channel (errno xx), 11: the destroyer did not get EBADF, 12: the other thread "
         "returned or never slept";
}

// rdma_get_cm_event blocks in the kernel as a read does: a signal's handler
// without SA_RESTART ends it with EINTR, one with SA_RESTART does not, and
// the event that comes afterwards is there.
TEST(RdmaCmAlone, ASignalInterruptsAWaitForACmEventWithEintrUnlessItsHandlerRestarts) {
  rdma_event_channel* channel = rdma_create_event_channel();
  ASSERT_NE(channel, nullptr);
  rdma_cm_event* event = nullptr;
  {
    softverbs::test::AlarmHandler handler(/*restart=*/false);
    int result, error;
    {
      // Nothing else would end the wait: the process ends, saying why.
      softverbs::test::ProcessSignaller signaller(SIGALRM, std::chrono::seconds(5), [] {
        std::fputs("rdma_get_cm_event outlived 100 SIGALRMs without SA_RESTART\n", stderr);
        std::_Exit(3);
      });
      errno = 0;
      result = rdma_get_cm_event(channel, &event);
      error = errno;
    }
    EXPECT_EQ(result, -1);
    EXPECT_EQ(error, EINTR) << std::strerror(error);
    EXPECT_GE(handler.count(), 1);
  }
  rdma_cm_id* id = nullptr;
  ASSERT_EQ(rdma_create_id(channel, &id, nullptr, RDMA_PS_TCP), 0);
  sockaddr_in destination{};
  destination.sin_family = AF_INET;
  destination.sin_port = htons(7498);
  destination.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  {
    softverbs::test::AlarmHandler handler(/*restart=*/true);
    int result;
    {
      softverbs::test::ProcessSignaller signaller(SIGALRM, std::chrono::milliseconds(300), [&] {
        rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&destination), 1000);
      });
      result = rdma_get_cm_event(channel, &event);
    }
    ASSERT_EQ(result, 0) << std::strerror(errno);
    EXPECT_GE(handler.count(), 1);
    EXPECT_EQ(event->event, RDMA_CM_EVENT_ADDR_RESOLVED);
    rdma_ack_cm_event(event);
  }
  EXPECT_EQ(rdma_destroy_id(id), 0);
  rdma_destroy_event_channel(channel);
}

TEST(RdmaCmAlone, NoListenerMeansRejected) {
  rdma_event_channel* channel = rdma_create_event_channel();
  ASSERT_NE(channel, nullptr);
  rdma_cm_id* id = resolved_id(channel, 7499);
  ASSERT_NE(id, nullptr);
  EXPECT_NE(id->verbs, nullptr) << "a local address maps to the softverbs device";
  rdma_cm_event* event = nullptr;
  rdma_conn_param param{};
  char too_long[57] = {};
  param.private_data = too_long;
  param.private_data_len = sizeof too_long;
  errno = 0;
  EXPECT_EQ(rdma_connect(id, &param), -1) << "57 bytes: more than a REQ carries";
  EXPECT_EQ(errno, EINVAL);
  param.private_data_len = 56;
  ASSERT_EQ(rdma_connect(id, &param), 0);
  ASSERT_EQ(rdma_get_cm_event(channel, &event), 0);
  EXPECT_EQ(event->event, RDMA_CM_EVENT_REJECTED);
  EXPECT_EQ(event->status, 8) << "IB CM: invalid service ID";
  rdma_ack_cm_event(event);
  // A channel whose fd is non-blocking reports EAGAIN when empty.
  int flags = fcntl(channel->fd, F_GETFL);
  ASSERT_EQ(fcntl(channel->fd, F_SETFL, flags | O_NONBLOCK), 0);
  errno = 0;
  EXPECT_EQ(rdma_get_cm_event(channel, &event), -1);
  EXPECT_EQ(errno, EAGAIN);
  EXPECT_EQ(rdma_destroy_id(id), 0);
  rdma_destroy_event_channel(channel);
}

TEST(RdmaCmAlone, WildcardBindHasNoDeviceAndBadAddressesAreRefused) {
  rdma_event_channel* channel = rdma_create_event_channel();
  rdma_cm_id* id = nullptr;
  ASSERT_EQ(rdma_create_id(channel, &id, nullptr, RDMA_PS_TCP), 0);
  sockaddr_in any{};
  any.sin_family = AF_INET;
  ASSERT_EQ(rdma_bind_addr(id, reinterpret_cast<sockaddr*>(&any)), 0);
  EXPECT_EQ(id->verbs, nullptr);
  EXPECT_NE(rdma_get_src_port(id), 0) << "port 0 picks one";
  rdma_cm_id* other = nullptr;
  ASSERT_EQ(rdma_create_id(channel, &other, nullptr, RDMA_PS_TCP), 0);
  sockaddr_in foreign{};
  foreign.sin_family = AF_INET;
  foreign.sin_addr.s_addr = inet_addr("192.0.2.77");  // TEST-NET-1: not ours
  errno = 0;
  EXPECT_EQ(rdma_bind_addr(other, reinterpret_cast<sockaddr*>(&foreign)), -1);
  EXPECT_EQ(errno, EADDRNOTAVAIL);
  errno = 0;
  EXPECT_EQ(rdma_create_id(channel, &other, nullptr, static_cast<rdma_port_space>(7)), -1);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_STREQ(rdma_event_str(RDMA_CM_EVENT_ESTABLISHED), "RDMA_CM_EVENT_ESTABLISHED");
  rdma_destroy_id(id);
  rdma_destroy_event_channel(channel);
}

// A name or service that does not resolve: getaddrinfo's code comes back,
// as librdmacm returns it, for the tools' gai_strerror.
TEST(RdmaCmAlone, AddressesThatDoNotResolveGiveGetaddrinfosCode) {
  rdma_addrinfo hints{};
  hints.ai_port_space = RDMA_PS_TCP;
  rdma_addrinfo* info = nullptr;
  EXPECT_EQ(rdma_getaddrinfo("127.0.0.1", "no-such-service", &hints, &info), EAI_SERVICE);
  hints.ai_flags = RAI_NUMERICHOST;
  EXPECT_EQ(rdma_getaddrinfo("256.1.1.1", "7471", &hints, &info), EAI_NONAME);
  EXPECT_EQ(info, nullptr);
  ASSERT_EQ(rdma_getaddrinfo("127.0.0.1", "7471", &hints, &info), 0);
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(info->ai_dst_addr->sa_family, AF_INET);
  rdma_freeaddrinfo(info);
}

// What the hints leave open follows from what they give, as librdmacm
// derives it through getaddrinfo's socket type and protocol.
TEST(RdmaCmAlone, AddressInfoDerivesTheQpTypeAndPortSpaceFromEachOther) {
  struct Case {
    uint32_t qp_type;
    int port_space;
    uint32_t want_qp_type;
    int want_port_space;
  };
  const Case cases[] = {{0, 0, IBV_QPT_RC, RDMA_PS_TCP},
                        {0, RDMA_PS_UDP, IBV_QPT_UD, RDMA_PS_UDP},
                        {0, RDMA_PS_TCP, IBV_QPT_RC, RDMA_PS_TCP},
                        {IBV_QPT_UD, 0, IBV_QPT_UD, RDMA_PS_UDP},
                        {IBV_QPT_RC, 0, IBV_QPT_RC, RDMA_PS_TCP},
                        {IBV_QPT_XRC_SEND, RDMA_PS_IB, IBV_QPT_XRC_SEND, RDMA_PS_IB},
                        {IBV_QPT_UD, RDMA_PS_IPOIB, IBV_QPT_UD, RDMA_PS_IPOIB}};
  for (const Case& c : cases) {
    rdma_addrinfo hints{};
    hints.ai_qp_type = static_cast<int>(c.qp_type);
    hints.ai_port_space = c.port_space;
    rdma_addrinfo* info = nullptr;
    ASSERT_EQ(rdma_getaddrinfo("127.0.0.1", "7471", &hints, &info), 0) << c.qp_type << " " << c.port_space;
    EXPECT_EQ(static_cast<uint32_t>(info->ai_qp_type), c.want_qp_type) << c.qp_type << " " << c.port_space;
    EXPECT_EQ(info->ai_port_space, c.want_port_space) << c.qp_type << " " << c.port_space;
    rdma_freeaddrinfo(info);
  }
}

// As librdmacm (cma.c): a synchronous id (NULL channel) has a channel of
// its own; rdma_migrate_id onto an application's channel makes it
// asynchronous, as libfabric's verbs provider relies on (it resolves the
// address synchronously, migrates, then waits for events with epoll), and
// migrating to NULL makes an asynchronous id synchronous again.
TEST(RdmaCmAlone, MigratingAnIdChangesWhetherItIsSynchronous) {
  rdma_cm_id* id = nullptr;
  ASSERT_EQ(rdma_create_id(nullptr, &id, nullptr, RDMA_PS_TCP), 0);
  ASSERT_NE(id->channel, nullptr) << "a synchronous id's own channel";
  errno = 0;
  EXPECT_EQ(rdma_migrate_id(id, nullptr), -1) << "synchronous already";
  EXPECT_EQ(errno, EINVAL);
  sockaddr_in peer{};
  peer.sin_family = AF_INET;
  peer.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  peer.sin_port = htons(7499);
  ASSERT_EQ(rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&peer), 2000), 0) << "returns resolved";
  EXPECT_NE(id->verbs, nullptr);

  rdma_event_channel* channel = rdma_create_event_channel();
  ASSERT_NE(channel, nullptr);
  ASSERT_EQ(rdma_migrate_id(id, channel), 0);
  EXPECT_EQ(id->channel, channel);
  ASSERT_EQ(rdma_resolve_route(id, 2000), 0);
  // Asynchronous now: the result is an event on the new channel, whose
  // descriptor is readable for it.
  pollfd readable{channel->fd, POLLIN, 0};
  ASSERT_EQ(poll(&readable, 1, 5000), 1);
  rdma_cm_event* event = nullptr;
  ASSERT_EQ(rdma_get_cm_event(channel, &event), 0);
  EXPECT_EQ(event->event, RDMA_CM_EVENT_ROUTE_RESOLVED);
  EXPECT_EQ(event->id, id);
  ASSERT_EQ(rdma_ack_cm_event(event), 0);

  // And back: synchronous, on a channel of its own again.
  ASSERT_EQ(rdma_migrate_id(id, nullptr), 0);
  EXPECT_NE(id->channel, nullptr);
  EXPECT_NE(id->channel, channel);
  rdma_cm_id* other = nullptr;
  ASSERT_EQ(rdma_create_id(channel, &other, nullptr, RDMA_PS_TCP), 0);
  ASSERT_EQ(rdma_resolve_addr(other, nullptr, reinterpret_cast<sockaddr*>(&peer), 2000), 0);
  readable = {channel->fd, POLLIN, 0};
  ASSERT_EQ(poll(&readable, 1, 5000), 1) << "the asynchronous one reports on the channel";
  ASSERT_EQ(rdma_get_cm_event(channel, &event), 0);
  EXPECT_EQ(event->id, other) << "nothing of the migrated id is left there";
  rdma_ack_cm_event(event);
  rdma_destroy_id(other);
  rdma_destroy_id(id);
  rdma_destroy_event_channel(channel);
}

// As librdmacm counts it, a connection request belongs to its listener: the
// new id can be rejected and destroyed before the request is acked (only
// the listener's destruction waits for that ack), and rdma_disconnect of a
// request not accepted says 0, as the kernel's rdma_cm does.
TEST(RdmaCmAlone, AConnectionRequestCountsForItsListener) {
  rdma_event_channel* server = rdma_create_event_channel();
  rdma_event_channel* client = rdma_create_event_channel();
  rdma_cm_id* listener = listening_id(server, 7497);
  ASSERT_NE(listener, nullptr) << std::strerror(errno);
  rdma_cm_id* active = connecting_id(client, 7497);
  ASSERT_NE(active, nullptr) << std::strerror(errno);
  rdma_cm_event* request = nullptr;
  ASSERT_EQ(rdma_get_cm_event(server, &request), 0);
  ASSERT_EQ(request->event, RDMA_CM_EVENT_CONNECT_REQUEST);
  rdma_cm_id* child = request->id;
  EXPECT_EQ(request->listen_id, listener);
  EXPECT_EQ(rdma_disconnect(child), 0) << "not connected yet: 0, as the kernel says";
  ASSERT_EQ(rdma_reject(child, nullptr, 0), 0);
  std::atomic<bool> destroyed{false};
  std::thread destroyer([&] {
    rdma_destroy_id(child);
    destroyed = true;
  });
  for (int i = 0; i < 200 && !destroyed; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_TRUE(destroyed) << "rdma_destroy_id of the new id waited for the request's ack";
  rdma_ack_cm_event(request);  // lets the destroyer go in any case
  destroyer.join();
  rdma_cm_event* answer = nullptr;
  ASSERT_EQ(rdma_get_cm_event(client, &answer), 0);
  EXPECT_EQ(answer->event, RDMA_CM_EVENT_REJECTED);
  rdma_ack_cm_event(answer);
  errno = 0;
  rdma_cm_id* idle = nullptr;
  ASSERT_EQ(rdma_create_id(client, &idle, nullptr, RDMA_PS_TCP), 0);
  EXPECT_EQ(rdma_disconnect(idle), -1) << "no connection under way";
  EXPECT_EQ(errno, EINVAL);
  rdma_destroy_id(idle);
  rdma_destroy_id(active);
  rdma_destroy_id(listener);
  rdma_destroy_event_channel(client);
  rdma_destroy_event_channel(server);
}

// A wildcard listener of each IP version on one port, the IPv6 one with
// AFONLY set (tgtd listens so for iSER): both listen, and each takes the
// connections of its own version, as with the kernel's rdma_cm.
TEST(RdmaCmAlone, AfOnlyLetsAnIpv4AndAnIpv6WildcardShareAPort) {
  constexpr uint16_t kPort = 7503;
  rdma_event_channel* channel = rdma_create_event_channel();
  ASSERT_NE(channel, nullptr);
  sockaddr_storage any6{}, any4{};
  auto& six = reinterpret_cast<sockaddr_in6&>(any6);
  six.sin6_family = AF_INET6;
  six.sin6_port = htons(kPort);
  auto& four = reinterpret_cast<sockaddr_in&>(any4);
  four.sin_family = AF_INET;
  four.sin_port = htons(kPort);
  rdma_cm_id *listener6 = nullptr, *listener4 = nullptr;
  ASSERT_EQ(rdma_create_id(channel, &listener6, nullptr, RDMA_PS_TCP), 0);
  ASSERT_EQ(rdma_create_id(channel, &listener4, nullptr, RDMA_PS_TCP), 0);
  int afonly = 1;
  ASSERT_EQ(rdma_set_option(listener6, RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY, &afonly, sizeof afonly), 0);
  ASSERT_EQ(rdma_bind_addr(listener6, reinterpret_cast<sockaddr*>(&any6)), 0);
  ASSERT_EQ(rdma_listen(listener6, 4), 0) << std::strerror(errno);
  ASSERT_EQ(rdma_bind_addr(listener4, reinterpret_cast<sockaddr*>(&any4)), 0);
  ASSERT_EQ(rdma_listen(listener4, 4), 0) << std::strerror(errno);

  // Connects to `destination` and returns the listener its request reached.
  auto listener_reached = [&](const char* host) -> rdma_cm_id* {
    rdma_addrinfo hints{};
    hints.ai_port_space = RDMA_PS_TCP;
    rdma_addrinfo* info = nullptr;
    const std::string port = std::to_string(kPort);
    if (rdma_getaddrinfo(host, port.c_str(), &hints, &info) != 0) return nullptr;
    ibv_qp_init_attr attr = qp_attributes();
    rdma_cm_id* active = nullptr;
    const int created = rdma_create_ep(&active, info, nullptr, &attr);
    rdma_freeaddrinfo(info);
    if (created != 0) return nullptr;
    std::thread connector([active] { (void)rdma_connect(active, nullptr); });
    rdma_cm_event* request = nullptr;
    rdma_cm_id* reached = nullptr;
    if (rdma_get_cm_event(channel, &request) == 0) {
      if (request->event == RDMA_CM_EVENT_CONNECT_REQUEST) {
        reached = request->listen_id;
        rdma_reject(request->id, nullptr, 0);
      }
      rdma_cm_id* incoming = request->id;
      rdma_ack_cm_event(request);
      rdma_destroy_id(incoming);
    }
    connector.join();
    rdma_destroy_ep(active);
    return reached;
  };
  EXPECT_EQ(listener_reached("127.0.0.1"), listener4);
  EXPECT_EQ(listener_reached("::1"), listener6);
  rdma_destroy_id(listener4);
  rdma_destroy_id(listener6);
  rdma_destroy_event_channel(channel);
}

// The next event on `channel` within `patience`, acked; its type and id.
struct TakenEvent {
  rdma_cm_event_type type;
  rdma_cm_id* id;
};
std::optional<TakenEvent> next_event(rdma_event_channel* channel, int patience_ms) {
  pollfd ready{channel->fd, POLLIN, 0};
  if (poll(&ready, 1, patience_ms) != 1) return std::nullopt;
  rdma_cm_event* event = nullptr;
  if (rdma_get_cm_event(channel, &event) != 0) return std::nullopt;
  TakenEvent taken{event->event, event->id};
  rdma_ack_cm_event(event);
  return taken;
}

// As with the kernel's rdma_cm: after a connection's DISCONNECTED, each
// side's id gets TIMEWAIT_EXIT once its time wait is over (tgtd frees an
// iSER connection only then), and an id destroyed before that gets none.
TEST(RdmaCmAlone, TimewaitExitFollowsTheDisconnectUnlessTheIdIsDestroyed) {
  rdma_event_channel* server = rdma_create_event_channel();
  rdma_event_channel* client = rdma_create_event_channel();
  rdma_cm_id* listener = listening_id(server, 7504);
  ASSERT_NE(listener, nullptr) << std::strerror(errno);
  rdma_cm_id* active = resolved_id(client, 7504);
  ASSERT_NE(active, nullptr) << std::strerror(errno);
  ibv_qp_init_attr attr = qp_attributes();
  attr.qp_type = IBV_QPT_RC;
  ASSERT_EQ(rdma_create_qp(active, nullptr, &attr), 0) << std::strerror(errno);
  rdma_conn_param param{};
  ASSERT_EQ(rdma_connect(active, &param), 0);
  rdma_cm_event* request = nullptr;
  ASSERT_EQ(rdma_get_cm_event(server, &request), 0);
  ASSERT_EQ(request->event, RDMA_CM_EVENT_CONNECT_REQUEST);
  rdma_cm_id* passive = request->id;
  rdma_ack_cm_event(request);
  attr = qp_attributes();
  attr.qp_type = IBV_QPT_RC;
  ASSERT_EQ(rdma_create_qp(passive, nullptr, &attr), 0) << std::strerror(errno);
  ASSERT_EQ(rdma_accept(passive, &param), 0);
  auto established = next_event(client, 5000);
  ASSERT_TRUE(established);
  EXPECT_EQ(established->type, RDMA_CM_EVENT_ESTABLISHED);
  established = next_event(server, 5000);
  ASSERT_TRUE(established);
  EXPECT_EQ(established->type, RDMA_CM_EVENT_ESTABLISHED);

  ASSERT_EQ(rdma_disconnect(active), 0);
  auto ended = next_event(client, 5000);
  ASSERT_TRUE(ended);
  EXPECT_EQ(ended->type, RDMA_CM_EVENT_DISCONNECTED);
  rdma_destroy_qp(active);
  ASSERT_EQ(rdma_destroy_id(active), 0);  // before its time wait is over
  ended = next_event(server, 5000);
  ASSERT_TRUE(ended);
  EXPECT_EQ(ended->type, RDMA_CM_EVENT_DISCONNECTED);
  EXPECT_EQ(ended->id, passive);
  auto exit = next_event(server, 5000);
  ASSERT_TRUE(exit) << "no TIMEWAIT_EXIT";
  EXPECT_EQ(exit->type, RDMA_CM_EVENT_TIMEWAIT_EXIT) << rdma_event_str(exit->type);
  EXPECT_EQ(exit->id, passive);
  // The active id's time wait began first; destroyed, it has no event.
  EXPECT_FALSE(next_event(client, 300)) << "an event for a destroyed id";
  rdma_destroy_qp(passive);
  rdma_destroy_id(passive);
  rdma_destroy_id(listener);
  rdma_destroy_event_channel(client);
  rdma_destroy_event_channel(server);
}

// As librdmacm: rdma_migrate_id returns once the events already taken for
// the id are acked, so that none is handled on the old channel after it.
TEST(RdmaCmAlone, MigrateWaitsForTheEventsTakenToBeAcked) {
  rdma_event_channel* old_channel = rdma_create_event_channel();
  rdma_event_channel* new_channel = rdma_create_event_channel();
  rdma_cm_id* id = nullptr;
  ASSERT_EQ(rdma_create_id(old_channel, &id, nullptr, RDMA_PS_TCP), 0);
  sockaddr_in peer{};
  peer.sin_family = AF_INET;
  peer.sin_port = htons(7498);
  peer.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&peer), 1000), 0);
  rdma_cm_event* event = nullptr;
  ASSERT_EQ(rdma_get_cm_event(old_channel, &event), 0);  // taken, not acked
  std::atomic<bool> migrated{false};
  std::atomic<pid_t> migrator_tid{0};
  std::thread migrator([&] {
    migrator_tid = gettid();
    rdma_migrate_id(id, new_channel);
    migrated = true;
  });
  while (migrator_tid == 0) std::this_thread::yield();
  EXPECT_TRUE(softverbs::test::wait_until_sleeping_in_futex(migrator_tid, [&] { return migrated.load(); }))
      << "rdma_migrate_id waits for the ack";
  EXPECT_FALSE(migrated) << "returned with an event of the id still being handled";
  rdma_ack_cm_event(event);
  migrator.join();
  EXPECT_TRUE(migrated);
  EXPECT_EQ(id->channel, new_channel);
  rdma_destroy_id(id);
  rdma_destroy_event_channel(old_channel);
  rdma_destroy_event_channel(new_channel);
}

// rdma_create_qp records the QP's PD in id->pd, where rdma_reg_msgs and the
// other rdma_reg_* inlines register.
TEST(RdmaCmAlone, CreatingAQpSetsTheIdsPd) {
  rdma_cm_id* id = nullptr;
  ASSERT_EQ(rdma_create_id(nullptr, &id, nullptr, RDMA_PS_TCP), 0);
  sockaddr_in peer{};
  peer.sin_family = AF_INET;
  peer.sin_port = htons(7498);
  peer.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&peer), 1000), 0);
  ibv_pd* pd = ibv_alloc_pd(id->verbs);
  ASSERT_NE(pd, nullptr);
  ibv_qp_init_attr attr = qp_attributes();
  attr.qp_type = IBV_QPT_RC;
  const int created = rdma_create_qp(id, pd, &attr);
  const int error = errno;
  ASSERT_EQ(created, 0) << std::strerror(error);
  EXPECT_EQ(id->pd, pd);
  char bytes[16];
  ibv_mr* mr = rdma_reg_msgs(id, bytes, sizeof bytes);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(mr->pd, pd) << "the QP's PD, so that its work requests may use the MR";
  rdma_dereg_mr(mr);
  rdma_destroy_qp(id);
  rdma_destroy_id(id);
  ibv_dealloc_pd(pd);
}

// Connects to the listener of process `child` on 127.0.0.1:`port`, which
// rejects the request: the REJECTED event comes from its application (IB CM
// reason 28, not the device's answer when no listener is left), with `why`
// as its private data, padded to the REJ's 148 bytes. Then `child` exits 0.
void expect_rejected_by(pid_t child, uint16_t port, const char* why) {
  rdma_event_channel* channel = rdma_create_event_channel();
  rdma_cm_id* id = nullptr;
  ASSERT_EQ(rdma_create_id(channel, &id, nullptr, RDMA_PS_TCP), 0);
  sockaddr_in destination{};
  destination.sin_family = AF_INET;
  destination.sin_port = htons(port);
  destination.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  rdma_cm_event* event = nullptr;
  ASSERT_EQ(rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&destination), 1000), 0);
  ASSERT_EQ(rdma_get_cm_event(channel, &event), 0);
  rdma_ack_cm_event(event);
  ASSERT_EQ(rdma_resolve_route(id, 1000), 0);
  ASSERT_EQ(rdma_get_cm_event(channel, &event), 0);
  rdma_ack_cm_event(event);
  ASSERT_EQ(rdma_connect(id, nullptr), 0);
  ASSERT_EQ(rdma_get_cm_event(channel, &event), 0);
  EXPECT_EQ(event->event, RDMA_CM_EVENT_REJECTED);
  EXPECT_EQ(event->status, 28) << "IB CM: consumer reject";
  EXPECT_EQ(event->param.conn.private_data_len, 148);
  EXPECT_STREQ(static_cast<const char*>(event->param.conn.private_data), why);
  rdma_ack_cm_event(event);
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  rdma_destroy_id(id);
  rdma_destroy_event_channel(channel);
}

// The passive side rejects and exits: on the UDP transport the device's
// processes share port 4791, so the REJ may sit in the socket of the very
// process that sent it, which must route it on before it goes.
void reject_then_exit_at_once(uint16_t port, const char* why) {
  rdma_event_channel* channel = rdma_create_event_channel();
  rdma_cm_id* listener = nullptr;
  rdma_create_id(channel, &listener, nullptr, RDMA_PS_TCP);
  sockaddr_in local{};
  local.sin_family = AF_INET;
  local.sin_port = htons(port);
  local.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (rdma_bind_addr(listener, reinterpret_cast<sockaddr*>(&local)) || rdma_listen(listener, 1)) _exit(2);
  std::printf("listening\n");
  std::fflush(stdout);
  rdma_cm_event* event = nullptr;
  if (rdma_get_cm_event(channel, &event) || event->event != RDMA_CM_EVENT_CONNECT_REQUEST) _exit(4);
  if (rdma_reject(event->id, why, static_cast<uint8_t>(std::strlen(why) + 1))) _exit(5);
  _exit(0);
}

TEST(RdmaCmAlone, ARejectSentJustBeforeItsSenderExitsArrives) {
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    const uint16_t port = static_cast<uint16_t>(7450 + round);
    pid_t child = fork();
    if (child == 0) {
      dup2(fds[1], STDOUT_FILENO);
      reject_then_exit_at_once(port, "not now");
    }
    close(fds[1]);
    char ready[16] = {};
    ASSERT_GT(read(fds[0], ready, sizeof ready), 0);
    close(fds[0]);
    ASSERT_NO_FATAL_FAILURE(expect_rejected_by(child, port, "not now"));
  }
}

TEST(RdmaCmAlone, RejectCarriesPrivateDataAndTheConsumerReason) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t child = fork();
  if (child == 0) {
    rdma_event_channel* channel = rdma_create_event_channel();
    rdma_cm_id* listener = nullptr;
    rdma_create_id(channel, &listener, nullptr, RDMA_PS_TCP);
    sockaddr_in local{};
    local.sin_family = AF_INET;
    local.sin_port = htons(7403);
    local.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (rdma_bind_addr(listener, reinterpret_cast<sockaddr*>(&local)) || rdma_listen(listener, 1)) _exit(2);
    char ready = 'r';
    if (write(fds[1], &ready, 1) != 1) _exit(3);
    rdma_cm_event* event = nullptr;
    if (rdma_get_cm_event(channel, &event) || event->event != RDMA_CM_EVENT_CONNECT_REQUEST) _exit(4);
    rdma_cm_id* request = event->id;
    rdma_ack_cm_event(event);
    const char why[] = "go away";
    if (rdma_reject(request, why, sizeof why)) _exit(5);
    rdma_destroy_id(request);
    rdma_destroy_id(listener);
    rdma_destroy_event_channel(channel);
    _exit(0);
  }
  char ready;
  ASSERT_EQ(read(fds[0], &ready, 1), 1);
  ASSERT_NO_FATAL_FAILURE(expect_rejected_by(child, 7403, "go away"));
}

}  // namespace
