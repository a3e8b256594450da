// rsockets' datagram sockets (see rsocket_dgram.h for the protocol).
#include "rsocket_dgram.h"

#include <endian.h>
#include <netinet/in.h>
#include <rdma/rsocket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace softverbs::rs {

namespace {

constexpr uint32_t kSlotSize = 2048;  // rdma-core's RS_SNDLOWAT: one datagram with its header
constexpr uint32_t kQpMaxSize = 0xFFFE;
constexpr uint32_t kGrhSize = sizeof(ibv_grh);
constexpr uint64_t kRecvFlag = uint64_t{1} << 63;
constexpr int kResolveTimeoutMs = 2000;
constexpr uint64_t kSpinMicroseconds = 10;  // rdma-core's polling_time

int fail(int error) {
  errno = error;
  return -1;
}

uint64_t now_us() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000 + static_cast<uint64_t>(ts.tv_nsec) / 1000;
}

socklen_t length_of(const sockaddr_storage& addr) {
  return addr.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

// rdma-core's ds_compare_addr: the whole sockaddr_in(6), port included.
bool same_address(const sockaddr_storage& a, const sockaddr_storage& b) {
  const size_t length = a.ss_family == AF_INET6 && b.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  return std::memcmp(&a, &b, length) == 0;
}

bool copy_in(sockaddr_storage& to, const sockaddr* from, socklen_t len) {
  if (from == nullptr) return false;
  const socklen_t needed = from->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  if ((from->sa_family != AF_INET && from->sa_family != AF_INET6) || len < needed) return false;
  to = {};
  std::memcpy(&to, from, needed);
  return true;
}

// rdma-core's rs_any_addr: addresses that name no one interface.
bool names_no_interface(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET) {
    const uint32_t ip = reinterpret_cast<const sockaddr_in&>(addr).sin_addr.s_addr;
    return ip == htonl(INADDR_ANY) || ip == htonl(INADDR_LOOPBACK);
  }
  const in6_addr& ip = reinterpret_cast<const sockaddr_in6&>(addr).sin6_addr;
  return std::memcmp(&ip, &in6addr_any, 16) == 0 || std::memcmp(&ip, &in6addr_loopback, 16) == 0;
}

void format_header(DsHeader& header, const sockaddr_storage& addr) {
  header = {};
  if (addr.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(addr);
    header.version = 4;
    header.length = kDsIpv4HeaderLength;
    header.port = in.sin_port;
    header.addr.ipv4 = in.sin_addr.s_addr;
  } else {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(addr);
    header.version = 6;
    header.length = kDsIpv6HeaderLength;
    header.port = in6.sin6_port;
    header.addr.ipv6.flowinfo = in6.sin6_flowinfo;
    std::memcpy(header.addr.ipv6.addr, &in6.sin6_addr, 16);
  }
}

sockaddr_storage source_of(const DsHeader& header) {
  sockaddr_storage addr{};
  if (header.version == 4) {
    auto& in = reinterpret_cast<sockaddr_in&>(addr);
    in.sin_family = AF_INET;
    in.sin_port = header.port;
    in.sin_addr.s_addr = header.addr.ipv4;
  } else {
    auto& in6 = reinterpret_cast<sockaddr_in6&>(addr);
    in6.sin6_family = AF_INET6;
    in6.sin6_port = header.port;
    in6.sin6_flowinfo = header.addr.ipv6.flowinfo;
    std::memcpy(&in6.sin6_addr, header.addr.ipv6.addr, 16);
  }
  return addr;
}

bool valid_header(const DsHeader& header, uint32_t length) {
  return length >= kDsIpv4HeaderLength &&
         ((header.version == 4 && header.length == kDsIpv4HeaderLength) ||
          (header.version == 6 && header.length == kDsIpv6HeaderLength && length >= kDsIpv6HeaderLength));
}

