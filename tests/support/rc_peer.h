// Two processes, each with an RC QP connected to the other's, for tests
// that start a peer process: the child is forked before either opens the
// device, as two programs would be. The endpoints pick the device's RoCE v2
// GID of an IPv4 address, so the same tests run on a shared-memory device
// (softverbs0 on lo) and on one that carries everything over UDP.
#pragma once

#include <infiniband/verbs.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "device_status.h"
#include "process_runner.h"

namespace softverbs::test {

using Clock = std::chrono::steady_clock;

struct ConnectInfo {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  ibv_gid gid{};
  uint64_t address = 0;
  uint32_t rkey = 0;
};

inline bool write_all(int fd, const void* data, size_t size) {
  return ::write(fd, data, size) == static_cast<ssize_t>(size);
}
inline bool read_all(int fd, void* data, size_t size) {
  auto* at = static_cast<char*>(data);
  while (size > 0) {
    ssize_t got = ::read(fd, at, size);
    if (got <= 0) return false;
    at += got;
    size -= static_cast<size_t>(got);
  }
  return true;
}

// softverbs0, opened, and its RoCE v2 GID of an IPv4 address (index -1 if
// it has none); nullptr if there is no softverbs0.
inline ibv_context* open_softverbs0(int& gid_index, ibv_gid& gid) {
  ibv_context* context = nullptr;
  int count = 0;
  ibv_device** list = ibv_get_device_list(&count);
  for (int i = 0; list && i < count; ++i)
    if (std::strcmp(ibv_get_device_name(list[i]), "softverbs0") == 0) context = ibv_open_device(list[i]);
  if (list) ibv_free_device_list(list);
  gid_index = -1;
  for (int index = 0; context && index < 32 && gid_index < 0; ++index) {
    ibv_gid_entry entry{};
    if (ibv_query_gid_ex(context, 1, static_cast<uint32_t>(index), &entry, 0) == 0 &&
        entry.gid_type == IBV_GID_TYPE_ROCE_V2 && entry.gid.raw[10] == 0xff && entry.gid.raw[11] == 0xff) {
      gid_index = index;
      gid = entry.gid;
    }
  }
  return context;
}

// One side: device, PD, CQ, RC QP and a registered buffer.
class Endpoint {
 public:
  ~Endpoint() {
    if (qp_) ibv_destroy_qp(qp_);
    if (mr_) ibv_dereg_mr(mr_);
    if (cq_) ibv_destroy_cq(cq_);
    if (pd_) ibv_dealloc_pd(pd_);
    if (context_) ibv_close_device(context_);
  }

  bool open(size_t buffer_bytes, int depth) {
    context_ = open_softverbs0(gid_index_, gid_);
    if (!context_) return false;
    buffer_.assign(buffer_bytes, 0);
    pd_ = ibv_alloc_pd(context_);
    cq_ = ibv_create_cq(context_, depth * 2, nullptr, nullptr, 0);
    if (!pd_ || !cq_ || gid_index_ < 0) return false;
    mr_ = ibv_reg_mr(
        pd_, buffer_.data(), buffer_.size(),
        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
    ibv_qp_init_attr init{};
    init.send_cq = init.recv_cq = cq_;
    init.qp_type = IBV_QPT_RC;
    init.cap = {static_cast<uint32_t>(depth), static_cast<uint32_t>(depth), 1, 1, 0};
    qp_ = ibv_create_qp(pd_, &init);
    return mr_ && qp_;
  }

  ConnectInfo info() const {
    ConnectInfo info;
    info.qpn = qp_->qp_num;
    info.psn = 0xfffff0;  // near the wrap, so that PSNs roll over during the test
    info.gid = gid_;
    info.address = reinterpret_cast<uint64_t>(buffer_.data());
    info.rkey = mr_->rkey;
    return info;
  }

  bool connect(const ConnectInfo& peer, uint8_t timeout, uint8_t retry_count) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.port_num = 1;
    attr.qp_access_flags =
        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    if (ibv_modify_qp(qp_, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) return false;
    attr = {};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = IBV_MTU_4096;
    attr.dest_qp_num = peer.qpn;
    attr.rq_psn = peer.psn;
    attr.max_dest_rd_atomic = 4;
    attr.min_rnr_timer = 1;  // 10 us
    attr.ah_attr.is_global = 1;
    attr.ah_attr.grh.dgid = peer.gid;
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index_);
    attr.ah_attr.grh.hop_limit = 64;
    attr.ah_attr.port_num = 1;
    if (ibv_modify_qp(qp_, &attr,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
      return false;
    attr = {};
    attr.qp_state = IBV_QPS_RTS;
    attr.sq_psn = info().psn;
    attr.timeout = timeout;
    attr.retry_cnt = retry_count;
    attr.rnr_retry = rnr_retry;
    attr.max_rd_atomic = 4;
    return ibv_modify_qp(qp_, &attr,
                         IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                             IBV_QP_MAX_QP_RD_ATOMIC) == 0;
  }

  // A SEND, or an RDMA WRITE or READ at the same offset of `peer`'s buffer,
  // or a fetch-and-add of `add` to the word there (the original value lands
  // here).
  int post_send(uint64_t wr_id, size_t offset, uint32_t length, ibv_wr_opcode opcode = IBV_WR_SEND,
                const ConnectInfo* peer = nullptr, uint64_t add = 0) {
    return post(wr_id, offset, length, opcode, peer, offset, add);
  }

  // An RDMA WRITE from `local_offset` here to `remote_offset` of `peer`'s buffer.
  int post_write(uint64_t wr_id, size_t local_offset, uint32_t length, const ConnectInfo& peer,
                 uint64_t remote_offset) {
    return post(wr_id, local_offset, length, IBV_WR_RDMA_WRITE, &peer, remote_offset, 0);
  }

  int post_recv(uint64_t wr_id, size_t offset, uint32_t length) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buffer_.data() + offset), length, mr_->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    return ibv_post_recv(qp_, &wr, &bad);
  }

