// One side of an RC connection for tests: device, PD, CQ, RC QP and a
// registered buffer, connected to a peer described by a ConnectInfo. The
// endpoint picks the device's RoCE v2 GID of an IPv4 address, so the same
// tests run on a shared-memory device (softverbs0 on lo) and on one that
// carries everything over UDP.
#pragma once

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace softverbs::test {

// What a peer needs to connect to an endpoint and reach its buffer.
struct ConnectInfo {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  ibv_gid gid{};
  uint64_t address = 0;
  uint32_t rkey = 0;
};

// softverbs0, opened, and its RoCE v2 GID of an IPv4 address (index -1 if
// it has none); nullptr if there is no softverbs0.
ibv_context* open_softverbs0(int& gid_index, ibv_gid& gid);

class Endpoint {
 public:
  // Gather lists of up to this many SGEs may be posted on qp() directly.
  static constexpr uint32_t kMaxSendSges = 8;

  Endpoint() = default;
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  ~Endpoint();

  // With a zeroed buffer of its own, `buffer_bytes` long; a CQ of 2 x
  // `depth` entries and a QP of `depth` sends and receives.
  bool open(size_t buffer_bytes, int depth);
  // The same, with the caller's `bytes` at `memory` as the buffer.
  bool open(void* memory, size_t bytes, int depth);

  ConnectInfo info() const;
  // INIT, RTR and RTS towards `peer`, with every access right.
  bool connect(const ConnectInfo& peer, uint8_t timeout, uint8_t retry_count);

  // A SEND, or an RDMA WRITE or READ at the same offset of `peer`'s buffer,
  // or a fetch-and-add of `add` to the word there (the original value lands
  // here).
  int post_send(uint64_t wr_id, size_t offset, uint32_t length, ibv_wr_opcode opcode = IBV_WR_SEND,
                const ConnectInfo* peer = nullptr, uint64_t add = 0);
  // An RDMA WRITE from `local_offset` here to `remote_offset` of `peer`'s buffer.
  int post_write(uint64_t wr_id, size_t local_offset, uint32_t length, const ConnectInfo& peer, uint64_t remote_offset);
  int post_recv(uint64_t wr_id, size_t offset, uint32_t length);

  int poll(ibv_wc* out, int max) { return ibv_poll_cq(cq_, max, out); }
  ibv_qp_state state();
  uint8_t* data() { return buffer_; }
  ibv_context* context() { return context_; }
  ibv_pd* pd() { return pd_; }
  ibv_cq* cq() { return cq_; }
  ibv_qp* qp() { return qp_; }
  ibv_mr* mr() { return mr_; }

  uint8_t rnr_retry = 7;  // as set at RTS

 private:
  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  ibv_mr* mr_ = nullptr;
  std::vector<uint8_t> owned_;
  uint8_t* buffer_ = nullptr;
  size_t buffer_bytes_ = 0;
  int gid_index_ = -1;
  ibv_gid gid_{};

  int post(uint64_t wr_id, size_t local_offset, uint32_t length, ibv_wr_opcode opcode, const ConnectInfo* peer,
           uint64_t remote_offset, uint64_t add);
};

}  // namespace softverbs::test
