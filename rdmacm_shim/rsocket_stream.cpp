// rsockets' stream sockets: connection setup, the credit-based data path
// and iomaps (see rsocket_stream.h for the protocol).
#include "rsocket_stream.h"

#include <endian.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <rdma/rsocket.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace softverbs::rs {

namespace {

constexpr uint32_t kSndLowat = 2048;
constexpr uint32_t kOlapStartSize = 2048;
constexpr uint32_t kMaxTransfer = 65536;
constexpr uint32_t kQpMinSize = 16;
constexpr uint32_t kQpMaxSize = 0xFFFE;
constexpr uint32_t kCtrlSlots = 4;  // control messages in flight; a power of 2
constexpr uint32_t kMaxCtrlMsg = sizeof(WireSge);
constexpr int kSglSize = 2;
constexpr uint64_t kRecvFlag = uint64_t{1} << 63;
constexpr int kResolveTimeoutMs = 2000;
constexpr uint64_t kSpinMicroseconds = 10;  // busy polling before sleeping, as rdma-core's polling_time

int fail(int error) {
  errno = error;
  return -1;
}

uint64_t now_us() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000 + static_cast<uint64_t>(ts.tv_nsec) / 1000;
}

}  // namespace

void PagesUnmap::operator()(uint8_t* p) const {
  if (p != nullptr) munmap(p, length);
}

AlignedBuffer allocate_pages(size_t length) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t rounded = std::max<size_t>(page, (length + page - 1) / page * page);
  void* memory = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) return AlignedBuffer(nullptr, PagesUnmap{});
  // As rdma-core: registered memory must not be shared copy-on-write with a
  // forked child (rstream -T f forks).
  madvise(memory, rounded, MADV_DONTFORK);
  return AlignedBuffer(static_cast<uint8_t*>(memory), PagesUnmap{rounded});
}

namespace {

// rdma-core's 8-bit encoding of the iomap table size.
int scale_of(int value) { return value <= 128 ? value : 128 | (value >> 8); }
int value_of(int scale) { return scale <= 128 ? scale : (scale & ~128) << 8; }

void copy_sockaddr(sockaddr* to, socklen_t* len, const sockaddr* from) {
  socklen_t size = from->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  std::memcpy(to, from, std::min(*len, size));
  *len = size;
}

// What rdma-core's ucma_complete makes of a failed CM event.
int event_error(rdma_cm_event_type type, int status) {
  if (type == RDMA_CM_EVENT_REJECTED) return ECONNREFUSED;
  if (status < 0) return -status;
  if (status > 0) return status;
  return ECONNABORTED;
}

unsigned read_config(const char* name, unsigned fallback) {
  std::string path = std::string("/etc/rdma/rsocket/") + name;
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return fallback;
  unsigned value = fallback;
  if (std::fscanf(f, "%u", &value) != 1) value = fallback;
  std::fclose(f);
  return value;
}

}  // namespace

Defaults& defaults() {
  static Defaults d = [] {
    Defaults r;
    r.sq_inline = read_config("inline_default", r.sq_inline);
    r.sq_size = read_config("sqsize_default", r.sq_size);
    r.rq_size = read_config("rqsize_default", r.rq_size);
    r.rbuf_size = std::max(1u, read_config("mem_default", r.rbuf_size));
    r.sbuf_size = read_config("wmem_default", r.sbuf_size);
    if (r.sbuf_size < kSndLowat) r.sbuf_size = kSndLowat << 1;
    r.iomap_size = static_cast<uint16_t>(value_of(scale_of(read_config("iomap_size", 0))));
    return r;
  }();
  return d;
}

std::shared_ptr<StreamSocket> StreamSocket::create(int domain, bool nonblocking, bool cloexec) {
  std::shared_ptr<StreamSocket> s(new StreamSocket);
  s->domain_ = domain;
  const Defaults& d = defaults();
  s->sq_size_ = d.sq_size;
  s->rq_size_ = d.rq_size;
  s->sq_inline_ = d.sq_inline;
  s->sbuf_size_ = d.sbuf_size;
  s->rbuf_size_ = d.rbuf_size;
  s->target_iomap_size_ = d.iomap_size;
  s->fs_flags_ = nonblocking ? O_NONBLOCK : 0;
  s->fd_flags_ = cloexec ? FD_CLOEXEC : 0;
  s->channel_ = rdma_create_event_channel();
  if (s->channel_ == nullptr) return nullptr;
  s->fd_ = s->channel_->fd;
  // We wait with poll(); the channel itself never blocks.
  ::fcntl(s->fd_, F_SETFL, ::fcntl(s->fd_, F_GETFL) | O_NONBLOCK);
  if (rdma_create_id(s->channel_, &s->id_, s.get(), RDMA_PS_TCP) != 0) return nullptr;
  return s;
}

StreamSocket::~StreamSocket() {
  if (id_ != nullptr && id_->qp != nullptr) {
    if (cq_ != nullptr && unack_cqe_ != 0) ibv_ack_cq_events(cq_, unack_cqe_);
    rdma_destroy_qp(id_);
  }
  for (IomapRegion& region : iomaps_) ibv_dereg_mr(region.mr);
  if (smr_ != nullptr) ibv_dereg_mr(smr_);
  if (rmr_ != nullptr) ibv_dereg_mr(rmr_);
  if (target_mr_ != nullptr) ibv_dereg_mr(target_mr_);
  if (cq_ != nullptr) ibv_destroy_cq(cq_);
  if (cq_channel_ != nullptr) ibv_destroy_comp_channel(cq_channel_);
  if (id_ != nullptr) rdma_destroy_id(id_);
  if (channel_ != nullptr) rdma_destroy_event_channel(channel_);
}

// ---- connection setup -------------------------------------------------------

int StreamSocket::bind(const sockaddr* addr, socklen_t len) {
  std::lock_guard guard(lock_);
  if (addr == nullptr || len < sizeof(sa_family_t)) return fail(EINVAL);
  if (rdma_bind_addr(id_, const_cast<sockaddr*>(addr)) != 0) return -1;
  state_ = kBound;
  return 0;
}

int StreamSocket::listen(int backlog) {
  std::lock_guard guard(lock_);
  if (state_ == kListening) return 0;
  if (rdma_listen(id_, backlog) != 0) return -1;
  state_ = kListening;
  return 0;
}

