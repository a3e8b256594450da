// The one source of truth for what the emulated device reports: device and
// port attributes and the GID table. Plain emulator types; the provider maps
// them onto ibv_device_attr / ibv_port_attr.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "device/on_demand_paging.h"
#include "host/device_config.h"
#include "host/gid.h"
#include "host/netdev.h"

namespace softverbs {

enum class Mtu : uint8_t { k256 = 1, k512 = 2, k1024 = 3, k2048 = 4, k4096 = 5 };
uint32_t mtu_bytes(Mtu mtu);
// The largest IB MTU whose RoCEv2 packet (IPv6 + UDP + BTH + RETH + payload +
// ICRC) fits in a netdev MTU of `netdev_mtu` bytes.
Mtu roce_mtu_for_netdev(uint32_t netdev_mtu);

enum class PortState : uint8_t { Down = 1, Init = 2, Armed = 3, Active = 4 };
enum class PortPhysicalState : uint8_t { Polling = 2, LinkUp = 5 };
enum class AtomicCapability : uint8_t { None, Hca, Global };

struct DeviceCapabilities {
  bool resize_max_wr = true;
  bool sys_image_guid = true;
  bool rc_rnr_nak_generation = true;
  bool srq_resize = true;
  bool port_active_event = true;
  bool n_notify_cq = true;
  bool xrc = true;                     // XRC domains, SRQs and QPs
  bool memory_windows = true;          // type 1
  bool memory_windows_type_2b = true;  // type 2, bound to a QP
  bool atomic_write = true;            // IBA 1.5 ATOMIC WRITE
};

struct DeviceAttributes {
  std::string firmware_version;
  uint64_t node_guid = 0;       // host byte order
  uint64_t sys_image_guid = 0;  // host byte order
  uint64_t max_mr_size = 0;
  uint64_t page_size_cap = 0;
  uint32_t vendor_id = 0;
  uint32_t vendor_part_id = 0;
  uint32_t hardware_version = 0;
  int max_qp = 0;
  int max_qp_wr = 0;
  DeviceCapabilities capabilities;
  int max_sge = 0;
  int max_sge_rd = 0;
  int max_cq = 0;
  int max_cqe = 0;
  int max_mr = 0;
  int max_pd = 0;
  int max_qp_rd_atomic = 0;
  int max_qp_init_rd_atomic = 0;
  int max_res_rd_atomic = 0;
  AtomicCapability atomic_capability = AtomicCapability::None;
  int max_ah = 0;
  int max_mw = 0;
  int max_srq = 0;
  int max_srq_wr = 0;
  int max_srq_sge = 0;
  int max_mcast_groups = 0;
  int max_mcast_qp_attach = 0;
  uint16_t max_pkeys = 0;
  uint8_t local_ca_ack_delay = 0;
  uint8_t physical_port_count = 0;
  int max_inline_data = 0;
  OdpCapabilities odp;       // on-demand paging, what each transport does with it
  uint64_t max_dm_size = 0;  // device memory (ibv_alloc_dm)
};

struct PortAttributes {
  PortState state = PortState::Down;
  PortPhysicalState physical_state = PortPhysicalState::Polling;
  Mtu max_mtu = Mtu::k4096;
  Mtu active_mtu = Mtu::k1024;
  int gid_table_length = 0;
  uint32_t max_message_size = 0;
  uint16_t pkey_table_length = 0;
  uint8_t max_vl_num = 0;
  // IB encodings of width and speed: 4X and EDR (25 Gb/s per lane), which
  // ibv_devinfo shows as a 100 Gb/s port.
  uint8_t active_width = 2;
  uint8_t active_speed = 32;
  bool link_layer_ethernet = true;
};

struct GidEntry {
  Gid gid;
  GidType type = GidType::RoceV2;
  std::string netdev;
};

DeviceAttributes device_attributes(const DeviceConfig& config);
PortAttributes port_attributes(const DeviceConfig& config);

// GIDs as rxe fills a RoCE port: the link-local default GID, then one entry per
// IP address, each as RoCE v1 then RoCE v2, capped at the table length.
std::vector<GidEntry> build_gid_table(const NetdevInfo& netdev);

}  // namespace softverbs