  int poll(ibv_wc* out, int max) { return ibv_poll_cq(cq_, max, out); }
  ibv_qp_state state() {
    ibv_qp_attr attr{};
    ibv_qp_init_attr init{};
    ibv_query_qp(qp_, &attr, IBV_QP_STATE, &init);
    return attr.qp_state;
  }
  uint8_t* data() { return buffer_.data(); }
  ibv_context* context() { return context_; }

  uint8_t rnr_retry = 7;  // as set at RTS

 private:
  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  ibv_mr* mr_ = nullptr;
  std::vector<uint8_t> buffer_;

  int post(uint64_t wr_id, size_t local_offset, uint32_t length, ibv_wr_opcode opcode, const ConnectInfo* peer,
           uint64_t remote_offset, uint64_t add) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buffer_.data() + local_offset), length, mr_->lkey};
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = opcode;
    wr.send_flags = IBV_SEND_SIGNALED;
    if (peer && opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) {
      wr.wr.atomic.remote_addr = peer->address + remote_offset;
      wr.wr.atomic.compare_add = add;
      wr.wr.atomic.rkey = peer->rkey;
    } else if (peer) {
      wr.wr.rdma.remote_addr = peer->address + remote_offset;
      wr.wr.rdma.rkey = peer->rkey;
    }
    ibv_send_wr* bad = nullptr;
    return ibv_post_send(qp_, &wr, &bad);
  }
  int gid_index_ = -1;
  ibv_gid gid_{};
};

// A child process with an endpoint connected to the parent's; `body` runs
// in the child once connected, with the socket to the parent.
template <typename Body>
pid_t spawn_peer(int socket_fd, size_t buffer_bytes, int depth, uint8_t timeout, uint8_t retry_count, Body body) {
  pid_t pid = fork();
  if (pid != 0) return pid;
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // a test that fails or times out leaves no peer behind
  int code;
  {
    // Destroyed before the exit, as a program's resources are: its QP's
    // last ACK leaves then.
    Endpoint child;
    ConnectInfo mine, theirs;
    if (!child.open(buffer_bytes, depth)) _exit(10);
    mine = child.info();
    if (!write_all(socket_fd, &mine, sizeof mine) || !read_all(socket_fd, &theirs, sizeof theirs)) _exit(11);
    if (!child.connect(theirs, timeout, retry_count)) _exit(12);
    code = body(child, socket_fd);
  }
  _exit(code);
}

// The parent's side of the connection.
inline bool connect_to_peer(Endpoint& self, int socket_fd, uint8_t timeout, uint8_t retry_count, ConnectInfo& peer) {
  ConnectInfo mine = self.info();
  if (!read_all(socket_fd, &peer, sizeof peer) || !write_all(socket_fd, &mine, sizeof mine)) return false;
  return self.connect(peer, timeout, retry_count);
}

// The parent's endpoint, opened and connected, once the child says it is
// ready (one byte on the socket).
inline bool open_connected(Endpoint& self, int socket_fd, size_t buffer_bytes, int depth, uint8_t timeout,
                           uint8_t retry_count, ConnectInfo& peer) {
  char ready;
  return self.open(buffer_bytes, depth) && connect_to_peer(self, socket_fd, timeout, retry_count, peer) &&
         read_all(socket_fd, &ready, 1);
}

inline std::vector<ibv_wc> poll_for(Endpoint& endpoint, size_t count, std::chrono::milliseconds patience) {
  std::vector<ibv_wc> out;
  auto deadline = Clock::now() + patience;
  while (out.size() < count && Clock::now() < deadline) {
    ibv_wc wc[16];
    int got = endpoint.poll(wc, 16);
    out.insert(out.end(), wc, wc + std::max(got, 0));
  }
  return out;
}

// Polls busily for `how_long` (so that the background thread takes the
// application for a polling one and steps aside); false if a poll found a
// completion or failed.
inline bool polls_nothing_for(Endpoint& endpoint, std::chrono::milliseconds how_long) {
  const auto until = Clock::now() + how_long;
  while (Clock::now() < until) {
    ibv_wc wc;
    if (endpoint.poll(&wc, 1) != 0) return false;
  }
  return true;
}

// A counter of the device, as `softverbs stat` prints it (UINT64_MAX if it
// cannot be read).
inline uint64_t device_counter(const std::string& name) {
  const char* cli = std::getenv("SOFTVERBS_CLI");
  if (cli == nullptr) return UINT64_MAX;
  const auto stat = softverbs::test::run_process({cli, "stat", "softverbs0"});
  const auto counters = softverbs::test::parse_counters(stat.out);
  const auto it = counters.find(name);
  return stat.exit_code == 0 && it != counters.end() ? it->second : UINT64_MAX;
}

inline double implied_seconds(uint8_t timeout, uint8_t retry_count) {
  return (retry_count + 1) * 4.096e-6 * static_cast<double>(uint64_t{1} << timeout);
}

}  // namespace softverbs::test
