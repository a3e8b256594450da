// Address handles on the device's RoCE port, through the installed
// libibverbs.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>

#include "verbs_features.h"

namespace softverbs::test {
namespace {

// An address handle without a GRH on the device's Ethernet (RoCE) port is
// refused, as HCAs do; with one it is made.
TEST_F(DeviceFixture, AddressHandleOnRocePortNeedsAGrh) {
  ibv_port_attr port{};
  ASSERT_EQ(ibv_query_port(context_, 1, &port), 0);
  ASSERT_EQ(port.link_layer, IBV_LINK_LAYER_ETHERNET);
  ibv_ah_attr attr{};
  attr.port_num = 1;
  errno = 0;
  EXPECT_EQ(ibv_create_ah(pd_, &attr), nullptr);
  EXPECT_EQ(errno, EINVAL);
  attr.is_global = 1;
  const int gid_index = ipv4_gid_index(context_, &attr.grh.dgid);
  ASSERT_GE(gid_index, 0);
  attr.grh.sgid_index = static_cast<uint8_t>(gid_index);
  ibv_ah* ah = ibv_create_ah(pd_, &attr);
  ASSERT_NE(ah, nullptr) << std::strerror(errno);
  EXPECT_EQ(ibv_destroy_ah(ah), 0);
}

}  // namespace
}  // namespace softverbs::test
