// Opening softverbs0 and taking QPs through INIT, RTR and RTS: what every
// test that makes its own QPs through libibverbs does, in one place.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>

namespace softverbs::test {

inline constexpr int kAllAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
// The Q_Key of the tests' UD QPs.
inline constexpr uint32_t kTestQkey = 0x11111111;

// softverbs0, opened; nullptr if there is no softverbs0.
ibv_context* open_softverbs0();

// The index of the device's RoCE v2 GID of an IPv4 address (::ffff:a.b.c.d;
// ::ffff:127.0.0.1 on lo), and that GID in `gid`; -1 if it has none.
int ipv4_gid_index(ibv_context* context, ibv_gid* gid = nullptr);

// Where an RC or UC QP's RTR points: the peer QP, the first PSN it sends,
// its GID and the local GID index to reach it by.
struct PeerPath {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  ibv_gid gid{};
  uint8_t sgid_index = 0;
  uint8_t hop_limit = 64;
};

// An RC QP's retry settings at RTS (timeout: 4.096 us x 2^timeout).
struct RcTiming {
  uint8_t timeout = 14;
  uint8_t retry_count = 7;
  uint8_t rnr_retry = 7;
};

// RESET to INIT on port 1: `access` for RC and UC, Q_Key kTestQkey for UD.
int to_init(ibv_qp* qp, ibv_qp_type type, int access);

// INIT to RTR towards `peer` (MTU 4096; RC: 4 incoming READs/atomics, RNR
// timer 10 us). A UD QP needs no peer.
int to_rtr(ibv_qp* qp, ibv_qp_type type, const PeerPath& peer);

// INIT to RTR towards QP `dest_qpn` of the same device, through its IPv4
// GID (hop limit 1, first PSN 0); ENOENT if it has no such GID.
int to_rtr(ibv_qp* qp, ibv_qp_type type, uint32_t dest_qpn);

// RTR to RTS, sending from `sq_psn` (RC: `timing`, 4 outgoing READs/atomics).
int to_rts(ibv_qp* qp, ibv_qp_type type, uint32_t sq_psn = 0, const RcTiming& timing = {});

}  // namespace softverbs::test