int StreamSocket::next_cm_event(bool nonblock, rdma_cm_event_type* type, int* status, ConnData* data,
                                rdma_conn_param* param) {
  for (;;) {
    rdma_cm_event* event = nullptr;
    if (rdma_get_cm_event(channel_, &event) == 0) {
      *type = event->event;
      *status = event->status;
      if (data != nullptr) {
        std::memset(data, 0, sizeof *data);
        if (event->param.conn.private_data != nullptr)
          std::memcpy(data, event->param.conn.private_data,
                      std::min<size_t>(sizeof *data, event->param.conn.private_data_len));
      }
      if (param != nullptr) *param = event->param.conn;
      rdma_ack_cm_event(event);
      return 0;
    }
    if (errno != EAGAIN || nonblock) return -1;
    pollfd wait{fd_, POLLIN, 0};
    ::poll(&wait, 1, -1);
  }
}

void StreamSocket::drain_cm_events() {
  if (!(state_ & (kConnected | kDisconnected | kError))) return;
  rdma_cm_event_type type;
  int status;
  while (next_cm_event(true, &type, &status, nullptr, nullptr) == 0) {
    if (type == RDMA_CM_EVENT_DISCONNECTED && (state_ & kConnected)) state_ = kDisconnected;
  }
}

int StreamSocket::fail_connect(int error) {
  state_ = kConnectError;
  err_ = error;
  return fail(error);
}

void StreamSocket::format_conn_data(ConnData* conn) const {
  std::memset(conn, 0, sizeof *conn);
  conn->version = 1;
  conn->flags = kConnFlagIomap | (__BYTE_ORDER == __BIG_ENDIAN ? kConnFlagNet : 0);
  conn->credits = htobe16(static_cast<uint16_t>(rq_size_));
  conn->target_iomap_size = static_cast<uint8_t>(scale_of(target_iomap_size_));
  conn->target_sgl.addr = htobe64(reinterpret_cast<uintptr_t>(target_sgl_));
  conn->target_sgl.length = htobe32(kSglSize);
  conn->target_sgl.key = htobe32(target_mr_->rkey);
  conn->data_buf.addr = htobe64(reinterpret_cast<uintptr_t>(rbuf_.get()));
  conn->data_buf.length = htobe32(rbuf_size_ >> 1);
  conn->data_buf.key = htobe32(rmr_->rkey);
}

void StreamSocket::save_conn_data(const ConnData& conn) {
  remote_sgl_.addr = be64toh(conn.target_sgl.addr);
  remote_sgl_.length = be32toh(conn.target_sgl.length);
  remote_sgl_.key = be32toh(conn.target_sgl.key);
  remote_sge_ = 1;
  if (conn.flags & kConnFlagIomap) {
    remote_iomap_.addr = remote_sgl_.addr + sizeof(WireSge) * remote_sgl_.length;
    remote_iomap_.length = static_cast<uint32_t>(value_of(conn.target_iomap_size));
    remote_iomap_.key = remote_sgl_.key;
  }
  remote_slot_used_.assign(remote_iomap_.length, false);
  target_sgl_[0].addr = be64toh(conn.data_buf.addr);
  target_sgl_[0].length = be32toh(conn.data_buf.length);
  target_sgl_[0].key = be32toh(conn.data_buf.key);
  sseq_comp_ = be16toh(conn.credits);
}

int StreamSocket::create_endpoint() {
  ibv_device_attr attr{};
  uint32_t max_size = kQpMaxSize;
  if (ibv_query_device(id_->verbs, &attr) == 0) max_size = std::min<uint32_t>(max_size, attr.max_qp_wr);
  sq_size_ = std::clamp(sq_size_, kQpMinSize, max_size);
  rq_size_ = std::clamp(rq_size_, kQpMinSize, max_size);

  cq_channel_ = ibv_create_comp_channel(id_->verbs);
  if (cq_channel_ == nullptr) return -1;
  ::fcntl(cq_channel_->fd, F_SETFL, ::fcntl(cq_channel_->fd, F_GETFL) | O_NONBLOCK);
  cq_ = ibv_create_cq(id_->verbs, static_cast<int>(sq_size_ + rq_size_), this, cq_channel_, 0);
  if (cq_ == nullptr) return -1;

  ibv_qp_init_attr qp_attr{};
  qp_attr.qp_context = this;
  qp_attr.send_cq = cq_;
  qp_attr.recv_cq = cq_;
  qp_attr.qp_type = IBV_QPT_RC;
  qp_attr.sq_sig_all = 1;
  qp_attr.cap.max_send_wr = sq_size_;
  qp_attr.cap.max_recv_wr = rq_size_;
  qp_attr.cap.max_send_sge = 2;
  qp_attr.cap.max_recv_sge = 1;
  qp_attr.cap.max_inline_data = sq_inline_;
  if (rdma_create_qp(id_, nullptr, &qp_attr) != 0) return -1;
  sq_inline_ = qp_attr.cap.max_inline_data;

  rmsg_.assign(rq_size_ + 1, RecvMessage{});
  const size_t total_sbuf = sbuf_size_ + kMaxCtrlMsg * kCtrlSlots;
  sbuf_ = allocate_pages(total_sbuf);
  const size_t target_length = sizeof(WireSge) * kSglSize + sizeof(WireIomap) * target_iomap_size_;
  target_ = allocate_pages(target_length);
  rbuf_ = allocate_pages(rbuf_size_);
  if (!sbuf_ || !target_ || !rbuf_) return fail(ENOMEM);
  constexpr int kRemoteWrite = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  smr_ = ibv_reg_mr(id_->pd, sbuf_.get(), total_sbuf, IBV_ACCESS_LOCAL_WRITE);
  target_mr_ = ibv_reg_mr(id_->pd, target_.get(), target_length, kRemoteWrite);
  rmr_ = ibv_reg_mr(id_->pd, rbuf_.get(), rbuf_size_, kRemoteWrite);
  if (smr_ == nullptr || target_mr_ == nullptr || rmr_ == nullptr) return -1;
  target_sgl_ = reinterpret_cast<volatile WireSge*>(target_.get());
  if (target_iomap_size_ != 0) target_iomap_ = reinterpret_cast<volatile WireIomap*>(target_sgl_ + kSglSize);

  ssgl_[0].addr = ssgl_[1].addr = reinterpret_cast<uintptr_t>(sbuf_.get());
  ssgl_[0].lkey = ssgl_[1].lkey = smr_->lkey;
  sbuf_bytes_avail_ = static_cast<int>(sbuf_size_);
  rbuf_free_offset_ = static_cast<int>(rbuf_size_ >> 1);
  rbuf_bytes_avail_ = static_cast<int>(rbuf_size_ >> 1);
  sqe_avail_ = static_cast<int>(sq_size_ - ctrl_max_seqno_);
  rseq_comp_ = static_cast<uint16_t>(rq_size_ >> 1);
  for (uint32_t i = 0; i < rq_size_; ++i)
    if (post_recv() != 0) return -1;
  return 0;
}

