#include "device/device_attributes.h"

#include "device/device_limits.h"
#include "device/device_memory_allocation.h"

namespace softverbs {

uint32_t mtu_bytes(Mtu mtu) { return 128u << static_cast<uint8_t>(mtu); }

Mtu roce_mtu_for_netdev(uint32_t netdev_mtu) {
  // IPv6 40 + UDP 8 + BTH 12 + RETH 16 + ICRC 4: the largest per-packet
  // overhead of an RDMA WRITE FIRST over RoCEv2.
  constexpr uint32_t kOverhead = 80;
  if (netdev_mtu == 0) return Mtu::k1024;  // unknown netdev MTU: Ethernet's
  for (Mtu candidate : {Mtu::k4096, Mtu::k2048, Mtu::k1024, Mtu::k512}) {
    if (mtu_bytes(candidate) + kOverhead <= netdev_mtu) return candidate;
  }
  return Mtu::k256;
}

DeviceAttributes device_attributes(const DeviceConfig& config) {
  DeviceAttributes attributes;
  attributes.firmware_version = limits::kFirmwareVersion;
  attributes.node_guid = config.node_guid;
  attributes.sys_image_guid = config.node_guid;
  attributes.max_mr_size = limits::kMaxMrSize;
  attributes.max_dm_size = device_memory::kMaxBytes;
  attributes.page_size_cap = limits::kPageSizeCap;
  attributes.vendor_id = limits::kVendorId;
  attributes.vendor_part_id = limits::kVendorPartId;
  attributes.hardware_version = limits::kHardwareVersion;
  attributes.max_qp = limits::kMaxQp;
  attributes.max_qp_wr = limits::kMaxQpWr;
  attributes.max_sge = limits::kMaxSge;
  attributes.max_sge_rd = limits::kMaxSgeRd;
  attributes.max_cq = limits::kMaxCq;
  attributes.max_cqe = limits::kMaxCqe;
  attributes.max_mr = limits::kMaxMr;
  attributes.max_pd = limits::kMaxPd;
  attributes.max_qp_rd_atomic = limits::kMaxQpRdAtomic;
  attributes.max_qp_init_rd_atomic = limits::kMaxQpInitRdAtomic;
  attributes.max_res_rd_atomic = limits::kMaxResRdAtomic;
  attributes.atomic_capability = AtomicCapability::Hca;
  attributes.max_ah = limits::kMaxAh;
  attributes.max_mw = limits::kMaxMw;
  attributes.max_srq = limits::kMaxSrq;
  attributes.max_srq_wr = limits::kMaxSrqWr;
  attributes.max_srq_sge = limits::kMaxSrqSge;
  attributes.max_mcast_groups = limits::kMaxMcastGroups;
  attributes.max_mcast_qp_attach = limits::kMaxMcastQpAttach;
  attributes.max_pkeys = limits::kMaxPkeys;
  attributes.local_ca_ack_delay = limits::kLocalCaAckDelay;
  attributes.physical_port_count = limits::kPhysPortCount;
  attributes.max_inline_data = limits::kMaxInlineData;
  return attributes;
}

PortAttributes port_attributes(const DeviceConfig& config) {
  PortAttributes attributes;
  attributes.state = PortState::Active;
  attributes.physical_state = PortPhysicalState::LinkUp;
  attributes.max_mtu = Mtu::k4096;
  attributes.active_mtu = roce_mtu_for_netdev(config.netdev_mtu);
  attributes.gid_table_length = limits::kGidTableLength;
  attributes.max_message_size = limits::kMaxMessageSize;
  attributes.pkey_table_length = limits::kPkeyTableLength;
  attributes.max_vl_num = limits::kMaxVlNum;
  attributes.link_layer_ethernet = true;
  return attributes;
}

std::vector<GidEntry> build_gid_table(const NetdevInfo& netdev) {
  std::vector<GidEntry> table;
  auto add_pair = [&](const Gid& gid) {
    for (GidType type : {GidType::RoceV1, GidType::RoceV2}) {
      if (table.size() < static_cast<size_t>(limits::kGidTableLength)) table.push_back({gid, type, netdev.name});
    }
  };
  add_pair(Gid::link_local_from_mac(netdev.mac));
  for (const auto& address : netdev.ipv4_addresses) add_pair(Gid::from_ipv4(address));
  for (const auto& address : netdev.ipv6_addresses) {
    Gid gid = Gid::from_ipv6(address);
    // The link-local address derived from the MAC is already the default GID.
    if (gid == table.front().gid) continue;
    add_pair(gid);
  }
  return table;
}

}  // namespace softverbs
