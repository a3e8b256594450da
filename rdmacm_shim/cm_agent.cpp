#include "cm_agent.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>

#include "device/cm_routing.h"
#include "device/device_memory.h"
#include "host/device_registry.h"
#include "support/debug_log.h"
#include "support/random_bits.h"
#include "wire/roce_packet.h"

namespace softverbs::cm {

using wire::format_address;

std::unique_ptr<CmAgent> CmAgent::create(ibv_context* context, ibv_pd* pd) {
  std::unique_ptr<CmAgent> agent(new CmAgent);
  agent->context_ = context;
  agent->pd_ = pd;
  agent->next_sequence_ = static_cast<uint32_t>(random_u64());
  ibv_device_attr device{};
  if (ibv_query_device(context, &device) == 0) agent->node_guid_ = be64toh(device.node_guid);

  // Listeners are recorded in the device's memory (the provider maps the
  // same file).
  DeviceRegistry registry(default_runtime_dir());
  const auto config = registry.find(ibv_get_device_name(context->device));
  if (!config) {
    errno = ENODEV;
    return nullptr;
  }
  std::string error;
  agent->memory_ = DeviceMemory::open_shared(config->runtime_dir / (config->name + ".mem"), &error);
  if (!agent->memory_) {
    errno = ENODEV;
    return nullptr;
  }

  agent->channel_ = ibv_create_comp_channel(context);
  if (agent->channel_ == nullptr) return nullptr;
  agent->cq_ = ibv_create_cq(context, static_cast<int>(kReceives + kSends), nullptr, agent->channel_, 0);
  if (agent->cq_ == nullptr) return nullptr;
  ibv_qp_init_attr_ex attr{};
  attr.qp_type = IBV_QPT_UD;
  attr.send_cq = agent->cq_;
  attr.recv_cq = agent->cq_;
  attr.cap.max_send_wr = kSends;
  attr.cap.max_recv_wr = kReceives;
  attr.cap.max_send_sge = 1;
  attr.cap.max_recv_sge = 1;
  attr.sq_sig_all = 1;
  attr.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS;
  attr.pd = pd;
  attr.create_flags = IBV_QP_CREATE_SOURCE_QPN;
  attr.source_qpn = kGsiQpn;
  agent->qp_ = ibv_create_qp_ex(context, &attr);
  if (agent->qp_ == nullptr) return nullptr;

  ibv_qp_attr modify{};
  modify.qp_state = IBV_QPS_INIT;
  modify.pkey_index = 0;
  modify.port_num = 1;
  modify.qkey = wire::cm::kGsiQkey;
  if (ibv_modify_qp(agent->qp_, &modify, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY) != 0)
    return nullptr;
  modify = {};
  modify.qp_state = IBV_QPS_RTR;
  if (ibv_modify_qp(agent->qp_, &modify, IBV_QP_STATE) != 0) return nullptr;
  modify.qp_state = IBV_QPS_RTS;
  modify.sq_psn = 0;
  if (ibv_modify_qp(agent->qp_, &modify, IBV_QP_STATE | IBV_QP_SQ_PSN) != 0) return nullptr;

  agent->buffers_.assign((kReceives + kSends) * kSlotBytes, 0);
  agent->mr_ = ibv_reg_mr(pd, agent->buffers_.data(), agent->buffers_.size(), IBV_ACCESS_LOCAL_WRITE);
  if (agent->mr_ == nullptr) return nullptr;
  for (size_t slot = 0; slot < kReceives; ++slot)
    if (!agent->post_receive(slot)) return nullptr;
  if (ibv_req_notify_cq(agent->cq_, 0) != 0) return nullptr;
  // take() reads the channel only to re-arm it: never blocking there.
  fcntl(agent->channel_->fd, F_SETFL, fcntl(agent->channel_->fd, F_GETFL) | O_NONBLOCK);
  return agent;
}

CmAgent::~CmAgent() {
  for (auto& [key, ah] : ahs_) ibv_destroy_ah(ah);
  if (qp_) ibv_destroy_qp(qp_);
  if (mr_) ibv_dereg_mr(mr_);
  if (cq_) ibv_destroy_cq(cq_);
  if (channel_) ibv_destroy_comp_channel(channel_);
}

uint32_t CmAgent::next_local_id() { return cm_local_id(qpn(), ++next_sequence_); }

bool CmAgent::post_receive(size_t slot) {
  ibv_sge sge{reinterpret_cast<uint64_t>(buffers_.data() + slot * kSlotBytes), static_cast<uint32_t>(kSlotBytes),
              mr_->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  return ibv_post_recv(qp_, &wr, &bad) == 0;
}

std::optional<GidEntry> find_roce_v2_gid(ibv_context* context, const std::optional<Gid16>& wanted) {
  ibv_port_attr port{};
  if (context == nullptr || ibv_query_port(context, 1, &port) != 0) return std::nullopt;
  for (int index = 0; index < port.gid_tbl_len; ++index) {
    ibv_gid_entry entry;
    if (ibv_query_gid_ex(context, 1, index, &entry, 0) != 0 || entry.gid_type != IBV_GID_TYPE_ROCE_V2) continue;
    GidEntry found{static_cast<uint8_t>(index), {}};
    std::memcpy(found.gid.data(), entry.gid.raw, 16);
    if (!wanted || found.gid == *wanted) return found;
  }
  return std::nullopt;
}

std::optional<uint8_t> CmAgent::gid_index(const Gid16& gid) {
  if (auto known = gid_indexes_.find(gid); known != gid_indexes_.end()) return known->second;
  const auto found = find_roce_v2_gid(context_, gid);
  if (!found) return std::nullopt;
  gid_indexes_[gid] = found->index;
  return found->index;
}

std::optional<Gid16> CmAgent::first_gid() {
  if (const auto found = find_roce_v2_gid(context_, std::nullopt)) return found->gid;
  return std::nullopt;
}

bool CmAgent::send(const Gid16& source, const Gid16& destination, uint8_t traffic_class,
                   const std::array<uint8_t, wire::cm::kMadBytes>& mad) {
  ibv_ah*& ah = ahs_[{source, destination}];
  if (ah == nullptr) {
    const auto index = gid_index(source);
    if (!index) {
      debug_log("rdma_cm: %s is no RoCE v2 GID of %s", format_address(source).c_str(),
                ibv_get_device_name(context_->device));
      ahs_.erase({source, destination});
      return false;
    }
    ibv_ah_attr attr{};
    attr.is_global = 1;
    attr.port_num = 1;
    attr.grh.sgid_index = *index;
    attr.grh.hop_limit = 64;
    attr.grh.traffic_class = traffic_class;
    std::memcpy(attr.grh.dgid.raw, destination.data(), 16);
    ah = ibv_create_ah(pd_, &attr);
    if (ah == nullptr) {
      debug_log("rdma_cm: no address handle to %s: %s", format_address(destination).c_str(), strerror(errno));
      ahs_.erase({source, destination});
      return false;
    }
  }
  // Send completions are reaped by take(); slots are reused in turn.
  const size_t slot = kReceives + next_send_++ % kSends;
  uint8_t* bytes = buffers_.data() + slot * kSlotBytes;
  std::memcpy(bytes, mad.data(), mad.size());
  ibv_sge sge{reinterpret_cast<uint64_t>(bytes), static_cast<uint32_t>(mad.size()), mr_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.wr.ud.ah = ah;
  wr.wr.ud.remote_qpn = kGsiQpn;
  wr.wr.ud.remote_qkey = wire::cm::kGsiQkey;
  ibv_send_wr* bad = nullptr;
  const int error = ibv_post_send(qp_, &wr, &bad);
  if (error != 0) debug_log("rdma_cm: MAD send not posted: %s", strerror(error));
  return error == 0;
}

std::vector<ReceivedMad> CmAgent::take() {
  std::vector<ReceivedMad> out;
  ibv_cq* cq = nullptr;
  void* ignored = nullptr;
  // Called when the channel polled readable; asio's wait on it made it
  // non-blocking too.
  if (ibv_get_cq_event(channel_, &cq, &ignored) == 0) ibv_ack_cq_events(cq, 1);
  ibv_req_notify_cq(cq_, 0);
  ibv_wc wcs[16];
  for (;;) {
    const int n = ibv_poll_cq(cq_, 16, wcs);
    if (n <= 0) break;
    for (int i = 0; i < n; ++i) {
      const ibv_wc& wc = wcs[i];
      if (wc.wr_id >= kReceives) continue;  // a send's
      const size_t slot = wc.wr_id;
      const uint8_t* bytes = buffers_.data() + slot * kSlotBytes;
      if (wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV && (wc.wc_flags & IBV_WC_GRH) &&
          wc.byte_len == kSlotBytes) {
        ReceivedMad mad;
        // RoCE v2 over IPv4: the IPv4 header in the GRH area's last 20
        // bytes; otherwise a GRH (the IPv6 header).
        if ((bytes[20] & 0xf0) == 0x40) {
          mad.source[10] = mad.source[11] = 0xff;
          mad.destination[10] = mad.destination[11] = 0xff;
          std::memcpy(mad.source.data() + 12, bytes + 20 + 12, 4);
          std::memcpy(mad.destination.data() + 12, bytes + 20 + 16, 4);
        } else {
          std::memcpy(mad.source.data(), bytes + 8, 16);
          std::memcpy(mad.destination.data(), bytes + 24, 16);
        }
        std::memcpy(mad.bytes.data(), bytes + kGrhBytes, mad.bytes.size());
        out.push_back(mad);
      }
      post_receive(slot);
    }
  }
  return out;
}

int CmAgent::add_listener(uint64_t service_id, const CmListenOn& on) {
  return add_cm_listener(*memory_, service_id, on, qpn());
}

void CmAgent::remove_listener(uint64_t service_id, const CmListenOn& on) {
  remove_cm_listener(*memory_, service_id, on, qpn());
}

bool CmAgent::peer_alive(uint32_t id) { return cm_id_held(*memory_, id); }

void CmAgent::record_connection(const CmConnectionTable::Entry& entry) {
  if (!add_cm_connection(*memory_, entry))
    debug_log("rdma_cm: the device's connection table is full: communication ID %#x goes unrecorded",
              entry.local_comm_id);
}

void CmAgent::forget_connection(uint32_t local_comm_id) { remove_cm_connection(*memory_, qpn(), local_comm_id); }

bool CmAgent::connections_recorded() { return cm_connections_recorded(*memory_); }

std::vector<CmConnectionTable::Entry> CmAgent::due_orphan_dreqs() {
  return softverbs::due_orphan_dreqs(*memory_, std::chrono::steady_clock::now());
}

}  // namespace softverbs::cm