int StreamSocket::do_connect(bool nonblock) {
  rdma_cm_event_type type;
  int status;
  for (;;) {
    switch (state_) {
      case kInit:
      case kBound:
        if (rdma_resolve_addr(id_, nullptr, reinterpret_cast<sockaddr*>(&peer_), kResolveTimeoutMs) != 0)
          return fail_connect(errno);
        state_ = kResolvingAddr;
        break;
      case kResolvingAddr:
      case kResolvingRoute:
      case kConnecting:
      case kAccepting: {
        ConnData reply;
        if (next_cm_event(nonblock, &type, &status, &reply, nullptr) != 0) {
          if (errno == EAGAIN) return fail(EINPROGRESS);
          return fail_connect(errno);
        }
        if (state_ == kResolvingAddr && type == RDMA_CM_EVENT_ADDR_RESOLVED) {
          if (rdma_resolve_route(id_, kResolveTimeoutMs) != 0) return fail_connect(errno);
          state_ = kResolvingRoute;
        } else if (state_ == kResolvingRoute && type == RDMA_CM_EVENT_ROUTE_RESOLVED) {
          if (create_endpoint() != 0) return fail_connect(errno);
          ConnData request;
          format_conn_data(&request);
          rdma_conn_param param{};
          param.private_data = &request;
          param.private_data_len = sizeof request;
          param.flow_control = 1;
          param.retry_count = 7;
          param.rnr_retry_count = 7;
          if (rdma_connect(id_, &param) != 0) return fail_connect(errno);
          state_ = kConnecting;
        } else if (state_ == kConnecting && type == RDMA_CM_EVENT_ESTABLISHED) {
          if (reply.version != 1) return fail_connect(ENOTSUP);
          save_conn_data(reply);
          state_ = kConnectRdwr;
          return 0;
        } else if (state_ == kAccepting && type == RDMA_CM_EVENT_ESTABLISHED) {
          state_ = kConnectRdwr;
          return 0;
        } else {
          return fail_connect(event_error(type, status));
        }
        break;
      }
      case kConnectError:
      case kDisconnected:
      case kError:
        return fail(ENOTCONN);
      default:
        return (state_ & kConnected) ? 0 : fail(EINVAL);
    }
  }
}

int StreamSocket::connect(const sockaddr* addr, socklen_t len) {
  std::unique_lock lock(lock_);
  if (addr == nullptr || len < sizeof(sa_family_t) || len > sizeof peer_) return fail(EINVAL);
  if (state_ == kInit || state_ == kBound) {
    std::memcpy(&peer_, addr, len);
    have_peer_ = true;
  }
  return do_connect(fs_flags_ & O_NONBLOCK);
}

std::shared_ptr<StreamSocket> StreamSocket::accept(sockaddr* addr, socklen_t* len) {
  std::unique_lock lock(lock_);
  if (state_ != kListening) {
    errno = EBADF;  // as rdma-core
    return nullptr;
  }
  for (;;) {
    rdma_cm_event* event = nullptr;
    if (rdma_get_cm_event(channel_, &event) != 0) {
      if (errno != EAGAIN || (fs_flags_ & O_NONBLOCK)) return nullptr;
      pollfd wait{fd_, POLLIN, 0};
      lock.unlock();
      ::poll(&wait, 1, -1);
      lock.lock();
      continue;
    }
    if (event->event != RDMA_CM_EVENT_CONNECT_REQUEST) {
      rdma_ack_cm_event(event);
      continue;
    }
    rdma_cm_id* new_id = event->id;
    ConnData request{};
    if (event->param.conn.private_data != nullptr)
      std::memcpy(&request, event->param.conn.private_data,
                  std::min<size_t>(sizeof request, event->param.conn.private_data_len));
    rdma_conn_param param = event->param.conn;
    rdma_ack_cm_event(event);

    std::shared_ptr<StreamSocket> s(new StreamSocket);
    s->domain_ = domain_;
    s->sq_size_ = sq_size_;
    s->rq_size_ = rq_size_;
    s->sq_inline_ = sq_inline_;
    s->sbuf_size_ = sbuf_size_;
    s->rbuf_size_ = rbuf_size_;
    s->target_iomap_size_ = target_iomap_size_;
    s->fs_flags_ = fs_flags_;
    s->fd_flags_ = fd_flags_;
    s->channel_ = rdma_create_event_channel();
    bool ok = request.version == 1 && s->channel_ != nullptr;
    if (ok) {
      s->fd_ = s->channel_->fd;
      ::fcntl(s->fd_, F_SETFL, ::fcntl(s->fd_, F_GETFL) | O_NONBLOCK);
      ok = rdma_migrate_id(new_id, s->channel_) == 0;
    }
    if (ok) {
      s->id_ = new_id;
      new_id->context = s.get();
      ok = s->create_endpoint() == 0;
    }
    if (ok) {
      s->save_conn_data(request);
      ConnData reply;
      s->format_conn_data(&reply);
      param.private_data = &reply;
      param.private_data_len = sizeof reply;
      ok = rdma_accept(new_id, &param) == 0;
    }
    if (!ok) {
      rdma_reject(new_id, nullptr, 0);
      if (s->id_ == nullptr) rdma_destroy_id(new_id);
      continue;  // s's destructor releases the rest
    }
    s->state_ = kAccepting;
    if (addr != nullptr && len != nullptr) copy_sockaddr(addr, len, rdma_get_peer_addr(new_id));
    return s;
  }
}

// ---- data path ----------------------------------------------------------------

int StreamSocket::post_recv() {
  ibv_recv_wr wr{};
  ibv_recv_wr* bad = nullptr;
  wr.wr_id = kRecvFlag;
  int r = ibv_post_recv(id_->qp, &wr, &bad);
  return r == 0 ? 0 : fail(r);
}

