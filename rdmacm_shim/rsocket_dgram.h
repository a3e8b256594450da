// rsockets' datagram sockets over our rdma_cm and the public verbs, with
// rdma-core's wire protocol (librdmacm/docs/rsocket, "Datagram Overview"),
// so either end may be the real librdmacm:
// - the socket is a UDP socket (its descriptor is the rsocket's number) plus
//   one UD QP per local address it sends from;
// - while a destination's QPN is unknown, datagrams go over UDP behind a
//   DsUdpHeader naming the sender's QPN; the receiver answers each with a
//   header-only Ctrl message naming its own QPN, and both sides then build
//   an address handle from the rdma_cm's route to the other;
// - after that, datagrams travel as UD SENDs behind a DsHeader that names
//   the sender's IP address and UDP port (what rrecvfrom reports).
// rdma-core answers the UDP side from a service thread; here whatever call
// makes progress on the socket (rrecv*, rsend*, rpoll) reads it, so a
// process that never calls into the socket answers late, not never.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "rsocket_stream.h"

namespace softverbs::rs {

// In front of every datagram on a UD QP (network byte order fields).
struct DsHeader {
  uint8_t version;  // 4 or 6
  uint8_t length;   // kDsIpv4HeaderLength or kDsIpv6HeaderLength
  uint16_t port;    // the sender's UDP port
  union {
    uint32_t ipv4;
    struct {
      uint32_t flowinfo;
      uint8_t addr[16];
    } ipv6;
  } addr;
};
static_assert(sizeof(DsHeader) == 24);
constexpr uint8_t kDsIpv4HeaderLength = 8;
constexpr uint8_t kDsIpv6HeaderLength = 24;

// In front of every datagram sent over the UDP socket.
struct DsUdpHeader {
  uint32_t tag;  // kDsUdpTag
  uint8_t version;
  uint8_t op;  // Op::Data (user data follows) or Op::Ctrl (a QPN answer)
  uint8_t length;
  uint8_t reserved;
  uint32_t qpn;  // the sender's UD QP (24 bits)
  union {
    uint32_t ipv4;
    uint8_t ipv6[16];
  } addr;  // the sender QP's IP address
};
static_assert(sizeof(DsUdpHeader) == 28);
constexpr uint32_t kDsUdpTag = 0x55555555;
constexpr uint8_t kDsUdpIpv4HeaderLength = 16;
constexpr uint8_t kDsUdpIpv6HeaderLength = 28;

class DgramSocket {
 public:
  static std::shared_ptr<DgramSocket> create(int domain, bool nonblocking, bool cloexec);  // nullptr: -1/errno
  ~DgramSocket();
  DgramSocket(const DgramSocket&) = delete;
  DgramSocket& operator=(const DgramSocket&) = delete;

  int fd() const { return udp_fd_; }

  int bind(const sockaddr* addr, socklen_t len);
  int connect(const sockaddr* addr, socklen_t len);
  // `to` null: the connected destination.
  ssize_t sendv(const iovec* iov, int iovcnt, int flags, const sockaddr* to, socklen_t tolen);
  ssize_t recvfrom(void* buf, size_t len, int flags, sockaddr* from, socklen_t* fromlen);
  void close();  // waits for the sends under way
  int getpeername(sockaddr* addr, socklen_t* len);
  int getsockname(sockaddr* addr, socklen_t* len);
  int setsockopt(int level, int name, const void* value, socklen_t len);
  int getsockopt(int level, int name, void* value, socklen_t* len);
  int fcntl(int cmd, long arg);

  // rpoll, as StreamSocket's.
  short poll_events(short events);
  void arm_for_poll(std::vector<pollfd>& wait_fds);
  void after_poll_wait();

 private:
  DgramSocket() = default;

  struct LocalQp;
  struct Dest;
  struct Datagram {
    sockaddr_storage from;
    std::vector<uint8_t> bytes;
  };
  using Test = bool (DgramSocket::*)() const;

  int init_endpoint();  // sizes and send buffer, once (bind, connect, first send)
  int source_for(const sockaddr_storage& dest, sockaddr_storage& source);
  LocalQp* qp_for(const sockaddr_storage& source);
  std::unique_ptr<LocalQp> create_qp(const sockaddr_storage& source);
  Dest* dest_for(const sockaddr* addr, socklen_t len);  // nullptr: -1/errno
  void resolve_dest(Dest& dest, uint32_t qpn);
  ssize_t send_udp(const Dest& dest, const iovec* iov, int iovcnt, uint8_t op);
  int post_recv(LocalQp& qp, uint32_t offset);

  // Progress without waiting: the UDP socket's messages, then the CQs.
  void progress();
  void read_udp();
  void poll_cqs();
  int wait_for(bool nonblock, Test test, std::unique_lock<std::mutex>& lock);
  void arm(std::vector<pollfd>& wait_fds);
  void consume_cq_events();

  bool nonblocking(int flags) const { return (fs_flags_ & O_NONBLOCK) || (flags & MSG_DONTWAIT); }
  bool have_data() const { return !received_.empty(); }
  bool can_send() const { return !free_slots_.empty(); }
  bool all_sends_done() const { return free_slots_.size() == sq_size_; }

  std::mutex lock_;
  int udp_fd_ = -1;
  int domain_ = AF_INET;
  bool initialized_ = false;
  int fs_flags_ = 0;
  int fd_flags_ = 0;

  uint32_t sq_size_ = 0, rq_size_ = 0, sq_inline_ = 0, sbuf_size_ = 0, rbuf_size_ = 0;

  AlignedBuffer sbuf_;                // sq_size_ slots of kSlotSize, registered in every QP's PD
  std::vector<uint32_t> free_slots_;  // offsets into sbuf_
  std::vector<std::unique_ptr<LocalQp>> qps_;
  std::vector<std::unique_ptr<Dest>> dests_;
  Dest* connected_ = nullptr;
  std::deque<Datagram> received_;  // at most rq_size_
};

}  // namespace softverbs::rs
