// rsockets' stream sockets over our rdma_cm and the public verbs. The
// protocol on the QP is rdma-core's (librdmacm/docs/rsocket), so either end
// may be the real librdmacm:
// - the connect's private data (ConnData) names each side's credit target
//   (where the peer writes receive-buffer grants) and first data buffer;
// - data travel as RDMA WRITE with immediate into the peer's receive buffer,
//   the immediate carrying the length (Op::Data);
// - the receiver hands out buffer space (Op::Sgl: a WRITE of a WireSge into
//   the sender's target list) and receive credits (the immediate's sequence
//   number); Op::Ctrl messages announce shutdown and disconnect;
// - riomap'd regions are announced with Op::IomapSgl writes into the peer's
//   iomap table, which riowrite then targets with plain RDMA WRITEs.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cstdint>
#include <cstdlib>
#include <list>
#include <memory>
#include <mutex>
#include <vector>

namespace softverbs::rs {

enum class Op : uint32_t { Data = 0, Write = 2, Sgl = 4, IomapSgl = 6, Ctrl = 7 };
enum Ctrl : uint32_t { kCtrlDisconnect = 0, kCtrlKeepalive = 1, kCtrlShutdown = 2 };

constexpr uint32_t message(Op op, uint32_t data) { return (static_cast<uint32_t>(op) << 29) | data; }
constexpr Op op_of(uint32_t msg) { return static_cast<Op>(msg >> 29); }
constexpr uint32_t data_of(uint32_t msg) { return msg & 0x1FFFFFFF; }

struct WireSge {
  uint64_t addr;
  uint32_t key;
  uint32_t length;
};
struct WireIomap {
  uint64_t offset;
  WireSge sge;
};
// The private data of the connect and the accept (big endian fields).
struct ConnData {
  uint8_t version;
  uint8_t flags;
  uint16_t credits;
  uint8_t reserved[3];
  uint8_t target_iomap_size;  // scaled (see scale_of)
  WireSge target_sgl;
  WireSge data_buf;
};
static_assert(sizeof(ConnData) == 40);
constexpr uint8_t kConnFlagNet = 1;    // the sender is big endian
constexpr uint8_t kConnFlagIomap = 2;  // target_iomap_size is meaningful

// Connection states: bit sets, as in rdma-core, so that "connected" tests
// one bit and readable/writable drop independently at shutdown.
enum State : int {
  kInit = 0,
  kBound = 0x1,
  kListening = 0x2,
  kOpening = 0x4,
  kResolvingAddr = kOpening | 0x10,
  kResolvingRoute = kOpening | 0x20,
  kConnecting = kOpening | 0x40,
  kAccepting = kOpening | 0x80,
  kConnected = 0x100,
  kWritable = 0x200,
  kReadable = 0x400,
  kConnectRdwr = kConnected | kReadable | kWritable,
  kConnectError = 0x800,
  kDisconnected = 0x1000,
  kError = 0x2000,
};

struct Defaults {
  uint32_t sq_size = 384, rq_size = 384, sq_inline = 64;
  uint32_t sbuf_size = 1 << 17, rbuf_size = 1 << 17;
  uint16_t iomap_size = 0;
};

// Pages of their own that the peer may write into: mapped, not from the
// heap, so that their MADV_DONTFORK never reaches memory malloc reuses
// (a forked child would lack whatever the heap put there later).
struct PagesUnmap {
  size_t length = 0;
  void operator()(uint8_t* p) const;
};
using AlignedBuffer = std::unique_ptr<uint8_t[], PagesUnmap>;
AlignedBuffer allocate_pages(size_t length);  // null when out of memory

class StreamSocket {
 public:
  // A new socket with an id of its own on a channel of its own; its
  // number is the channel's descriptor.
  static std::shared_ptr<StreamSocket> create(int domain, bool nonblocking, bool cloexec);
  ~StreamSocket();
  StreamSocket(const StreamSocket&) = delete;
  StreamSocket& operator=(const StreamSocket&) = delete;

  int fd() const { return fd_; }

  int bind(const sockaddr* addr, socklen_t len);
  int listen(int backlog);
  std::shared_ptr<StreamSocket> accept(sockaddr* addr, socklen_t* len);  // nullptr: -1/errno
  int connect(const sockaddr* addr, socklen_t len);
  ssize_t recv(void* buf, size_t len, int flags);
  ssize_t recvv(const iovec* iov, int iovcnt, int flags);
  ssize_t sendv(const iovec* iov, int iovcnt, int flags);
  int shutdown(int how);
  void close();  // graceful end before destruction
  int getpeername(sockaddr* addr, socklen_t* len);
  int getsockname(sockaddr* addr, socklen_t* len);
  int setsockopt(int level, int name, const void* value, socklen_t len);
  int getsockopt(int level, int name, void* value, socklen_t* len);
  int fcntl(int cmd, long arg);
  off_t iomap(void* buf, size_t len, int prot, int flags, off_t offset);
  int iounmap(void* buf, size_t len);
  ssize_t iowrite(const void* buf, size_t count, off_t offset, int flags);

  // rpoll: the events that hold now (after making what progress can be made
  // without waiting); with `arm`, also arranges that `wait_fds` become
  // readable when that may change (returns the descriptors to wait on).
  short poll_events(short events);
  void arm_for_poll(std::vector<pollfd>& wait_fds);
  void after_poll_wait();

 private:
  StreamSocket() = default;
  using Test = bool (StreamSocket::*)() const;