int StreamSocket::post_write(ibv_sge* sgl, int nsge, uint32_t wr_data, int flags, uint64_t addr, uint32_t rkey,
                             bool with_imm) {
  ibv_send_wr wr{};
  ibv_send_wr* bad = nullptr;
  wr.wr_id = wr_data;
  wr.sg_list = sgl;
  wr.num_sge = nsge;
  wr.opcode = with_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  wr.send_flags = static_cast<unsigned>(flags);
  if (with_imm) wr.imm_data = htobe32(wr_data);
  wr.wr.rdma.remote_addr = addr;
  wr.wr.rdma.rkey = rkey;
  int r = ibv_post_send(id_->qp, &wr, &bad);
  return r == 0 ? 0 : fail(r);
}

int StreamSocket::post_msg(uint32_t msg) { return post_write(nullptr, 0, msg, 0, 0, 0, true); }

// The target entry moves before the write is posted: the peer may replace
// the entry as soon as the data land.
int StreamSocket::write_data(ibv_sge* sgl, int nsge, uint32_t length, int flags) {
  sseq_no_++;
  sqe_avail_--;
  sbuf_bytes_avail_ -= static_cast<int>(length);
  volatile WireSge& target = target_sgl_[target_sge_];
  uint64_t addr = target.addr;
  uint32_t rkey = target.key;
  target.addr = addr + length;
  target.length = target.length - length;
  if (target.length == 0 && ++target_sge_ == kSglSize) target_sge_ = 0;
  return post_write(sgl, nsge, message(Op::Data, length), flags, addr, rkey, true);
}

int StreamSocket::write_direct(const WireIomap& iom, uint64_t offset, ibv_sge* sgl, int nsge, uint32_t length,
                               int flags) {
  sqe_avail_--;
  sbuf_bytes_avail_ -= static_cast<int>(length);
  return post_write(sgl, nsge, message(Op::Write, length), flags, iom.sge.addr + offset - iom.offset, iom.sge.key,
                    false);
}

uint32_t StreamSocket::sbuf_left() const {
  return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(sbuf_.get() + sbuf_size_) - ssgl_[0].addr);
}

void StreamSocket::send_credits() {
  ctrl_seqno_++;
  rseq_comp_ = static_cast<uint16_t>(rseq_no_ + (rq_size_ >> 1));
  const uint32_t grant = message(Op::Sgl, static_cast<uint16_t>(rseq_no_ + rq_size_));
  if (rbuf_bytes_avail_ >= static_cast<int>(rbuf_size_ >> 1)) {
    WireSge sge{reinterpret_cast<uintptr_t>(&rbuf_[rbuf_free_offset_]), rmr_->rkey, rbuf_size_ >> 1};
    ibv_sge local{};
    int flags = 0;
    if (sq_inline_ < sizeof sge) {
      uint8_t* slot = sbuf_.get() + sbuf_size_ + kMaxCtrlMsg * (ctrl_seqno_ & (kCtrlSlots - 1));
      std::memcpy(slot, &sge, sizeof sge);
      local.addr = reinterpret_cast<uintptr_t>(slot);
      local.lkey = smr_->lkey;
    } else {
      local.addr = reinterpret_cast<uintptr_t>(&sge);
      flags = IBV_SEND_INLINE;
    }
    local.length = sizeof sge;
    post_write(&local, 1, grant, flags, remote_sgl_.addr + remote_sge_ * sizeof(WireSge), remote_sgl_.key, true);
    rbuf_bytes_avail_ -= static_cast<int>(rbuf_size_ >> 1);
    rbuf_free_offset_ += static_cast<int>(rbuf_size_ >> 1);
    if (rbuf_free_offset_ >= static_cast<int>(rbuf_size_)) rbuf_free_offset_ = 0;
    if (++remote_sge_ == static_cast<int>(remote_sgl_.length)) remote_sge_ = 0;
  } else {
    post_msg(grant);
  }
}

void StreamSocket::update_credits() {
  bool give = (rbuf_bytes_avail_ >= static_cast<int>(rbuf_size_ >> 1) ||
               static_cast<int16_t>(static_cast<int16_t>(rseq_no_) - static_cast<int16_t>(rseq_comp_)) >= 0) &&
              ctrl_avail() && (state_ & kConnected);
  if (give) send_credits();
}

bool StreamSocket::can_send() const {
  return sqe_avail_ > 0 && sbuf_bytes_avail_ >= static_cast<int>(kSndLowat) && sseq_no_ != sseq_comp_ &&
         target_sgl_[target_sge_].length != 0;
}

int StreamSocket::poll_cq() {
  ibv_wc wcs[16];
  int n = 0;
  int received = 0;
  bool stop = false;
  while (!stop && (n = ibv_poll_cq(cq_, 16, wcs)) > 0) {
    for (int i = 0; i < n; ++i) {
      const ibv_wc& wc = wcs[i];
      if (wc.wr_id & kRecvFlag) {
        if (wc.status != IBV_WC_SUCCESS) continue;
        received++;
        uint32_t msg = be32toh(wc.imm_data);
        switch (op_of(msg)) {
          case Op::Sgl:
            sseq_comp_ = static_cast<uint16_t>(data_of(msg));
            break;
          case Op::Ctrl:
            if (data_of(msg) == kCtrlDisconnect) {
              state_ = kDisconnected;
              stop = true;
            } else if (data_of(msg) == kCtrlShutdown) {
              if (state_ & kWritable) {
                state_ &= ~kReadable;
              } else {
                state_ = kDisconnected;
                stop = true;
              }
            }
            break;
          case Op::Data:
            rmsg_[rmsg_tail_] = {static_cast<uint32_t>(op_of(msg)), data_of(msg)};
            if (++rmsg_tail_ == static_cast<int>(rq_size_ + 1)) rmsg_tail_ = 0;
            break;
          default:  // an iomap update, or what rdma-core reserves: nothing to do
            break;
        }
      } else {
        uint32_t data = static_cast<uint32_t>(wc.wr_id);
        switch (op_of(data)) {
          case Op::Sgl:
            ctrl_max_seqno_++;
            break;
          case Op::Ctrl:
            ctrl_max_seqno_++;
            if (data_of(data) == kCtrlDisconnect) state_ = kDisconnected;
            break;
          case Op::IomapSgl:
            sqe_avail_++;
            sbuf_bytes_avail_ += sizeof(WireIomap);
            break;
          default:
            sqe_avail_++;
            sbuf_bytes_avail_ += static_cast<int>(data_of(data));
            break;
        }
        if (wc.status != IBV_WC_SUCCESS && (state_ & kConnected)) {
          state_ = kError;
          err_ = EIO;
        }
      }
    }
  }
  int ret = n < 0 ? fail(EIO) : 0;
  if (state_ & kConnected) {
    while (ret == 0 && received-- > 0) ret = post_recv();
    if (ret != 0) {
      state_ = kError;
      err_ = errno;
    }
  }
  return ret;
}

