// query_device(_ex) and query_port: translations of the emulator's attributes.
#include <endian.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "device/device_clock.h"
#include "provider_context.h"

namespace softverbs::provider {

namespace {

unsigned capability_flags(const DeviceCapabilities& caps) {
  unsigned flags = 0;
  if (caps.resize_max_wr) flags |= IBV_DEVICE_RESIZE_MAX_WR;
  if (caps.sys_image_guid) flags |= IBV_DEVICE_SYS_IMAGE_GUID;
  if (caps.rc_rnr_nak_generation) flags |= IBV_DEVICE_RC_RNR_NAK_GEN;
  if (caps.srq_resize) flags |= IBV_DEVICE_SRQ_RESIZE;
  if (caps.port_active_event) flags |= IBV_DEVICE_PORT_ACTIVE_EVENT;
  if (caps.n_notify_cq) flags |= IBV_DEVICE_N_NOTIFY_CQ;
  if (caps.xrc) flags |= IBV_DEVICE_XRC;
  if (caps.memory_windows) flags |= IBV_DEVICE_MEM_WINDOW;
  if (caps.memory_windows_type_2b) flags |= IBV_DEVICE_MEM_WINDOW_TYPE_2B;
  return flags;
}

ibv_atomic_cap atomic_cap(AtomicCapability capability) {
  switch (capability) {
    case AtomicCapability::Hca:
      return IBV_ATOMIC_HCA;
    case AtomicCapability::Global:
      return IBV_ATOMIC_GLOB;
    case AtomicCapability::None:
      break;
  }
  return IBV_ATOMIC_NONE;
}

}  // namespace

void fill_device_attr(const DeviceAttributes& a, ibv_device_attr_ex& out) {
  out = {};
  ibv_device_attr& d = out.orig_attr;
  std::strncpy(d.fw_ver, a.firmware_version.c_str(), sizeof d.fw_ver - 1);
  d.node_guid = htobe64(a.node_guid);
  d.sys_image_guid = htobe64(a.sys_image_guid);
  d.max_mr_size = a.max_mr_size;
  d.page_size_cap = a.page_size_cap;
  d.vendor_id = a.vendor_id;
  d.vendor_part_id = a.vendor_part_id;
  d.hw_ver = a.hardware_version;
  d.max_qp = a.max_qp;
  d.max_qp_wr = a.max_qp_wr;
  d.device_cap_flags = capability_flags(a.capabilities);
  // The extended flags hold the same bits and those above 32, as the
  // kernel fills them; ATOMIC WRITE's (IB_UVERBS_DEVICE_ATOMIC_WRITE) has
  // no name in rdma-core 44's verbs.h.
  constexpr uint64_t kDeviceAtomicWrite = uint64_t{1} << 40;
  out.device_cap_flags_ex = d.device_cap_flags | (a.capabilities.atomic_write ? kDeviceAtomicWrite : 0);
  d.max_sge = a.max_sge;
  d.max_sge_rd = a.max_sge_rd;
  d.max_cq = a.max_cq;
  d.max_cqe = a.max_cqe;
  d.max_mr = a.max_mr;
  d.max_pd = a.max_pd;
  d.max_qp_rd_atom = a.max_qp_rd_atomic;
  d.max_res_rd_atom = a.max_res_rd_atomic;
  d.max_qp_init_rd_atom = a.max_qp_init_rd_atomic;
  d.atomic_cap = atomic_cap(a.atomic_capability);
  d.max_mw = a.max_mw;
  d.max_mcast_grp = a.max_mcast_groups;
  d.max_mcast_qp_attach = a.max_mcast_qp_attach;
  d.max_total_mcast_qp_attach = a.max_mcast_groups * a.max_mcast_qp_attach;
  d.max_ah = a.max_ah;
  d.max_srq = a.max_srq;
  d.max_srq_wr = a.max_srq_wr;
  d.max_srq_sge = a.max_srq_sge;
  d.max_pkeys = a.max_pkeys;
  d.local_ca_ack_delay = a.local_ca_ack_delay;
  d.phys_port_cnt = a.physical_port_count;
  out.phys_port_cnt_ex = a.physical_port_count;
  out.odp_caps.general_caps = a.odp.general;
  out.odp_caps.per_transport_caps.rc_odp_caps = a.odp.rc;
  out.odp_caps.per_transport_caps.uc_odp_caps = a.odp.uc;
  out.odp_caps.per_transport_caps.ud_odp_caps = a.odp.ud;
  out.xrc_odp_caps = a.odp.xrc;
  out.max_dm_size = a.max_dm_size;
  out.hca_core_clock = kDeviceClockKhz;
  out.completion_timestamp_mask = kCompletionTimestampMask;
}

void fill_port_attr(const PortAttributes& a, ibv_port_attr& out) {
  out = {};
  out.state = static_cast<ibv_port_state>(a.state);
  out.max_mtu = static_cast<ibv_mtu>(a.max_mtu);
  out.active_mtu = static_cast<ibv_mtu>(a.active_mtu);
  out.gid_tbl_len = a.gid_table_length;
  out.port_cap_flags = IBV_PORT_CM_SUP | IBV_PORT_IP_BASED_GIDS;
  out.max_msg_sz = a.max_message_size;
  out.pkey_tbl_len = a.pkey_table_length;
  out.max_vl_num = a.max_vl_num;
  out.active_width = a.active_width;
  out.active_speed = a.active_speed;
  out.phys_state = static_cast<uint8_t>(a.physical_state);
  out.link_layer = a.link_layer_ethernet ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_INFINIBAND;
}

int query_device_ex(ibv_context* context, const ibv_query_device_ex_input* input, ibv_device_attr_ex* attr,
                    size_t attr_size) {
  // ibv_query_device passes the legacy size (sizeof(ibv_device_attr), 232);
  // newer callers may pass a larger struct than ours: fill what we know.
  if (attr == nullptr || attr_size < sizeof(ibv_device_attr)) return EINVAL;
  if (input != nullptr && input->comp_mask != 0) return EINVAL;
  ibv_device_attr_ex full;
  fill_device_attr(to_provider(context)->state->device, full);
  size_t known = std::min(attr_size, sizeof full);
  std::memcpy(attr, &full, known);
  if (attr_size > known) std::memset(reinterpret_cast<char*>(attr) + known, 0, attr_size - known);
  return 0;
}

int query_rt_values(ibv_context*, ibv_values_ex* values) {
  if (values == nullptr) return EINVAL;
  // As HCAs answer: the values asked for that the device has, the mask
  // saying which they were.
  uint32_t answered = 0;
  if (values->comp_mask & IBV_VALUES_MASK_RAW_CLOCK) {
    const uint64_t now = device_clock_ns();
    values->raw_clock.tv_sec = static_cast<time_t>(now / 1'000'000'000u);
    values->raw_clock.tv_nsec = static_cast<long>(now % 1'000'000'000u);
    answered |= IBV_VALUES_MASK_RAW_CLOCK;
  }
  values->comp_mask = answered;
  return 0;
}

int query_port(ibv_context* context, uint8_t port_num, ibv_port_attr* attr) {
  const ContextState& state = *to_provider(context)->state;
  if (attr == nullptr || port_num < 1 || port_num > state.device.physical_port_count) return EINVAL;
  fill_port_attr(state.port, *attr);
  return 0;
}

}  // namespace softverbs::provider
