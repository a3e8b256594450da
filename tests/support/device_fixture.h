// What most verbs fixtures start from: softverbs0 opened, with a PD and two
// CQs; `Base` is ::testing::Test or a TestWithParam<>.
#pragma once

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include "qp_setup.h"

namespace softverbs::test {

template <typename Base>
class DeviceObjects : public Base {
 protected:
  void SetUp() override {
    context_ = open_softverbs0();
    ASSERT_NE(context_, nullptr);
    pd_ = ibv_alloc_pd(context_);
    ASSERT_NE(pd_, nullptr);
    cq_a_ = ibv_create_cq(context_, 64, nullptr, nullptr, 0);
    cq_b_ = ibv_create_cq(context_, 64, nullptr, nullptr, 0);
    ASSERT_TRUE(cq_a_ && cq_b_);
  }
  // After a derived fixture has destroyed what it made in them.
  void TearDown() override {
    for (ibv_cq* cq : {cq_a_, cq_b_})
      if (cq) {
        EXPECT_EQ(ibv_destroy_cq(cq), 0);
      }
    if (pd_) {
      EXPECT_EQ(ibv_dealloc_pd(pd_), 0);
    }
    if (context_) {
      EXPECT_EQ(ibv_close_device(context_), 0);
    }
  }

  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_a_ = nullptr;
  ibv_cq* cq_b_ = nullptr;
};

}  // namespace softverbs::test