void StreamSocket::after_poll_wait() {
  if (!cq_armed_ || cq_ == nullptr) return;
  ibv_cq* cq = nullptr;
  void* context = nullptr;
  if (ibv_get_cq_event(cq_channel_, &cq, &context) == 0) {
    if (++unack_cqe_ >= sq_size_ + rq_size_) {
      ibv_ack_cq_events(cq_, unack_cqe_);
      unack_cqe_ = 0;
    }
    cq_armed_ = false;
  }
}

int StreamSocket::process_cq(bool nonblock, Test test, std::unique_lock<std::mutex>& lock) {
  int ret = 0;
  for (;;) {
    update_credits();
    ret = poll_cq();
    drain_cm_events();
    if ((this->*test)()) {
      ret = 0;
      break;
    }
    if (ret != 0) break;
    if (nonblock) {
      ret = fail(EWOULDBLOCK);
      break;
    }
    if (!cq_armed_) {
      ibv_req_notify_cq(cq_, 0);
      cq_armed_ = true;
      continue;  // what completed before the arm raises no event
    }
    update_credits();
    // The CQ's event, or the CM's (a disconnect the peer's shim reports).
    pollfd waits[2] = {{cq_channel_->fd, POLLIN, 0}, {fd_, POLLIN, 0}};
    lock.unlock();
    ::poll(waits, 2, -1);
    lock.lock();
    after_poll_wait();
  }
  update_credits();
  return ret;
}

int StreamSocket::get_comp(bool nonblock, Test test, std::unique_lock<std::mutex>& lock) {
  uint64_t start = 0;
  for (;;) {
    int ret = process_cq(true, test, lock);
    if (ret == 0 || nonblock || errno != EWOULDBLOCK) return ret;
    if (start == 0) start = now_us();
    if (now_us() - start > kSpinMicroseconds) break;
  }
  return process_cq(false, test, lock);
}

ssize_t StreamSocket::recv(void* buf, size_t len, int flags) {
  iovec iov{buf, len};
  return recvv(&iov, 1, flags);
}

int StreamSocket::finish_connect(int flags) {
  if (!(state_ & kOpening) || do_connect(nonblocking(flags)) == 0) return 0;
  if (errno == EINPROGRESS) errno = EAGAIN;
  return -1;
}

ssize_t StreamSocket::recvv(const iovec* iov, int iovcnt, int flags) {
  std::unique_lock lock(lock_);
  if (finish_connect(flags) != 0) return -1;
  if (cq_ == nullptr) return fail(ENOTCONN);
  size_t len = 0;
  for (int i = 0; i < iovcnt; ++i) len += iov[i].iov_len;
  size_t left = len;
  int ret = 0;
  int cur = 0;
  size_t cur_offset = 0;
  // Copies `size` bytes of the receive buffer at `from` to the iovecs.
  auto deliver = [&](int from, uint32_t size) {
    while (size > 0) {
      while (iov[cur].iov_len == cur_offset) {
        cur++;
        cur_offset = 0;
      }
      size_t n = std::min<size_t>(size, iov[cur].iov_len - cur_offset);
      std::memcpy(static_cast<uint8_t*>(iov[cur].iov_base) + cur_offset, &rbuf_[from], n);
      cur_offset += n;
      from += static_cast<int>(n);
      size -= static_cast<uint32_t>(n);
    }
  };
  do {
    if (!have_rdata()) {
      ret = get_comp(nonblocking(flags), &StreamSocket::conn_have_rdata, lock);
      if (ret != 0) break;
    }
    if (flags & MSG_PEEK) {
      int head = rmsg_head_;
      int offset = rbuf_offset_;
      uint32_t first_taken = 0;  // what an earlier partial read left of the head message
      while (left > 0 && head != rmsg_tail_) {
        uint32_t size = rmsg_[head].data - (head == rmsg_head_ ? first_taken : 0);
        uint32_t take = static_cast<uint32_t>(std::min<size_t>(left, size));
        uint32_t end = rbuf_size_ - static_cast<uint32_t>(offset);
        if (take > end) {
          deliver(offset, end);
          deliver(0, take - end);
          offset = static_cast<int>(take - end);
        } else {
          deliver(offset, take);
          offset += static_cast<int>(take);
        }
        left -= take;
        if (++head == static_cast<int>(rq_size_ + 1)) head = 0;
      }
      break;
    }
    while (left > 0 && have_rdata()) {
      uint32_t size;
      if (left < rmsg_[rmsg_head_].data) {
        size = static_cast<uint32_t>(left);
        rmsg_[rmsg_head_].data -= size;
      } else {
        rseq_no_++;
        size = rmsg_[rmsg_head_].data;
        if (++rmsg_head_ == static_cast<int>(rq_size_ + 1)) rmsg_head_ = 0;
      }
      uint32_t end = rbuf_size_ - static_cast<uint32_t>(rbuf_offset_);
      if (size > end) {
        deliver(rbuf_offset_, end);
        rbuf_offset_ = 0;
        rbuf_bytes_avail_ += static_cast<int>(end);
        left -= end;
        size -= end;
      }
      deliver(rbuf_offset_, size);
      rbuf_offset_ += static_cast<int>(size);
      rbuf_bytes_avail_ += static_cast<int>(size);
      left -= size;
    }
  } while (left > 0 && (flags & MSG_WAITALL) && (state_ & kReadable));
  // Hand out the space just freed without waiting for the next call.
  if (state_ & kConnected) update_credits();
  return (ret != 0 && left == len) ? ret : static_cast<ssize_t>(len - left);
}

