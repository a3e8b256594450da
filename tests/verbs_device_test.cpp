// The provider inside the installed libibverbs: this binary is started by
// ctest through `softverbs run`, so it is an unmodified libibverbs program
// that finds softverbs0 the way every tool does.
#include <endian.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "device/device_limits.h"
#include "host/device_config.h"
#include "host/device_registry.h"
#include "support/file_util.h"

namespace softverbs {
namespace {

class VerbsDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    list_ = ibv_get_device_list(&count);
    ASSERT_NE(list_, nullptr) << std::strerror(errno);
    for (int i = 0; i < count; ++i)
      if (std::strcmp(ibv_get_device_name(list_[i]), "softverbs0") == 0) device_ = list_[i];
    ASSERT_NE(device_, nullptr) << "softverbs0 not listed";
    context_ = ibv_open_device(device_);
    ASSERT_NE(context_, nullptr) << std::strerror(errno);
    auto record = DeviceRegistry(default_runtime_dir()).find("softverbs0");
    ASSERT_TRUE(record) << "no registry record in " << default_runtime_dir();
    config_ = *record;
  }
  void TearDown() override {
    if (context_) {
      EXPECT_EQ(ibv_close_device(context_), 0);
    }
    if (list_) ibv_free_device_list(list_);
  }

  ibv_device** list_ = nullptr;
  ibv_device* device_ = nullptr;
  ibv_context* context_ = nullptr;
  DeviceConfig config_;
};

TEST_F(VerbsDevice, GuidAndNamesMatchTheRegistry) {
  EXPECT_EQ(be64toh(ibv_get_device_guid(device_)), config_.node_guid);
  EXPECT_EQ(std::string(device_->dev_name), config_.uverbs_name());
  EXPECT_EQ(device_->node_type, IBV_NODE_CA);
  EXPECT_EQ(device_->transport_type, IBV_TRANSPORT_IB);
}

TEST_F(VerbsDevice, LegacyQueryDevice) {
  ibv_device_attr attr;
  std::memset(&attr, 0xa5, sizeof attr);
  ASSERT_EQ(ibv_query_device(context_, &attr), 0);
  EXPECT_EQ(be64toh(attr.node_guid), config_.node_guid);
  EXPECT_EQ(attr.max_qp_wr, limits::kMaxQpWr);
  EXPECT_EQ(attr.max_sge, limits::kMaxSge);
  EXPECT_EQ(attr.max_cqe, limits::kMaxCqe);
  EXPECT_EQ(attr.atomic_cap, IBV_ATOMIC_HCA);
  EXPECT_EQ(attr.phys_port_cnt, 1);
  EXPECT_EQ(attr.max_pkeys, 1);
  EXPECT_STREQ(attr.fw_ver, limits::kFirmwareVersion);
}

TEST_F(VerbsDevice, QueryDeviceExHonoursAttrSize) {
  ibv_device_attr_ex attr;
  std::memset(&attr, 0xa5, sizeof attr);
  ASSERT_EQ(ibv_query_device_ex(context_, nullptr, &attr), 0);
  EXPECT_EQ(attr.comp_mask, 0u);
  EXPECT_EQ(attr.phys_port_cnt_ex, 1u);
  EXPECT_EQ(attr.orig_attr.max_qp, limits::kMaxQp);

  // A caller built against an older libibverbs passes the legacy size (232,
  // as perftest does): nothing past it may be written.
  struct {
    ibv_device_attr_ex attr;
    unsigned char guard[64];
  } legacy;
  std::memset(&legacy, 0x5a, sizeof legacy);
  ASSERT_EQ(sizeof(ibv_device_attr), 232u);
  verbs_context* vctx = verbs_get_ctx_op(context_, query_device_ex);
  ASSERT_NE(vctx, nullptr);
  ASSERT_EQ(vctx->query_device_ex(context_, nullptr, &legacy.attr, sizeof(ibv_device_attr)), 0);
  EXPECT_EQ(legacy.attr.orig_attr.max_qp, limits::kMaxQp);
  const unsigned char* tail = reinterpret_cast<const unsigned char*>(&legacy.attr) + sizeof(ibv_device_attr);
  for (size_t i = 0; i < sizeof legacy - sizeof(ibv_device_attr); ++i) ASSERT_EQ(tail[i], 0x5a) << "byte " << i;
  // Too small to hold even the legacy part, or an unknown input flag: EINVAL.
  EXPECT_EQ(vctx->query_device_ex(context_, nullptr, &legacy.attr, 100), EINVAL);
  ibv_query_device_ex_input input{};
  input.comp_mask = 1;
  EXPECT_EQ(vctx->query_device_ex(context_, &input, &legacy.attr, sizeof legacy.attr), EINVAL);
}