  // Connection setup.
  int do_connect(bool nonblock);  // lock held
  // A data call on a socket still connecting finishes the connect first:
  // 0, or -1 with errno (EAGAIN while a non-blocking one is under way).
  int finish_connect(int flags);  // lock held
  int next_cm_event(bool nonblock, rdma_cm_event_type* type, int* status, ConnData* data, rdma_conn_param* param);
  void drain_cm_events();
  int create_endpoint();
  void format_conn_data(ConnData* conn) const;
  void save_conn_data(const ConnData& conn);
  int fail_connect(int error);

  // Data path (lock held).
  bool nonblocking(int flags) const { return (fs_flags_ & O_NONBLOCK) || (flags & MSG_DONTWAIT); }
  int post_recv();
  int post_msg(uint32_t msg);
  int post_write(ibv_sge* sgl, int nsge, uint32_t wr_data, int flags, uint64_t addr, uint32_t rkey, bool with_imm);
  int write_data(ibv_sge* sgl, int nsge, uint32_t length, int flags);
  int write_direct(const WireIomap& iom, uint64_t offset, ibv_sge* sgl, int nsge, uint32_t length, int flags);
  void send_credits();
  void update_credits();
  int poll_cq();
  int process_cq(bool nonblock, Test test, std::unique_lock<std::mutex>& lock);
  int get_comp(bool nonblock, Test test, std::unique_lock<std::mutex>& lock);
  uint32_t sbuf_left() const;
  // Copies `length` bytes from the iovecs into the send buffer ring and
  // writes them to the peer (at `iom` when given, else as stream data).
  struct IomapRegion;
  int stage_and_write(const iovec*& iov, size_t& iov_offset, uint32_t length, const WireIomap* iom, uint64_t offset,
                      const IomapRegion* announce);
  int wait_send(int flags, std::unique_lock<std::mutex>& lock);
  int announce_iomaps(int flags, std::unique_lock<std::mutex>& lock);

  bool ctrl_avail() const { return ctrl_seqno_ != ctrl_max_seqno_; }
  bool can_send() const;
  bool conn_can_send() const { return can_send() || !(state_ & kWritable); }
  bool conn_can_send_ctrl() const { return ctrl_avail() || !(state_ & kConnected); }
  bool have_rdata() const { return rmsg_head_ != rmsg_tail_; }
  bool conn_have_rdata() const { return have_rdata() || !(state_ & kReadable); }
  bool all_sends_done() const {
    return (static_cast<int>(ctrl_max_seqno_) - static_cast<int>(ctrl_seqno_)) + sqe_avail_ ==
               static_cast<int>(sq_size_) ||
           !(state_ & kConnected);
  }
  bool always() const { return true; }
  bool cq_armed_test() const { return cq_armed_; }
  bool find_iomap(uint64_t offset, WireIomap* found) const;

  std::mutex lock_;
  rdma_event_channel* channel_ = nullptr;
  rdma_cm_id* id_ = nullptr;
  int fd_ = -1;
  int domain_ = AF_INET;
  int state_ = kInit;
  int err_ = 0;
  int fs_flags_ = 0;
  int fd_flags_ = 0;
  sockaddr_storage peer_{};
  bool have_peer_ = false;
  bool cm_disconnected_ = false;

  // Options.
  uint64_t so_opts_ = 0, tcp_opts_ = 0, ipv6_opts_ = 0;
  int tos_ = 0;
  unsigned keepalive_time_ = 0;

  // Queue and buffer sizes (settable until the connection opens).
  uint32_t sq_size_ = 0, rq_size_ = 0, sq_inline_ = 0, sbuf_size_ = 0, rbuf_size_ = 0;
  uint16_t target_iomap_size_ = 0;

  // Verbs objects.
  ibv_comp_channel* cq_channel_ = nullptr;
  ibv_cq* cq_ = nullptr;
  bool cq_armed_ = false;
  unsigned unack_cqe_ = 0;
  AlignedBuffer sbuf_, rbuf_, target_;
  ibv_mr* smr_ = nullptr;
  ibv_mr* rmr_ = nullptr;
  ibv_mr* target_mr_ = nullptr;
  volatile WireSge* target_sgl_ = nullptr;  // written by the peer
  volatile WireIomap* target_iomap_ = nullptr;

  // Flow control, as rdma-core counts it.
  uint32_t ctrl_seqno_ = 0, ctrl_max_seqno_ = 4;
  uint16_t sseq_no_ = 0, sseq_comp_ = 0, rseq_no_ = 0, rseq_comp_ = 0;
  int remote_sge_ = 0;
  WireSge remote_sgl_{}, remote_iomap_{};
  int target_sge_ = 0;
  int rbuf_bytes_avail_ = 0, rbuf_free_offset_ = 0, rbuf_offset_ = 0;
  int sbuf_bytes_avail_ = 0;
  ibv_sge ssgl_[2]{};
  int sqe_avail_ = 0;
  struct RecvMessage {
    uint32_t op, data;
  };
  std::vector<RecvMessage> rmsg_;
  int rmsg_head_ = 0, rmsg_tail_ = 0;

  // riomap: local regions (index >= 0: offered to the peer, in its iomap
  // table slot `index`).
  struct IomapRegion {
    uint64_t offset;
    ibv_mr* mr;
    int index;
    bool announced;
  };
  std::list<IomapRegion> iomaps_;
  std::vector<bool> remote_slot_used_;
};

Defaults& defaults();

}  // namespace softverbs::rs