int StreamSocket::stage_and_write(const iovec*& iov, size_t& iov_offset, uint32_t length, const WireIomap* iom,
                                  uint64_t offset, const IomapRegion* announce) {
  auto copy_in = [&](uint8_t* to, uint32_t n) {
    while (n > 0) {
      size_t avail = iov->iov_len - iov_offset;
      if (avail == 0) {
        iov++;
        iov_offset = 0;
        continue;
      }
      size_t c = std::min<size_t>(avail, n);
      std::memcpy(to, static_cast<const uint8_t*>(iov->iov_base) + iov_offset, c);
      to += c;
      n -= static_cast<uint32_t>(c);
      iov_offset += c;
    }
  };
  const int flags = length <= sq_inline_ ? IBV_SEND_INLINE : 0;
  int nsge = 1;
  if (length <= sbuf_left()) {
    copy_in(reinterpret_cast<uint8_t*>(ssgl_[0].addr), length);
    ssgl_[0].length = length;
  } else {
    ssgl_[0].length = sbuf_left();
    copy_in(reinterpret_cast<uint8_t*>(ssgl_[0].addr), ssgl_[0].length);
    ssgl_[1].length = length - ssgl_[0].length;
    copy_in(sbuf_.get(), ssgl_[1].length);
    nsge = 2;
  }
  int ret;
  if (announce != nullptr) {
    sseq_no_++;
    sqe_avail_--;
    sbuf_bytes_avail_ -= static_cast<int>(length);
    ret = post_write(ssgl_, nsge, message(Op::IomapSgl, static_cast<uint32_t>(announce->index)), flags,
                     remote_iomap_.addr + static_cast<uint64_t>(announce->index) * sizeof(WireIomap), remote_iomap_.key,
                     true);
  } else if (iom != nullptr) {
    ret = write_direct(*iom, offset, ssgl_, nsge, length, flags);
  } else {
    ret = write_data(ssgl_, nsge, length, flags);
  }
  if (nsge == 2)
    ssgl_[0].addr = reinterpret_cast<uintptr_t>(sbuf_.get()) + ssgl_[1].length;
  else if (length < sbuf_left())
    ssgl_[0].addr += length;
  else
    ssgl_[0].addr = reinterpret_cast<uintptr_t>(sbuf_.get());
  return ret;
}

ssize_t StreamSocket::sendv(const iovec* iov, int iovcnt, int flags) {
  std::unique_lock lock(lock_);
  if (finish_connect(flags) != 0) return -1;
  if (cq_ == nullptr) return fail(ENOTCONN);
  if (!(state_ & kWritable)) return fail(ECONNRESET);
  size_t len = 0;
  for (int i = 0; i < iovcnt; ++i) len += iov[i].iov_len;
  size_t left = len;
  int ret = 0;
  uint32_t olen = kOlapStartSize;
  size_t iov_offset = 0;
  ret = announce_iomaps(flags, lock);
  while (ret == 0 && left > 0) {
    if ((ret = wait_send(flags, lock)) != 0) break;
    uint32_t xfer;
    if (olen < left) {
      xfer = olen;
      if (olen < kMaxTransfer) olen <<= 1;
    } else {
      xfer = static_cast<uint32_t>(left);
    }
    xfer = std::min<uint32_t>(xfer, static_cast<uint32_t>(sbuf_bytes_avail_));
    xfer = std::min<uint32_t>(xfer, static_cast<uint32_t>(target_sgl_[target_sge_].length));
    ret = stage_and_write(iov, iov_offset, xfer, nullptr, 0, nullptr);
    if (ret != 0) break;
    left -= xfer;
  }
  return (ret != 0 && left == len) ? ret : static_cast<ssize_t>(len - left);
}

int StreamSocket::wait_send(int flags, std::unique_lock<std::mutex>& lock) {
  if (can_send()) return 0;
  int r = get_comp(nonblocking(flags), &StreamSocket::conn_can_send, lock);
  if (r != 0) return r;
  if (!(state_ & kWritable)) return fail(ECONNRESET);
  return 0;
}

// riomap'd regions the peer has not heard of yet: each a WRITE with
// immediate of its table entry into the peer's iomap table.
int StreamSocket::announce_iomaps(int flags, std::unique_lock<std::mutex>& lock) {
  for (IomapRegion& region : iomaps_) {
    if (region.announced || region.index < 0) continue;
    if (int r = wait_send(flags, lock); r != 0) return r;
    WireIomap entry{
        region.offset,
        {reinterpret_cast<uintptr_t>(region.mr->addr), region.mr->rkey, static_cast<uint32_t>(region.mr->length)}};
    iovec from{&entry, sizeof entry};
    const iovec* cursor = &from;
    size_t offset = 0;
    region.announced = true;
    if (int r = stage_and_write(cursor, offset, sizeof entry, nullptr, 0, &region); r != 0) return r;
  }
  return 0;
}

int StreamSocket::shutdown(int how) {
  std::unique_lock lock(lock_);
  if (how != SHUT_RD && how != SHUT_WR && how != SHUT_RDWR) return fail(EINVAL);
  int ret = 0;
  if (state_ & kConnected) {
    uint32_t ctrl;
    bool send = true;
    if (how == SHUT_RDWR) {
      ctrl = kCtrlDisconnect;
      state_ &= ~(kReadable | kWritable);
    } else if (how == SHUT_WR) {
      state_ &= ~kWritable;
      ctrl = (state_ & kReadable) ? kCtrlShutdown : kCtrlDisconnect;
    } else {
      state_ &= ~kReadable;
      send = !(state_ & kWritable);
      ctrl = kCtrlDisconnect;
    }
    if (send) {
      if (!ctrl_avail()) ret = process_cq(false, &StreamSocket::conn_can_send_ctrl, lock);
      if (ret == 0 && (state_ & kConnected) && ctrl_avail()) {
        ctrl_seqno_++;
        ret = post_msg(message(Op::Ctrl, ctrl));
      }
    }
  }
  if (state_ & kConnected) process_cq(false, &StreamSocket::all_sends_done, lock);
  if ((state_ & kDisconnected) && !cm_disconnected_) {
    cm_disconnected_ = true;
    rdma_disconnect(id_);
  }
  return ret;
}

void StreamSocket::close() {
  if (state_ & kConnected) shutdown(SHUT_RDWR);
}

int StreamSocket::getpeername(sockaddr* addr, socklen_t* len) {
  std::lock_guard guard(lock_);
  if (addr == nullptr || len == nullptr) return fail(EFAULT);
  copy_sockaddr(addr, len, rdma_get_peer_addr(id_));
  return 0;
}