TEST_F(VerbsDevice, QueryPort) {
  ibv_port_attr port;
  ASSERT_EQ(ibv_query_port(context_, 1, &port), 0);
  EXPECT_EQ(port.state, IBV_PORT_ACTIVE);
  EXPECT_EQ(port.link_layer, IBV_LINK_LAYER_ETHERNET);
  EXPECT_EQ(port.gid_tbl_len, limits::kGidTableLength);
  EXPECT_EQ(port.pkey_tbl_len, 1);
  EXPECT_EQ(port.max_msg_sz, limits::kMaxMessageSize);
  EXPECT_EQ(port.active_mtu, IBV_MTU_4096) << "lo has a 64 KiB MTU";
  EXPECT_TRUE(port.port_cap_flags & IBV_PORT_IP_BASED_GIDS);
  EXPECT_EQ(ibv_query_port(context_, 2, &port), EINVAL);
  EXPECT_EQ(ibv_query_port(context_, 0, &port), EINVAL);
}

TEST_F(VerbsDevice, GidTableAgreesWithTheTree) {
  // ibv_query_gid reads the sysfs tree; the table must hold a RoCE v2 GID for
  // 127.0.0.1 (lo's address) and nothing beyond gid_tbl_len.
  bool found_ipv4_v2 = false;
  for (int index = 0; index < limits::kGidTableLength; ++index) {
    ibv_gid gid;
    ASSERT_EQ(ibv_query_gid(context_, 1, index, &gid), 0) << index;
    ibv_gid_entry entry;
    if (ibv_query_gid_ex(context_, 1, index, &entry, 0) != 0) continue;
    const uint8_t loopback[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1};
    if (entry.gid_type == IBV_GID_TYPE_ROCE_V2 && std::memcmp(entry.gid.raw, loopback, 16) == 0) found_ipv4_v2 = true;
  }
  EXPECT_TRUE(found_ipv4_v2);
  uint16_t pkey = 0;
  ASSERT_EQ(ibv_query_pkey(context_, 1, 0, &pkey), 0);
  EXPECT_EQ(be16toh(pkey), 0xffff);
}

TEST_F(VerbsDevice, AsyncFdIsAPollableEventSource) {
  ASSERT_GE(context_->async_fd, 0);
  EXPECT_EQ(context_->num_comp_vectors, 1);
}

TEST_F(VerbsDevice, OpenedDeviceIsListedAsUsedByThisProcess) {
  auto users = DeviceRegistry(default_runtime_dir()).users("softverbs0");
  bool listed = false;
  for (const auto& user : users) listed = listed || user.pid == getpid();
  EXPECT_TRUE(listed);
}

TEST_F(VerbsDevice, TwoContextsOnOneDevice) {
  ibv_context* second = ibv_open_device(device_);
  ASSERT_NE(second, nullptr);
  ibv_port_attr port;
  EXPECT_EQ(ibv_query_port(second, 1, &port), 0);
  EXPECT_EQ(ibv_close_device(second), 0);
  // Still a user: the first context is open.
  auto users = DeviceRegistry(default_runtime_dir()).users("softverbs0");
  EXPECT_EQ(users.size(), 1u);
}

}  // namespace
}  // namespace softverbs