bool valid_udp_header(const DsUdpHeader& header, int family) {
  return be32toh(header.tag) == kDsUdpTag &&
         ((header.version == 4 && family == AF_INET && header.length == kDsUdpIpv4HeaderLength) ||
          (header.version == 6 && family == AF_INET6 && header.length == kDsUdpIpv6HeaderLength));
}

// A RoCE v2 entry of the port's GID table holding `gid` (rdma_cm's route
// names GIDs, an address handle wants an index).
uint8_t gid_index_of(ibv_context* context, uint8_t port, const ibv_gid& gid) {
  ibv_port_attr attr{};
  if (ibv_query_port(context, port, &attr) != 0) return 0;
  int first_match = -1;
  for (int i = 0; i < attr.gid_tbl_len; ++i) {
    ibv_gid_entry entry{};
    if (ibv_query_gid_ex(context, port, static_cast<uint32_t>(i), &entry, 0) != 0 ||
        std::memcmp(&entry.gid, &gid, sizeof gid) != 0)
      continue;
    if (entry.gid_type == IBV_GID_TYPE_ROCE_V2) return static_cast<uint8_t>(i);
    if (first_match < 0) first_match = i;
  }
  return static_cast<uint8_t>(std::max(first_match, 0));
}

}  // namespace

// One UD QP, bound to one local address (the socket's UDP port on it), with
// its own CQ and receive buffer.
struct DgramSocket::LocalQp {
  rdma_cm_id* id = nullptr;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* cq = nullptr;
  bool cq_armed = false;
  ibv_mr* smr = nullptr;
  ibv_mr* rmr = nullptr;
  AlignedBuffer rbuf;  // rq slots of kSlotSize, then one GRH landing area
  sockaddr_storage address{};
  DsHeader header{};
  uint32_t max_payload = 0;  // what one datagram may carry from this QP

  ~LocalQp() {
    if (id != nullptr && id->qp != nullptr) rdma_destroy_qp(id);
    if (smr != nullptr) ibv_dereg_mr(smr);
    if (rmr != nullptr) ibv_dereg_mr(rmr);
    if (cq != nullptr) ibv_destroy_cq(cq);
    if (channel != nullptr) ibv_destroy_comp_channel(channel);
    if (id != nullptr) rdma_destroy_id(id);
  }
};

struct DgramSocket::Dest {
  sockaddr_storage address{};
  LocalQp* qp = nullptr;  // the QP of the local address facing it
  ibv_ah* ah = nullptr;   // null until its QPN is known
  uint32_t qpn = 0;

  ~Dest() {
    if (ah != nullptr) ibv_destroy_ah(ah);
  }
};

std::shared_ptr<DgramSocket> DgramSocket::create(int domain, bool nonblocking, bool cloexec) {
  std::shared_ptr<DgramSocket> s(new DgramSocket);
  s->domain_ = domain;
  const Defaults& d = defaults();
  s->sq_size_ = d.sq_size;
  s->rq_size_ = d.rq_size;
  s->sq_inline_ = d.sq_inline;
  s->sbuf_size_ = d.sbuf_size;
  s->rbuf_size_ = d.rbuf_size;
  s->fs_flags_ = nonblocking ? O_NONBLOCK : 0;
  s->fd_flags_ = cloexec ? FD_CLOEXEC : 0;
  // Never blocks itself: waits go through poll() with the CQs' channels.
  s->udp_fd_ = ::socket(domain, SOCK_DGRAM | SOCK_NONBLOCK | (cloexec ? SOCK_CLOEXEC : 0), 0);
  if (s->udp_fd_ < 0) return nullptr;
  return s;
}

DgramSocket::~DgramSocket() {
  dests_.clear();  // their address handles before the QPs' PDs go
  qps_.clear();
  if (udp_fd_ >= 0) ::close(udp_fd_);
}