int StreamSocket::getsockname(sockaddr* addr, socklen_t* len) {
  std::lock_guard guard(lock_);
  if (addr == nullptr || len == nullptr) return fail(EFAULT);
  sockaddr* local = rdma_get_local_addr(id_);
  if (local->sa_family == AF_UNSPEC) local->sa_family = static_cast<sa_family_t>(domain_);
  copy_sockaddr(addr, len, local);
  return 0;
}

int StreamSocket::setsockopt(int level, int name, const void* value, socklen_t len) {
  std::lock_guard guard(lock_);
  if (value == nullptr || len < sizeof(int)) return fail(EINVAL);
  const int on = *static_cast<const int*>(value);
  uint64_t* opts = nullptr;
  bool opt_on = false;
  int ret = -1;
  errno = ENOTSUP;
  switch (level) {
    case SOL_SOCKET:
      opts = &so_opts_;
      switch (name) {
        case SO_REUSEADDR:
          rdma_set_option(id_, RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR, const_cast<void*>(value), len);
          opt_on = on != 0;
          ret = 0;
          break;
        case SO_RCVBUF:
          if (!rbuf_) rbuf_size_ = static_cast<uint32_t>(on) << 1;
          ret = 0;
          break;
        case SO_SNDBUF:
          if (!sbuf_) sbuf_size_ = static_cast<uint32_t>(on) << 1;
          if (sbuf_size_ < kSndLowat) sbuf_size_ = kSndLowat << 1;
          ret = 0;
          break;
        case SO_LINGER:
          if (len < sizeof(linger)) return fail(EINVAL);
          opt_on = !static_cast<const linger*>(value)->l_onoff;  // inverted: the default (0) is on
          ret = 0;
          break;
        case SO_KEEPALIVE:
          // Recorded; no keepalive messages are sent (see docs/rdmacm.md).
          if (keepalive_time_ == 0) keepalive_time_ = 7200;
          opt_on = on != 0;
          ret = 0;
          break;
        case SO_OOBINLINE:
          opt_on = on != 0;
          ret = 0;
          break;
        default:
          break;
      }
      break;
    case IPPROTO_IP:
      if (name == IP_TOS) {
        tos_ = on;
        ret = rdma_set_option(id_, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, const_cast<void*>(value), len);
      }
      break;
    case IPPROTO_TCP:
      opts = &tcp_opts_;
      switch (name) {
        case TCP_KEEPCNT:
        case TCP_KEEPINTVL:
        case TCP_MAXSEG:
        case TCP_CONGESTION:
          ret = 0;
          break;
        case TCP_KEEPIDLE:
          if (on <= 0) return fail(EINVAL);
          keepalive_time_ = static_cast<unsigned>(on);
          ret = 0;
          break;
        case TCP_NODELAY:
          opt_on = on != 0;
          ret = 0;
          break;
        default:
          break;
      }
      break;
    case IPPROTO_IPV6:
      opts = &ipv6_opts_;
      if (name == IPV6_V6ONLY) {
        ret = rdma_set_option(id_, RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY, const_cast<void*>(value), len);
        opt_on = on != 0;
      }
      break;
    case SOL_RDMA:
      if (state_ >= kOpening) return fail(EINVAL);
      switch (name) {
        case RDMA_SQSIZE:
          sq_size_ = std::min<uint32_t>(static_cast<uint32_t>(on), kQpMaxSize);
          ret = 0;
          break;
        case RDMA_RQSIZE:
          rq_size_ = std::min<uint32_t>(static_cast<uint32_t>(on), kQpMaxSize);
          ret = 0;
          break;
        case RDMA_INLINE:
          sq_inline_ = std::min<uint32_t>(static_cast<uint32_t>(on), kQpMaxSize);
          ret = 0;
          break;
        case RDMA_IOMAPSIZE:
          target_iomap_size_ = static_cast<uint16_t>(value_of(static_cast<uint8_t>(scale_of(on))));
          ret = 0;
          break;
        default:
          break;
      }
      break;
    default:
      break;
  }
  if (ret == 0 && opts != nullptr && name < 64) {
    if (opt_on)
      *opts |= uint64_t{1} << name;
    else
      *opts &= ~(uint64_t{1} << name);
  }
  return ret;
}

int StreamSocket::getsockopt(int level, int name, void* value, socklen_t* len) {
  std::lock_guard guard(lock_);
  if (value == nullptr || len == nullptr || *len < sizeof(int)) return fail(EINVAL);
  auto put = [&](int v) {
    *static_cast<int*>(value) = v;
    *len = sizeof(int);
    return 0;
  };
  auto bit = [](uint64_t set, int n) { return static_cast<int>((set >> n) & 1); };
  switch (level) {
    case SOL_SOCKET:
      switch (name) {
        case SO_REUSEADDR:
        case SO_KEEPALIVE:
        case SO_OOBINLINE:
          return put(bit(so_opts_, name));
        case SO_RCVBUF:
          return put(static_cast<int>(rbuf_size_));
        case SO_SNDBUF:
          return put(static_cast<int>(sbuf_size_));
        case SO_LINGER: {
          if (*len < sizeof(linger)) return fail(EINVAL);
          linger l{!bit(so_opts_, name), 0};
          std::memcpy(value, &l, sizeof l);
          *len = sizeof l;
          return 0;
        }
        case SO_ERROR: {
          int error = err_;
          err_ = 0;
          return put(error);
        }
        case SO_TYPE:
          return put(SOCK_STREAM);
        default:
          return fail(ENOTSUP);
      }
    case IPPROTO_IP:
      if (name == IP_TOS) return put(tos_);
      return fail(ENOTSUP);
    case IPPROTO_TCP:
      switch (name) {
        case TCP_KEEPCNT:
        case TCP_KEEPINTVL:
          return put(1);
        case TCP_KEEPIDLE:
          return put(static_cast<int>(keepalive_time_));
        case TCP_NODELAY:
          return put(bit(tcp_opts_, name));
        case TCP_MAXSEG:
          return put(id_->route.num_paths ? 1 << (7 + id_->route.path_rec->mtu) : 2048);
        case TCP_INFO: {
          if (*len < sizeof(tcp_info)) return fail(EINVAL);
          tcp_info info{};
          info.tcpi_state = (state_ & kConnected) ? TCP_ESTABLISHED : TCP_CLOSE;
          info.tcpi_snd_cwnd = sq_size_;
          std::memcpy(value, &info, sizeof info);
          *len = sizeof info;
          return 0;
        }
        default:
          return fail(ENOTSUP);
      }
    case IPPROTO_IPV6:
      if (name == IPV6_V6ONLY) return put(bit(ipv6_opts_, name));
      return fail(ENOTSUP);
    case SOL_RDMA:
      switch (name) {
        case RDMA_SQSIZE:
          return put(static_cast<int>(sq_size_));
        case RDMA_RQSIZE:
          return put(static_cast<int>(rq_size_));
        case RDMA_INLINE:
          return put(static_cast<int>(sq_inline_));
        case RDMA_IOMAPSIZE:
          return put(target_iomap_size_);
        default:
          return fail(ENOTSUP);
      }
    default:
      return fail(ENOTSUP);
  }
}

