// The responder's half of the data path: receive queues, data placement at
// the target, and completions (including completion-channel wake-ups).
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "data_path.h"

namespace softverbs {

int post_receive(DeviceMemory& memory, QpRecord& qp, uint64_t wr_id, std::span<const Sge> sges) {
  Completion flushed;
  int recv_cq = -1;
  {
    SharedLock lock(qp.lock);
    if (qp.state == QpState::Reset || qp.srq >= 0) return EINVAL;
    if (sges.size() > qp.rq.max_sge) return EINVAL;
    if (qp.state == QpState::Error) {
      flushed.wr_id = wr_id;
      flushed.status = WcStatus::WrFlushError;
      flushed.opcode = WcOpcode::Receive;
      flushed.qp_num = qp.qpn;
      recv_cq = qp.recv_cq;
    } else {
      if (qp.rq.posted - qp.rq.consumed >= qp.rq.capacity) return ENOMEM;
      RecvWqe* wqe = memory.recv_slot(qp.rq, qp.rq.posted);
      wqe->wr_id = wr_id;
      wqe->num_sge = static_cast<uint32_t>(sges.size());
      std::memcpy(DeviceMemory::sges_of(wqe), sges.data(), sges.size_bytes());
      std::atomic_thread_fence(std::memory_order_release);
      ++qp.rq.posted;
      return 0;
    }
  }
  deliver_completion(memory, recv_cq, flushed, false);
  return 0;
}

namespace {

struct ChannelTarget {
  uint64_t owner_handle = 0;
  uint32_t address_length = 0;
  char address[sizeof(CqRecord::channel_address)] = {};
};

void notify_channel(const ChannelTarget& cq) {
  // The owner reads 8 bytes (its ibv_cq pointer) from the channel fd, as
  // libibverbs' ibv_get_cq_event expects of a kernel completion channel.
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, cq.address, cq.address_length);
  uint64_t handle = cq.owner_handle;
  sendto(fd, &handle, sizeof handle, MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&address),
         static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + cq.address_length));
  close(fd);
}

}  // namespace

bool deliver_completion(DeviceMemory& memory, int cq_index, const Completion& completion, bool solicited) {
  if (cq_index < 0 || cq_index >= limits::kMaxCq) return false;
  CqRecord& cq = memory.shared().cqs[cq_index];
  bool wake = false;
  bool stored = false;
  ChannelTarget target;
  {
    SharedLock lock(cq.lock);
    if (!cq.live) return false;
    CompletionRing ring(cq.ring, std::span(memory.at<Completion>(cq.ring_offset), cq.ring.capacity));
    stored = ring.push(completion);
    bool solicited_match = solicited || completion.status != WcStatus::Success;
    if (stored && (cq.armed == CqArm::NextCompletion || (cq.armed == CqArm::SolicitedOnly && solicited_match)) &&
        cq.channel_address_length != 0) {
      cq.armed = CqArm::None;
      wake = true;
      target.owner_handle = cq.owner_handle;
      target.address_length = cq.channel_address_length;
      std::memcpy(target.address, cq.channel_address, sizeof target.address);
    }
  }
  if (wake) notify_channel(target);
  return stored;
}

void flush_receive_queue(DeviceMemory& memory, QpRecord& qp) {
  for (;;) {
    Completion flushed;
    {
      SharedLock lock(qp.lock);
      if (qp.rq.consumed == qp.rq.posted) return;
      RecvWqe* wqe = memory.recv_slot(qp.rq, qp.rq.consumed++);
      flushed.wr_id = wqe->wr_id;
      flushed.status = WcStatus::WrFlushError;
      flushed.opcode = WcOpcode::Receive;
      flushed.qp_num = qp.qpn;
    }
    deliver_completion(memory, qp.recv_cq, flushed, false);
  }
}

void discard_receive_queue(QpRecord& qp) { qp.rq.consumed = qp.rq.posted; }

uint32_t rnr_timer_microseconds(uint8_t encoded) {
  // IB spec table 45 (RNR NAK timer field), in microseconds.
  static constexpr uint32_t kTable[32] = {655360, 10,    20,    30,     40,     60,     80,     120,
                                          160,    240,   320,   480,    640,    960,    1280,   1920,
                                          2560,   3840,  5120,  7680,   10240,  15360,  20480,  30720,
                                          40960,  61440, 81920, 122880, 163840, 245760, 327680, 491520};
  return kTable[encoded & 31];
}

}  // namespace softverbs
