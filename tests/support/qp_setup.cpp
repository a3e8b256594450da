#include "qp_setup.h"

#include <cerrno>
#include <cstring>

namespace softverbs::test {

ibv_context* open_softverbs0() {
  int count = 0;
  ibv_device** list = ibv_get_device_list(&count);
  ibv_context* context = nullptr;
  for (int i = 0; list && i < count; ++i)
    if (std::strcmp(ibv_get_device_name(list[i]), "softverbs0") == 0) context = ibv_open_device(list[i]);
  if (list) ibv_free_device_list(list);
  return context;
}

int ipv4_gid_index(ibv_context* context, ibv_gid* gid) {
  for (int index = 0; index < 32; ++index) {
    ibv_gid_entry entry{};
    if (ibv_query_gid_ex(context, 1, static_cast<uint32_t>(index), &entry, 0) != 0) continue;
    static const uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (entry.gid_type == IBV_GID_TYPE_ROCE_V2 && std::memcmp(entry.gid.raw, kMapped, 12) == 0) {
      if (gid) *gid = entry.gid;
      return index;
    }
  }
  return -1;
}

int to_init(ibv_qp* qp, ibv_qp_type type, int access) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = 1;
  int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
  if (type == IBV_QPT_UD) {
    attr.qkey = kTestQkey;
    mask |= IBV_QP_QKEY;
  } else {
    attr.qp_access_flags = access;
    mask |= IBV_QP_ACCESS_FLAGS;
  }
  return ibv_modify_qp(qp, &attr, mask);
}

int to_rtr(ibv_qp* qp, ibv_qp_type type, const PeerPath& peer) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTR;
  if (type == IBV_QPT_UD) return ibv_modify_qp(qp, &attr, IBV_QP_STATE);
  attr.path_mtu = IBV_MTU_4096;
  attr.dest_qp_num = peer.qpn;
  attr.rq_psn = peer.psn;
  attr.ah_attr.port_num = 1;
  attr.ah_attr.is_global = 1;
  attr.ah_attr.grh.dgid = peer.gid;
  attr.ah_attr.grh.sgid_index = peer.sgid_index;
  attr.ah_attr.grh.hop_limit = peer.hop_limit;
  int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
  if (type == IBV_QPT_RC) {
    attr.max_dest_rd_atomic = 4;
    attr.min_rnr_timer = 1;  // 10 us
    mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  }
  return ibv_modify_qp(qp, &attr, mask);
}

int to_rtr(ibv_qp* qp, ibv_qp_type type, uint32_t dest_qpn) {
  PeerPath peer;
  peer.qpn = dest_qpn;
  peer.hop_limit = 1;
  if (type != IBV_QPT_UD) {
    const int gid_index = ipv4_gid_index(qp->context, &peer.gid);
    if (gid_index < 0) return ENOENT;
    peer.sgid_index = static_cast<uint8_t>(gid_index);
  }
  return to_rtr(qp, type, peer);
}

int to_rts(ibv_qp* qp, ibv_qp_type type, uint32_t sq_psn, const RcTiming& timing) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.sq_psn = sq_psn;
  int mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
  if (type == IBV_QPT_RC) {
    attr.timeout = timing.timeout;
    attr.retry_cnt = timing.retry_count;
    attr.rnr_retry = timing.rnr_retry;
    attr.max_rd_atomic = 4;
    mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  }
  return ibv_modify_qp(qp, &attr, mask);
}

}  // namespace softverbs::test