// rdma-core's ds_set_qp_size and ds_init_ep: a slot of kSlotSize per
// queue entry, the buffers following the queues or the queues the buffers.
int DgramSocket::init_endpoint() {
  if (initialized_) return 0;
  sq_size_ = std::clamp<uint32_t>(sq_size_, 1, kQpMaxSize);
  rq_size_ = std::clamp<uint32_t>(rq_size_, 1, kQpMaxSize);
  if (rq_size_ > rbuf_size_ / kSlotSize) rq_size_ = std::max<uint32_t>(1, rbuf_size_ / kSlotSize);
  rbuf_size_ = rq_size_ * kSlotSize;
  if (sq_size_ > sbuf_size_ / kSlotSize) sq_size_ = std::max<uint32_t>(1, sbuf_size_ / kSlotSize);
  sbuf_size_ = sq_size_ * kSlotSize;
  sbuf_ = allocate_pages(sbuf_size_);
  if (sbuf_ == nullptr) return fail(ENOMEM);
  free_slots_.clear();
  for (uint32_t i = sq_size_; i-- > 0;) free_slots_.push_back(i * kSlotSize);
  initialized_ = true;
  return 0;
}

// rdma-core's ds_get_src_addr: the UDP socket's address, or when that names
// no interface, the one the kernel routes `dest` from (with our port).
int DgramSocket::source_for(const sockaddr_storage& dest, sockaddr_storage& source) {
  socklen_t len = sizeof source;
  source = {};
  if (::getsockname(udp_fd_, reinterpret_cast<sockaddr*>(&source), &len) != 0) return -1;
  if (!names_no_interface(source)) return 0;
  const uint16_t port = reinterpret_cast<sockaddr_in&>(source).sin_port;  // same offset in sockaddr_in6
  const int probe = ::socket(dest.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (probe < 0) return -1;
  int result = ::connect(probe, reinterpret_cast<const sockaddr*>(&dest), length_of(dest));
  if (result == 0) {
    len = sizeof source;
    result = ::getsockname(probe, reinterpret_cast<sockaddr*>(&source), &len);
    reinterpret_cast<sockaddr_in&>(source).sin_port = port;
  }
  const int saved = errno;
  ::close(probe);
  errno = saved;
  return result;
}

DgramSocket::LocalQp* DgramSocket::qp_for(const sockaddr_storage& source) {
  for (auto& qp : qps_)
    if (same_address(qp->address, source)) return qp.get();
  auto qp = create_qp(source);
  if (qp == nullptr) return nullptr;
  qps_.push_back(std::move(qp));
  return qps_.back().get();
}

std::unique_ptr<DgramSocket::LocalQp> DgramSocket::create_qp(const sockaddr_storage& source) {
  auto qp = std::make_unique<LocalQp>();
  qp->address = source;
  format_header(qp->header, source);
  if (rdma_create_id(nullptr, &qp->id, this, RDMA_PS_UDP) != 0) return nullptr;
  if (rdma_bind_addr(qp->id, reinterpret_cast<sockaddr*>(&qp->address)) != 0) return nullptr;
  ibv_context* context = qp->id->verbs;
  if (context == nullptr) return fail(ENODEV), nullptr;
  qp->channel = ibv_create_comp_channel(context);
  if (qp->channel == nullptr) return nullptr;
  ::fcntl(qp->channel->fd, F_SETFL, ::fcntl(qp->channel->fd, F_GETFL) | O_NONBLOCK);
  qp->cq = ibv_create_cq(context, static_cast<int>(sq_size_ + rq_size_), qp.get(), qp->channel, 0);
  if (qp->cq == nullptr) return nullptr;

  ibv_qp_init_attr attr{};
  attr.qp_context = qp.get();
  attr.send_cq = qp->cq;
  attr.recv_cq = qp->cq;
  attr.qp_type = IBV_QPT_UD;
  attr.sq_sig_all = 1;
  attr.cap.max_send_wr = sq_size_;
  attr.cap.max_recv_wr = rq_size_;
  attr.cap.max_send_sge = 1;
  attr.cap.max_recv_sge = 2;
  attr.cap.max_inline_data = sq_inline_;
  if (rdma_create_qp(qp->id, nullptr, &attr) != 0) return nullptr;
  sq_inline_ = attr.cap.max_inline_data;

  // A UD datagram is one packet: the path MTU bounds it, and so does the
  // peer's receive slot (kSlotSize, header included).
  ibv_port_attr port{};
  if (ibv_query_port(context, qp->id->port_num ? qp->id->port_num : 1, &port) != 0) return nullptr;
  const uint32_t mtu = 1u << (7 + port.active_mtu);
  qp->max_payload = std::min(mtu, kSlotSize) - qp->header.length;

  qp->smr = ibv_reg_mr(qp->id->pd, sbuf_.get(), sbuf_size_, IBV_ACCESS_LOCAL_WRITE);
  qp->rbuf = allocate_pages(rbuf_size_ + kGrhSize);
  if (qp->smr == nullptr || qp->rbuf == nullptr) return nullptr;
  qp->rmr = ibv_reg_mr(qp->id->pd, qp->rbuf.get(), rbuf_size_ + kGrhSize, IBV_ACCESS_LOCAL_WRITE);
  if (qp->rmr == nullptr) return nullptr;
  for (uint32_t i = 0; i < rq_size_; ++i)
    if (post_recv(*qp, i * kSlotSize) != 0) return nullptr;
  // Armed from the start, as rdma-core: the first datagram raises an event
  // for a caller already asleep in poll().
  ibv_req_notify_cq(qp->cq, 0);
  qp->cq_armed = true;
  return qp;
}

int DgramSocket::post_recv(LocalQp& qp, uint32_t offset) {
  ibv_sge sge[2];
  sge[0] = {reinterpret_cast<uintptr_t>(qp.rbuf.get()) + rbuf_size_, kGrhSize, qp.rmr->lkey};
  sge[1] = {reinterpret_cast<uintptr_t>(qp.rbuf.get()) + offset, kSlotSize, qp.rmr->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = kRecvFlag | offset;
  wr.sg_list = sge;
  wr.num_sge = 2;
  ibv_recv_wr* bad = nullptr;
  const int error = ibv_post_recv(qp.id->qp, &wr, &bad);
  return error == 0 ? 0 : fail(error);
}

// rdma-core's ds_get_dest: the destination's entry, with the QP of the
// local address that faces it.
DgramSocket::Dest* DgramSocket::dest_for(const sockaddr* addr, socklen_t len) {
  sockaddr_storage wanted;
  if (!copy_in(wanted, addr, len)) return fail(EINVAL), nullptr;
  if (wanted.ss_family != domain_) return fail(EAFNOSUPPORT), nullptr;
  for (auto& dest : dests_)
    if (same_address(dest->address, wanted)) return dest.get();
  sockaddr_storage source;
  if (source_for(wanted, source) != 0) return nullptr;
  LocalQp* qp = qp_for(source);
  if (qp == nullptr) return nullptr;
  auto dest = std::make_unique<Dest>();
  dest->address = wanted;
  dest->qp = qp;
  dests_.push_back(std::move(dest));
  return dests_.back().get();
}

// rdma-core's udp_svc_create_ah: the rdma_cm's route from our QP's address
// to the peer gives the address handle.
void DgramSocket::resolve_dest(Dest& dest, uint32_t qpn) {
  if (dest.ah != nullptr) {
    ibv_destroy_ah(dest.ah);
    dest.ah = nullptr;
  }
  rdma_cm_id* id = nullptr;
  if (rdma_create_id(nullptr, &id, nullptr, RDMA_PS_UDP) != 0) return;
  sockaddr_storage source = dest.qp->address;
  reinterpret_cast<sockaddr_in&>(source).sin_port = 0;
  if (rdma_resolve_addr(id, reinterpret_cast<sockaddr*>(&source), reinterpret_cast<sockaddr*>(&dest.address),
                        kResolveTimeoutMs) == 0 &&
      rdma_resolve_route(id, kResolveTimeoutMs) == 0 && id->route.num_paths > 0) {
    const ibv_sa_path_rec& path = *id->route.path_rec;
    ibv_ah_attr attr{};
    if (path.hop_limit > 1) {
      attr.is_global = 1;
      attr.grh.dgid = path.dgid;
      attr.grh.flow_label = be32toh(path.flow_label);
      attr.grh.sgid_index = gid_index_of(dest.qp->id->verbs, id->port_num, path.sgid);
      attr.grh.hop_limit = path.hop_limit;
      attr.grh.traffic_class = path.traffic_class;
    }
    attr.dlid = be16toh(path.dlid);
    attr.sl = path.sl;
    attr.static_rate = path.rate;
    attr.port_num = id->port_num;
    dest.ah = ibv_create_ah(dest.qp->id->pd, &attr);
    dest.qpn = qpn;
  }
  rdma_destroy_id(id);
}

// rdma-core's ds_sendv_udp: the header, then the datagram, to dest's UDP
// socket. The result counts the caller's bytes only.
ssize_t DgramSocket::send_udp(const Dest& dest, const iovec* iov, int iovcnt, uint8_t op) {
  constexpr int kMaxIov = 8;
  if (iovcnt > kMaxIov) return fail(ENOTSUP);
  DsUdpHeader header{};
  header.tag = htobe32(kDsUdpTag);
  header.version = dest.qp->header.version;
  header.op = op;
  header.qpn = htobe32(dest.qp->id->qp->qp_num & 0xFFFFFF);
  if (header.version == 4) {
    header.length = kDsUdpIpv4HeaderLength;
    header.addr.ipv4 = dest.qp->header.addr.ipv4;
  } else {
    header.length = kDsUdpIpv6HeaderLength;
    std::memcpy(header.addr.ipv6, dest.qp->header.addr.ipv6.addr, 16);
  }
  iovec parts[kMaxIov + 1];
  parts[0] = {&header, header.length};
  for (int i = 0; i < iovcnt; ++i) parts[i + 1] = iov[i];
  msghdr msg{};
  msg.msg_name = const_cast<sockaddr_storage*>(&dest.address);
  msg.msg_namelen = length_of(dest.address);
  msg.msg_iov = parts;
  msg.msg_iovlen = static_cast<size_t>(iovcnt) + 1;
  const ssize_t sent = ::sendmsg(udp_fd_, &msg, MSG_DONTWAIT);
  return sent > 0 ? sent - header.length : sent;
}

int DgramSocket::bind(const sockaddr* addr, socklen_t len) {
  std::lock_guard guard(lock_);
  if (init_endpoint() != 0) return -1;
  return ::bind(udp_fd_, addr, len);
}

int DgramSocket::connect(const sockaddr* addr, socklen_t len) {
  std::lock_guard guard(lock_);
  if (init_endpoint() != 0) return -1;
  if (::connect(udp_fd_, addr, len) != 0) return -1;
  Dest* dest = dest_for(addr, len);
  if (dest == nullptr) return -1;
  connected_ = dest;
  return 0;
}

ssize_t DgramSocket::sendv(const iovec* iov, int iovcnt, int flags, const sockaddr* to, socklen_t tolen) {
  std::unique_lock lock(lock_);
  if (iovcnt < 0 || (iovcnt > 0 && iov == nullptr)) return fail(EINVAL);
  if (init_endpoint() != 0) return -1;
  size_t length = 0;
  for (int i = 0; i < iovcnt; ++i) length += iov[i].iov_len;
  Dest* dest = connected_;
  if (to != nullptr) {
    // As a kernel UDP socket: a first send without bind picks a port, which
    // the datagram header must carry for the peer to answer.
    sockaddr_storage own{};
    socklen_t own_len = sizeof own;
    if (::getsockname(udp_fd_, reinterpret_cast<sockaddr*>(&own), &own_len) == 0 &&
        reinterpret_cast<sockaddr_in&>(own).sin_port == 0) {
      sockaddr_storage any{};
      any.ss_family = static_cast<sa_family_t>(domain_);
      if (::bind(udp_fd_, reinterpret_cast<sockaddr*>(&any), length_of(any)) != 0) return -1;
    }
    dest = dest_for(to, tolen);
    if (dest == nullptr) return -1;
  }
  if (dest == nullptr) return fail(EDESTADDRREQ);
  // One datagram is one UD packet: what does not fit is refused whole, as a
  // UDP socket refuses what exceeds its maximum.
  if (length > dest->qp->max_payload) return fail(EMSGSIZE);
  if (dest->ah != nullptr && !can_send() && wait_for(nonblocking(flags), &DgramSocket::can_send, lock) != 0) return -1;
  if (dest->ah == nullptr) {
    // Its QPN is not known yet (or its handle could not be made): over
    // UDP, and see whether the answer came.
    const ssize_t sent = send_udp(*dest, iov, iovcnt, static_cast<uint8_t>(Op::Data));
    read_udp();
    return sent;
  }
  const uint32_t offset = free_slots_.back();
  free_slots_.pop_back();
  uint8_t* slot = sbuf_.get() + offset;
  std::memcpy(slot, &dest->qp->header, dest->qp->header.length);
  size_t at = dest->qp->header.length;
  for (int i = 0; i < iovcnt; ++i) {
    std::memcpy(slot + at, iov[i].iov_base, iov[i].iov_len);
    at += iov[i].iov_len;
  }
  ibv_sge sge{reinterpret_cast<uintptr_t>(slot), static_cast<uint32_t>(at), dest->qp->smr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = offset;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = at <= sq_inline_ ? IBV_SEND_INLINE : 0;
  wr.wr.ud.ah = dest->ah;
  wr.wr.ud.remote_qpn = dest->qpn;
  wr.wr.ud.remote_qkey = RDMA_UDP_QKEY;
  ibv_send_wr* bad = nullptr;
  if (int error = ibv_post_send(dest->qp->id->qp, &wr, &bad); error != 0) {
    free_slots_.push_back(offset);
    return fail(error);
  }
  return static_cast<ssize_t>(length);
}

ssize_t DgramSocket::recvfrom(void* buf, size_t len, int flags, sockaddr* from, socklen_t* fromlen) {
  std::unique_lock lock(lock_);
  if (!initialized_) return fail(EINVAL);  // as rdma-core: not bound, connected or sent from yet
  if (!have_data() && wait_for(nonblocking(flags), &DgramSocket::have_data, lock) != 0) return -1;
  Datagram& datagram = received_.front();
  // As a UDP socket: what does not fit the buffer is cut off.
  const size_t length = std::min(len, datagram.bytes.size());
  if (length != 0) std::memcpy(buf, datagram.bytes.data(), length);
  if (from != nullptr && fromlen != nullptr) {
    const socklen_t size = length_of(datagram.from);
    std::memcpy(from, &datagram.from, std::min(*fromlen, size));
    *fromlen = size;
  }
  if (!(flags & MSG_PEEK)) received_.pop_front();
  return static_cast<ssize_t>(length);
}

void DgramSocket::progress() {
  if (!initialized_) return;
  read_udp();
  poll_cqs();
}

// rdma-core's udp_svc_process_rs, for every message waiting on the socket.
void DgramSocket::read_udp() {
  uint8_t buffer[kSlotSize];
  for (;;) {
    sockaddr_storage from{};
    socklen_t from_len = sizeof from;
    // MSG_TRUNC: the real length, so that a longer message is dropped whole.
    const ssize_t got = ::recvfrom(udp_fd_, buffer, sizeof buffer, MSG_DONTWAIT | MSG_TRUNC,
                                   reinterpret_cast<sockaddr*>(&from), &from_len);
    if (got < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
      continue;  // an ICMP error reported on the socket: nothing to read
    }
    if (static_cast<size_t>(got) > sizeof buffer || got < kDsUdpIpv4HeaderLength) continue;
    DsUdpHeader header;
    std::memcpy(&header, buffer, std::min<size_t>(sizeof header, static_cast<size_t>(got)));
    if (!valid_udp_header(header, from.ss_family) || got < header.length) continue;
    const uint32_t qpn = be32toh(header.qpn) & 0xFFFFFF;
    Dest* dest = dest_for(reinterpret_cast<sockaddr*>(&from), from_len);
    if (dest == nullptr) continue;
    // Data: tell the sender our QPN, so that it sends over the QP next.
    if (header.op == static_cast<uint8_t>(Op::Data)) send_udp(*dest, nullptr, 0, static_cast<uint8_t>(Op::Ctrl));
    if (dest->ah == nullptr || dest->qpn != qpn) resolve_dest(*dest, qpn);
    if (header.op == static_cast<uint8_t>(Op::Data) && received_.size() < rq_size_)
      received_.push_back({from, std::vector<uint8_t>(buffer + header.length, buffer + got)});
  }
}

// rdma-core's ds_poll_cqs: datagrams that find the receive queue full are
// dropped, as a full UDP socket buffer drops them.
void DgramSocket::poll_cqs() {
  for (auto& qp : qps_) {
    ibv_wc wcs[16];
    int n;
    while ((n = ibv_poll_cq(qp->cq, 16, wcs)) > 0) {
      for (int i = 0; i < n; ++i) {
        const ibv_wc& wc = wcs[i];
        if (!(wc.wr_id & kRecvFlag)) {
          free_slots_.push_back(static_cast<uint32_t>(wc.wr_id));
          continue;
        }
        const auto offset = static_cast<uint32_t>(wc.wr_id & ~kRecvFlag);
        if (wc.status == IBV_WC_SUCCESS && wc.byte_len >= kGrhSize && received_.size() < rq_size_) {
          const uint8_t* data = qp->rbuf.get() + offset;
          const uint32_t length = wc.byte_len - kGrhSize;
          DsHeader header{};
          std::memcpy(&header, data, std::min<uint32_t>(sizeof header, length));
          if (valid_header(header, length))
            received_.push_back({source_of(header), std::vector<uint8_t>(data + header.length, data + length)});
        }
        if (wc.status != IBV_WC_WR_FLUSH_ERR) post_recv(*qp, offset);
      }
    }
  }
}

void DgramSocket::arm(std::vector<pollfd>& wait_fds) {
  if (!initialized_) return;
  wait_fds.push_back({udp_fd_, POLLIN, 0});
  for (auto& qp : qps_) {
    if (!qp->cq_armed) {
      ibv_req_notify_cq(qp->cq, 0);
      qp->cq_armed = true;
    }
    wait_fds.push_back({qp->channel->fd, POLLIN, 0});
  }
}

void DgramSocket::consume_cq_events() {
  for (auto& qp : qps_) {
    ibv_cq* cq = nullptr;
    void* context = nullptr;
    unsigned events = 0;
    while (ibv_get_cq_event(qp->channel, &cq, &context) == 0) events++;
    if (events != 0) {
      ibv_ack_cq_events(qp->cq, events);
      qp->cq_armed = false;
    }
  }
}

// rdma-core's ds_get_comp: look for a while, then sleep on the UDP socket
// and the CQs' channels together.
int DgramSocket::wait_for(bool nonblock, Test test, std::unique_lock<std::mutex>& lock) {
  const uint64_t spin_start = now_us();
  std::vector<pollfd> waits;
  for (;;) {
    progress();
    if ((this->*test)()) return 0;
    if (nonblock) return fail(EWOULDBLOCK);
    if (now_us() - spin_start <= kSpinMicroseconds) continue;
    waits.clear();
    arm(waits);
    progress();  // what completed before the arm raises no event
    if ((this->*test)()) return 0;
    if (waits.empty()) return fail(EINVAL);  // nothing could ever arrive
    lock.unlock();
    const int ready = ::poll(waits.data(), waits.size(), -1);
    const int saved = errno;
    lock.lock();
    if (ready < 0 && saved != EINTR) return fail(saved);
    consume_cq_events();
  }
}

void DgramSocket::close() {
  std::unique_lock lock(lock_);
  // As rdma-core's ds_shutdown: the sends under way finish first (UD sends
  // complete locally, so this does not wait on the peer).
  if (initialized_ && !all_sends_done()) wait_for(false, &DgramSocket::all_sends_done, lock);
}

int DgramSocket::getpeername(sockaddr* addr, socklen_t* len) { return ::getpeername(udp_fd_, addr, len); }

int DgramSocket::getsockname(sockaddr* addr, socklen_t* len) { return ::getsockname(udp_fd_, addr, len); }

// As rdma-core: every option but SOL_RDMA's reaches the UDP socket first;
// the buffer and queue sizes count until the first QP exists.
int DgramSocket::setsockopt(int level, int name, const void* value, socklen_t len) {
  std::lock_guard guard(lock_);
  if (level != SOL_RDMA && ::setsockopt(udp_fd_, level, name, value, len) != 0) return -1;
  const bool settable = qps_.empty();
  auto unsigned_value = [&]() -> uint32_t {
    uint32_t v = 0;
    std::memcpy(&v, value, std::min<size_t>(len, sizeof v));
    return v;
  };
  if (level == SOL_SOCKET) {
    if (name == SO_RCVBUF && settable) rbuf_size_ = unsigned_value() << 1;
    if (name == SO_SNDBUF && !initialized_) sbuf_size_ = std::max(unsigned_value() << 1, kSlotSize << 1);
    return 0;
  }
  if (level != SOL_RDMA) return 0;
  if (value == nullptr || len < sizeof(uint32_t)) return fail(EINVAL);
  switch (name) {
    case RDMA_SQSIZE:
      if (!initialized_) sq_size_ = std::min(unsigned_value(), kQpMaxSize);
      return 0;
    case RDMA_RQSIZE:
      if (!initialized_) rq_size_ = std::min(unsigned_value(), kQpMaxSize);
      return 0;
    case RDMA_INLINE:
      if (settable) sq_inline_ = unsigned_value();
      return 0;
    default:
      return fail(ENOTSUP);
  }
}

int DgramSocket::getsockopt(int level, int name, void* value, socklen_t* len) {
  std::lock_guard guard(lock_);
  auto put = [&](uint32_t v) {
    if (value == nullptr || len == nullptr || *len < sizeof(int)) return fail(EINVAL);
    std::memcpy(value, &v, sizeof v);
    *len = sizeof(int);
    return 0;
  };
  if (level == SOL_SOCKET && name == SO_RCVBUF) return put(rbuf_size_);
  if (level == SOL_SOCKET && name == SO_SNDBUF) return put(sbuf_size_);
  if (level == SOL_RDMA) {
    switch (name) {
      case RDMA_SQSIZE:
        return put(sq_size_);
      case RDMA_RQSIZE:
        return put(rq_size_);
      case RDMA_INLINE:
        return put(sq_inline_);
      default:
        return fail(ENOTSUP);
    }
  }
  return ::getsockopt(udp_fd_, level, name, value, len);
}

int DgramSocket::fcntl(int cmd, long arg) {
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
      return ::fcntl(udp_fd_, F_SETFD, fd_flags_);
    default:
      return fail(ENOTSUP);
  }
}

short DgramSocket::poll_events(short events) {
  std::lock_guard guard(lock_);
  progress();
  short revents = 0;
  if ((events & POLLIN) && have_data()) revents |= POLLIN;
  if ((events & POLLOUT) && (!initialized_ || can_send())) revents |= POLLOUT;
  return revents;
}

void DgramSocket::arm_for_poll(std::vector<pollfd>& wait_fds) {
  std::lock_guard guard(lock_);
  arm(wait_fds);
}

void DgramSocket::after_poll_wait() {
  std::lock_guard guard(lock_);
  consume_cq_events();
}

}  // namespace softverbs::rs