int StreamSocket::fcntl(int cmd, long arg) {
  std::lock_guard guard(lock_);
  switch (cmd) {
    case F_GETFL:
      return fs_flags_;
    case F_SETFL:
      fs_flags_ = static_cast<int>(arg);
      return 0;
    case F_GETFD:
      return fd_flags_;
    case F_SETFD:
      fd_flags_ = static_cast<int>(arg);
      return 0;
    default:
      return fail(ENOTSUP);
  }
}

off_t StreamSocket::iomap(void* buf, size_t len, int prot, int, off_t offset) {
  std::lock_guard guard(lock_);
  if (id_->pd == nullptr || cq_ == nullptr || (prot & ~PROT_WRITE)) return fail(EINVAL);
  int index = -1;
  int access = IBV_ACCESS_LOCAL_WRITE;
  if (prot & PROT_WRITE) {
    auto free_slot = std::find(remote_slot_used_.begin(), remote_slot_used_.end(), false);
    if (free_slot == remote_slot_used_.end()) return fail(ENOMEM);
    index = static_cast<int>(free_slot - remote_slot_used_.begin());
    access |= IBV_ACCESS_REMOTE_WRITE;
  }
  ibv_mr* mr = ibv_reg_mr(id_->pd, buf, len, access);
  if (mr == nullptr) return -1;
  if (offset == -1) offset = static_cast<off_t>(reinterpret_cast<uintptr_t>(buf));
  if (index >= 0) remote_slot_used_[static_cast<size_t>(index)] = true;
  iomaps_.push_back({static_cast<uint64_t>(offset), mr, index, false});
  return offset;
}

int StreamSocket::iounmap(void* buf, size_t len) {
  std::lock_guard guard(lock_);
  for (auto it = iomaps_.begin(); it != iomaps_.end(); ++it) {
    if (it->mr->addr == buf && it->mr->length == len) {
      ibv_dereg_mr(it->mr);
      if (it->index >= 0) remote_slot_used_[static_cast<size_t>(it->index)] = false;
      iomaps_.erase(it);
      return 0;
    }
  }
  return fail(EINVAL);
}

bool StreamSocket::find_iomap(uint64_t offset, WireIomap* found) const {
  for (int i = 0; i < target_iomap_size_; ++i) {
    const volatile WireIomap& entry = target_iomap_[i];
    uint64_t start = entry.offset;
    uint32_t length = entry.sge.length;
    if (offset >= start && offset < start + length) {
      *found = {start, {entry.sge.addr, entry.sge.key, length}};
      return true;
    }
  }
  return false;
}

ssize_t StreamSocket::iowrite(const void* buf, size_t count, off_t offset, int flags) {
  std::unique_lock lock(lock_);
  if (cq_ == nullptr) return fail(ENOTCONN);
  int ret = announce_iomaps(flags, lock);
  size_t left = count;
  uint32_t olen = kOlapStartSize;
  iovec from{const_cast<void*>(buf), count};
  const iovec* cursor = &from;
  size_t iov_offset = 0;
  WireIomap iom{};
  bool have_iom = false;
  uint64_t at = static_cast<uint64_t>(offset);
  while (ret == 0 && left > 0) {
    if (!have_iom || at >= iom.offset + iom.sge.length) {
      if (!(have_iom = find_iomap(at, &iom))) break;
    }
    if ((ret = wait_send(flags, lock)) != 0) break;
    uint32_t xfer;
    if (olen < left) {
      xfer = olen;
      if (olen < kMaxTransfer) olen <<= 1;
    } else {
      xfer = static_cast<uint32_t>(left);
    }
    xfer = std::min<uint32_t>(xfer, static_cast<uint32_t>(sbuf_bytes_avail_));
    xfer = static_cast<uint32_t>(std::min<uint64_t>(xfer, iom.offset + iom.sge.length - at));
    ret = stage_and_write(cursor, iov_offset, xfer, &iom, at, nullptr);
    if (ret != 0) break;
    left -= xfer;
    at += xfer;
  }
  return (ret != 0 && left == count) ? ret : static_cast<ssize_t>(count - left);
}

// ---- rpoll --------------------------------------------------------------------

short StreamSocket::poll_events(short events) {
  std::unique_lock lock(lock_);
  if (state_ & kOpening) {
    if (do_connect(true) != 0 && errno == EINPROGRESS) {
      errno = 0;
      return 0;
    }
  }
  if (cq_ != nullptr && ((state_ & (kConnected | kError)) || state_ == kDisconnected)) {
    process_cq(true, &StreamSocket::always, lock);
    short revents = 0;
    if ((events & POLLIN) && conn_have_rdata()) revents |= POLLIN;
    if ((events & POLLOUT) && can_send()) revents |= POLLOUT;
    if (!(state_ & kConnected)) revents |= state_ == kDisconnected ? POLLHUP : POLLERR;
    return revents;
  }
  if (state_ == kListening) {
    pollfd p{fd_, static_cast<short>(events & POLLIN), 0};
    ::poll(&p, 1, 0);
    return p.revents;
  }
  if (state_ == kConnectError) return static_cast<short>((events & (POLLIN | POLLOUT)) | POLLERR);
  return 0;
}

void StreamSocket::arm_for_poll(std::vector<pollfd>& wait_fds) {
  std::unique_lock lock(lock_);
  if (cq_ != nullptr && (state_ & kConnected)) {
    if (!cq_armed_) {
      ibv_req_notify_cq(cq_, 0);
      cq_armed_ = true;
    }
    wait_fds.push_back({cq_channel_->fd, POLLIN, 0});
  }
  wait_fds.push_back({fd_, POLLIN, 0});
}

}  // namespace softverbs::rs
