/* What a requester and a responder see when an RC or UD operation fails:
 * the work-completion statuses on both sides, the QP states afterwards, what
 * reached the responder's memory, and the asynchronous events. Written
 * against plain libibverbs, so that the same binary runs on softverbs, on
 * rxe and on an HCA, and either side may be either:
 *
 *   error_semantics_probe -d DEV -g GID_INDEX [-p PORT]            (responder)
 *   error_semantics_probe -d DEV -g GID_INDEX [-p PORT] ADDRESS    (requester)
 *
 * The two exchange QP numbers over TCP (IPv4) and then run each case on a
 * fresh pair of QPs. Each side prints one line per case and exits with the
 * number of cases whose outcome differs from what the IB specification asks
 * for (what an HCA and rxe do). Without -g the first RoCE v2 GID of an IPv4
 * address is used. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "probe_control.h"

enum { kBufferBytes = 4096, kMaxWrs = 4, kQkey = 0x11111111, kWrongQkey = 0x22222222, kUdGrh = 40 };

struct options {
  const char* device;
  int gid_index;
  int port;
  const char* peer; /* NULL: the responder */
};

/* One side's QP and memory for one case. */
struct endpoint {
  struct ibv_context* context;
  struct ibv_pd* pd;
  struct ibv_cq* cq;
  struct ibv_qp* qp;
  struct ibv_mr* mr;
  struct ibv_ah* ah;
  unsigned char* buffer;
  union ibv_gid gid;
  uint32_t psn;
};

/* What one side tells the other about its endpoint. */
struct peer_info {
  uint32_t qpn, psn, rkey;
  uint64_t addr;
  union ibv_gid gid;
};

/* What the responder saw: its completions in the second after the
 * requester finished, its QP's state and its memory. */
struct responder_view {
  int completions;
  int first_status; /* -1: none */
  uint32_t first_byte_len;
  int qp_state; /* -1: destroyed before the requester posted */
  int memory_untouched;
  int memory_matches; /* the requester's pattern where the case wrote it */
  int async_event;    /* the first affiliated asynchronous event, -1: none */
};

struct probe_case;
/* Posts the requester's WRs; 0, or the errno of a post its provider refused. */
typedef int (*poster)(const struct probe_case*, struct endpoint*, const struct peer_info*);

/* What the responder is expected to see; memory_untouched and
 * memory_matches are NOT_CHECKED or 0/1. */
struct responder_expectation {
  int completions;
  int first_status; /* -1: none */
  uint32_t byte_len;
  int state; /* -1: destroyed */
  int memory_untouched;
  int memory_matches;
};

struct probe_case {
  const char* name;
  enum ibv_qp_type type;
  int responder_access;     /* the responder MR's access flags */
  int responder_receives;   /* receives it posts, each of receive_bytes */
  uint32_t receive_bytes;   /* 0: 64 */
  bool responder_goes_away; /* destroys its QP before the requester posts */
  bool no_rnr_retry;        /* the requester's rnr_retry 0, else 7 */
  uint8_t retry_cnt;        /* the requester's, 0: 7 */
  poster post;
  int requester_wrs; /* signaled WRs posted, completions to reap */
  enum ibv_wc_status requester[kMaxWrs];
  enum ibv_qp_state requester_state;
  struct responder_expectation responder;
  /* Where rxe differs from the specification (what an HCA and softverbs
   * do) when it is the responder, or the requester: its outcome, accepted
   * from rxe only. */
  enum { kRxeAgrees, kRxeResponderDiffers, kRxeRequesterDiffers } rxe;
  enum ibv_wc_status requester_if_rxe;
  struct responder_expectation responder_if_rxe;
  /* The requester's provider may refuse the WR at ibv_post_send (EINVAL),
   * as rxe's does: then nothing is sent, and both QPs stay in RTS. */
  bool may_be_refused;
  bool late_receives;       /* the responder posts its receives 200 ms after the requester's posts */
  bool responder_fails;     /* the responder moves its QP to ERR before the requester posts */
  bool requester_read_only; /* the requester's MR has no local write access */
};

/* ---- the verbs side ---- */

static int first_ipv4_roce_v2_gid(struct ibv_context* context) {
  struct ibv_port_attr port;
  if (ibv_query_port(context, 1, &port)) fail("ibv_query_port: %s", strerror(errno));
  for (int index = 0; index < port.gid_tbl_len; ++index) {
    struct ibv_gid_entry entry;
    if (ibv_query_gid_ex(context, 1, index, &entry, 0)) continue;
    static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (entry.gid_type == IBV_GID_TYPE_ROCE_V2 && memcmp(entry.gid.raw, mapped, sizeof mapped) == 0) return index;
  }
  fail("no RoCE v2 GID of an IPv4 address on the device; name one with -g");
  return -1;
}

static struct ibv_context* open_device(const char* name) {
  int count = 0;
  struct ibv_device** devices = ibv_get_device_list(&count);
  if (!devices) fail("ibv_get_device_list: %s", strerror(errno));
  struct ibv_context* context = NULL;
  for (int i = 0; i < count && !context; ++i) {
    if (!name || strcmp(ibv_get_device_name(devices[i]), name) == 0) context = ibv_open_device(devices[i]);
  }
  ibv_free_device_list(devices);
  if (!context) fail("cannot open device %s", name ? name : "(any)");
  /* Asynchronous events are drained after each case, never waited for. */
  int flags = fcntl(context->async_fd, F_GETFL);
  if (fcntl(context->async_fd, F_SETFL, flags | O_NONBLOCK)) fail("fcntl: %s", strerror(errno));
  return context;
}

static void make_endpoint(struct endpoint* e, struct ibv_context* context, int gid_index, enum ibv_qp_type type,
                          int access) {
  memset(e, 0, sizeof *e);
  e->context = context;
  e->pd = ibv_alloc_pd(context);
  e->cq = ibv_create_cq(context, 16, NULL, NULL, 0);
  if (posix_memalign((void**)&e->buffer, 4096, kBufferBytes)) fail("posix_memalign");
  memset(e->buffer, 0, kBufferBytes);
  e->mr = ibv_reg_mr(e->pd, e->buffer, kBufferBytes, access);
  if (!e->pd || !e->cq || !e->mr) fail("PD, CQ or MR: %s", strerror(errno));
  struct ibv_qp_init_attr init = {
      .send_cq = e->cq,
      .recv_cq = e->cq,
      .cap = {.max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1},
      .qp_type = type,
      .sq_sig_all = 1,
  };
  e->qp = ibv_create_qp(e->pd, &init);
  if (!e->qp) fail("ibv_create_qp: %s", strerror(errno));
  struct ibv_qp_attr attr = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1};
  int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
  if (type == IBV_QPT_UD) {
    attr.qkey = kQkey;
    mask |= IBV_QP_QKEY;
  } else {
    /* UC carries no READs or atomics. */
    attr.qp_access_flags = type == IBV_QPT_UC
                               ? IBV_ACCESS_REMOTE_WRITE
                               : IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    mask |= IBV_QP_ACCESS_FLAGS;
  }
  if (ibv_modify_qp(e->qp, &attr, mask)) fail("INIT: %s", strerror(errno));
  if (ibv_query_gid(context, 1, gid_index, &e->gid)) fail("ibv_query_gid %d: %s", gid_index, strerror(errno));
  e->psn = (uint32_t)rand() & 0xffffff;
}

static struct ibv_ah_attr path_to(const struct peer_info* peer, int gid_index) {
  struct ibv_ah_attr ah = {.is_global = 1, .port_num = 1};
  ah.grh.dgid = peer->gid;
  ah.grh.sgid_index = (uint8_t)gid_index;
  ah.grh.hop_limit = 64;
  return ah;
}

static void connect_endpoint(struct endpoint* e, const struct peer_info* peer, int gid_index,
                             const struct probe_case* c, bool requester) {
  struct ibv_qp_attr attr = {.qp_state = IBV_QPS_RTR};
  if (c->type == IBV_QPT_UD) {
    if (ibv_modify_qp(e->qp, &attr, IBV_QP_STATE)) fail("RTR: %s", strerror(errno));
    attr.qp_state = IBV_QPS_RTS;
    attr.sq_psn = e->psn;
    if (ibv_modify_qp(e->qp, &attr, IBV_QP_STATE | IBV_QP_SQ_PSN)) fail("RTS: %s", strerror(errno));
    struct ibv_ah_attr ah = path_to(peer, gid_index);
    e->ah = ibv_create_ah(e->pd, &ah);
    if (!e->ah) fail("ibv_create_ah: %s", strerror(errno));
    return;
  }
  const bool rc = c->type == IBV_QPT_RC;
  attr.path_mtu = IBV_MTU_1024;
  attr.dest_qp_num = peer->qpn;
  attr.rq_psn = peer->psn;
  attr.max_dest_rd_atomic = 4;
  attr.min_rnr_timer = 1;
  attr.ah_attr = path_to(peer, gid_index);
  int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
  if (ibv_modify_qp(e->qp, &attr, rc ? mask | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER : mask))
    fail("RTR: %s", strerror(errno));
  attr.qp_state = IBV_QPS_RTS;
  attr.sq_psn = e->psn;
  if (!rc) {
    if (ibv_modify_qp(e->qp, &attr, IBV_QP_STATE | IBV_QP_SQ_PSN)) fail("RTS: %s", strerror(errno));
    return;
  }
  attr.timeout = 14;
  attr.retry_cnt = requester && c->retry_cnt ? c->retry_cnt : 7;
  attr.rnr_retry = requester && c->no_rnr_retry ? 0 : 7;
  attr.max_rd_atomic = 4;
  if (ibv_modify_qp(e->qp, &attr,
                    IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                        IBV_QP_MAX_QP_RD_ATOMIC))
    fail("RTS: %s", strerror(errno));
}

static void destroy_endpoint(struct endpoint* e) {
  if (e->ah) ibv_destroy_ah(e->ah);
  if (e->qp) ibv_destroy_qp(e->qp);
  ibv_dereg_mr(e->mr);
  ibv_destroy_cq(e->cq);
  ibv_dealloc_pd(e->pd);
  free(e->buffer);
}

static void post_receives(struct endpoint* e, int count, uint32_t bytes) {
  for (int i = 0; i < count; ++i) {
    struct ibv_sge sge = {
        .addr = (uintptr_t)e->buffer + 1024 + (uint64_t)i * 512, .length = bytes, .lkey = e->mr->lkey};
    struct ibv_recv_wr wr = {.wr_id = (uint64_t)i, .sg_list = &sge, .num_sge = 1}, *bad;
    if (ibv_post_recv(e->qp, &wr, &bad)) fail("ibv_post_recv: %s", strerror(errno));
  }
}

/* The requester's WRs: one SGE each from its own buffer, which holds the pattern. */
static int post_one(struct endpoint* e, enum ibv_wr_opcode opcode, uint32_t offset, uint32_t length, uint64_t remote,
                    uint32_t rkey) {
  struct ibv_sge sge = {.addr = (uintptr_t)e->buffer + offset, .length = length, .lkey = e->mr->lkey};
  struct ibv_send_wr wr = {.wr_id = opcode, .sg_list = &sge, .num_sge = 1, .opcode = opcode}, *bad;
  if (opcode == IBV_WR_ATOMIC_CMP_AND_SWP || opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) {
    wr.wr.atomic.remote_addr = remote;
    wr.wr.atomic.rkey = rkey;
    wr.wr.atomic.compare_add = 0;
    wr.wr.atomic.swap = 0x0102030405060708ull;
  } else {
    wr.wr.rdma.remote_addr = remote;
    wr.wr.rdma.rkey = rkey;
  }
  if (opcode == IBV_WR_RDMA_WRITE_WITH_IMM) wr.imm_data = htonl(0x12345678);
  return ibv_post_send(e->qp, &wr, &bad);
}

static int post_ud(struct endpoint* e, const struct peer_info* peer, uint32_t offset, uint32_t length, uint32_t qkey) {
  struct ibv_sge sge = {.addr = (uintptr_t)e->buffer + offset, .length = length, .lkey = e->mr->lkey};
  struct ibv_send_wr wr = {.wr_id = qkey, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND}, *bad;
  wr.wr.ud.ah = e->ah;
  wr.wr.ud.remote_qpn = peer->qpn;
  wr.wr.ud.remote_qkey = qkey;
  return ibv_post_send(e->qp, &wr, &bad);
}

/* ---- the cases ---- */

static int write_then_send(const struct probe_case* c, struct endpoint* e, const struct peer_info* p) {
  (void)c;
  return post_one(e, IBV_WR_RDMA_WRITE, 0, 64, p->addr, p->rkey) ?: post_one(e, IBV_WR_SEND, 0, 32, 0, 0);
}
static int write_bad_rkey_then_send(const struct probe_case* c, struct endpoint* e, const struct peer_info* p) {
  (void)c;
  return post_one(e, IBV_WR_RDMA_WRITE, 0, 64, p->addr, p->rkey ^ 0x5a5a00) ?: post_one(e, IBV_WR_SEND, 0, 32, 0, 0);
}
static int write_bad_rkey(const struct probe_case* c, struct endpoint* e, const struct peer_info* p) {
  (void)c;
  return post_one(e, IBV_WR_RDMA_WRITE, 0, 64, p->addr, p->rkey ^ 0x5a5a00);
}
/* One packet, 32 bytes inside the region and 32 past its end. */
static int write_past_end(const struct probe_case* c, struct endpoint* e, const struct peer_info* p) {
  (void)c;
  return post_one(e, IBV_WR_RDMA_WRITE, 0, 64, p->addr + kBufferBytes - 32, p->rkey);
}
static int write_plain(const struct probe_case* c, struct endpoint* e, const struct peer_info* p) {
  (void)c;
  return post_one(e, IBV_WR_RDMA_WRITE, 0, 64, p->addr, p->rkey);
}
static int read_bad_rkey(const struct probe_case* c, struct endpoint* e, const struct peer_info* p) {
  (void)c;
  return post_one(e, IBV_WR_RDMA_READ, 2048, 64, p->addr, p->rkey ^ 0x5a5a00);
}
static int read_plain(const struct probe_case* c, struct endpoint* e, const struct peer_info* p) {
  (void)c;
  return post_one(e, IBV_WR_RDMA_READ, 2048, 64, p->addr, p->rkey);
}
static int read_past_end(const struct probe_case* c, struct endpoint* e, const struct peer_info* p) {
  (void)c;
  return post_one(e, IBV_WR_RDMA_READ, 2048, 64, p->addr + kBufferBytes - 32, p->rkey);
}
static int send_128(const struct probe_case* c, struct endpoint* e, const struct peer_info* p) {
  (void)c;
  (void)p;
  return post_one(e, IBV_WR_SEND, 0, 128, 0, 0);
}
static int send_bad_lkey(const struct probe_case* c, struct endpoint* e, const struct peer_info* p) {
  (void)c;
  (void)p;
  struct ibv_sge sge = {.addr = (uintptr_t)e->buffer, .length = 32, .lkey = e->mr->lkey ^ 0x5a5a00};
  struct ibv_send_wr wr = {.sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND}, *bad;
  return ibv_post_send(e->qp, &wr, &bad);
}
static int write_with_imm(const struct probe_case* c, struct endpoint* e, const struct peer_info* p) {
  (void)c;
  return post_one(e, IBV_WR_RDMA_WRITE_WITH_IMM, 0, 64, p->addr, p->rkey);
}
static int atomic_aligned(const struct probe_case* c, struct endpoint* e, const struct peer_info* p) {
  (void)c;
  return post_one(e, IBV_WR_ATOMIC_CMP_AND_SWP, 2048, 8, p->addr, p->rkey);
}
static int atomic_misaligned(const struct probe_case* c, struct endpoint* e, const struct peer_info* p) {
  (void)c;
  return post_one(e, IBV_WR_ATOMIC_CMP_AND_SWP, 2048, 8, p->addr + 4, p->rkey);
}
static int ud_wrong_then_right_qkey(const struct probe_case* c, struct endpoint* e, const struct peer_info* p) {
  (void)c;
  return post_ud(e, p, 256, 48, kWrongQkey) ?: post_ud(e, p, 0, 48, kQkey);
}

#define ACCESS_ALL \
  (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC)
#define NOT_CHECKED (-1)
#define RC_CASE .type = IBV_QPT_RC
/* The responder's side of an error it detects in a request (IBA class C):
 * it NAKs, its QP goes to ERR and its posted receive is flushed. */
#define RESPONDER_FAILS .responder = {1, IBV_WC_WR_FLUSH_ERR, 0, IBV_QPS_ERR, NOT_CHECKED, NOT_CHECKED}
#define RESPONDER_UNMOVED .responder = {0, -1, 0, IBV_QPS_RTS, NOT_CHECKED, NOT_CHECKED}

static const struct probe_case cases[] = {
    {.name = "write and send, no error",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .responder_receives = 1,
     .post = write_then_send,
     .requester_wrs = 2,
     .requester = {IBV_WC_SUCCESS, IBV_WC_SUCCESS},
     .requester_state = IBV_QPS_RTS,
     .responder = {1, IBV_WC_SUCCESS, 32, IBV_QPS_RTS, NOT_CHECKED, 1}},
    /* The requester's QP fails too: what it posted after the WRITE is flushed. */
    {.name = "write with a bad rkey",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .responder_receives = 1,
     .post = write_bad_rkey_then_send,
     .requester_wrs = 2,
     .requester = {IBV_WC_REM_ACCESS_ERR, IBV_WC_WR_FLUSH_ERR},
     .requester_state = IBV_QPS_ERR,
     .responder = {1, IBV_WC_WR_FLUSH_ERR, 0, IBV_QPS_ERR, 1, NOT_CHECKED}},
    /* The whole range is checked before a byte is placed. */
    {.name = "write past the region's end",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .responder_receives = 1,
     .post = write_past_end,
     .requester_wrs = 1,
     .requester = {IBV_WC_REM_ACCESS_ERR},
     .requester_state = IBV_QPS_ERR,
     .responder = {1, IBV_WC_WR_FLUSH_ERR, 0, IBV_QPS_ERR, 1, NOT_CHECKED}},
    {.name = "write without remote write access",
     RC_CASE,
     .responder_access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ,
     .responder_receives = 1,
     .post = write_plain,
     .requester_wrs = 1,
     .requester = {IBV_WC_REM_ACCESS_ERR},
     .requester_state = IBV_QPS_ERR,
     .responder = {1, IBV_WC_WR_FLUSH_ERR, 0, IBV_QPS_ERR, 1, NOT_CHECKED}},
    {.name = "read with a bad rkey",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .responder_receives = 1,
     .post = read_bad_rkey,
     .requester_wrs = 1,
     .requester = {IBV_WC_REM_ACCESS_ERR},
     .requester_state = IBV_QPS_ERR,
     RESPONDER_FAILS},
    {.name = "read past the region's end",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .responder_receives = 1,
     .post = read_past_end,
     .requester_wrs = 1,
     .requester = {IBV_WC_REM_ACCESS_ERR},
     .requester_state = IBV_QPS_ERR,
     RESPONDER_FAILS},
    /* rxe's responder reports this as a malformed receive WQE (an operational
     * error) rather than a length error. */
    {.name = "send longer than the receive",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .responder_receives = 1,
     .post = send_128,
     .requester_wrs = 1,
     .requester = {IBV_WC_REM_INV_REQ_ERR},
     .requester_state = IBV_QPS_ERR,
     .responder = {1, IBV_WC_LOC_LEN_ERR, 0, IBV_QPS_ERR, NOT_CHECKED, NOT_CHECKED},
     .rxe = kRxeResponderDiffers,
     .requester_if_rxe = IBV_WC_REM_OP_ERR,
     .responder_if_rxe = {1, IBV_WC_LOC_QP_OP_ERR, 0, IBV_QPS_ERR, NOT_CHECKED, NOT_CHECKED}},
    /* Receiver not ready is no error of the responder's. */
    {.name = "send with no receive, rnr_retry 0",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .no_rnr_retry = true,
     .post = send_128,
     .requester_wrs = 1,
     .requester = {IBV_WC_RNR_RETRY_EXC_ERR},
     .requester_state = IBV_QPS_ERR,
     RESPONDER_UNMOVED},
    {.name = "write with immediate and no receive, rnr_retry 0",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .no_rnr_retry = true,
     .post = write_with_imm,
     .requester_wrs = 1,
     .requester = {IBV_WC_RNR_RETRY_EXC_ERR},
     .requester_state = IBV_QPS_ERR,
     RESPONDER_UNMOVED},
    {.name = "compare and swap",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .post = atomic_aligned,
     .requester_wrs = 1,
     .requester = {IBV_WC_SUCCESS},
     .requester_state = IBV_QPS_RTS,
     RESPONDER_UNMOVED},
    /* rxe's provider refuses it at the post; softverbs's sends it, and the responder NAKs it. */
    {.name = "compare and swap, misaligned",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .responder_receives = 1,
     .post = atomic_misaligned,
     .requester_wrs = 1,
     .requester = {IBV_WC_REM_INV_REQ_ERR},
     .requester_state = IBV_QPS_ERR,
     .responder = {1, IBV_WC_WR_FLUSH_ERR, 0, IBV_QPS_ERR, 1, NOT_CHECKED},
     .may_be_refused = true},
    {.name = "compare and swap without remote atomic access",
     RC_CASE,
     .responder_access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
     .responder_receives = 1,
     .post = atomic_aligned,
     .requester_wrs = 1,
     .requester = {IBV_WC_REM_ACCESS_ERR},
     .requester_state = IBV_QPS_ERR,
     .responder = {1, IBV_WC_WR_FLUSH_ERR, 0, IBV_QPS_ERR, 1, NOT_CHECKED}},
    /* RNR NAKs (or a wait) until the receive comes; rnr_retry 7 retries forever. */
    {.name = "send before the receive is posted, rnr_retry 7",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .responder_receives = 1,
     .receive_bytes = 256,
     .late_receives = true,
     .post = send_128,
     .requester_wrs = 1,
     .requester = {IBV_WC_SUCCESS},
     .requester_state = IBV_QPS_RTS,
     .responder = {1, IBV_WC_SUCCESS, 128, IBV_QPS_RTS, NOT_CHECKED, NOT_CHECKED}},
    /* Errors the requester finds in its own WR: the responder sees nothing.
     * (rxe's requester reports a bad lkey as a local QP operation error.) */
    {.name = "send with a bad lkey",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .responder_receives = 1,
     .post = send_bad_lkey,
     .requester_wrs = 1,
     .requester = {IBV_WC_LOC_PROT_ERR},
     .requester_state = IBV_QPS_ERR,
     .responder = {0, -1, 0, IBV_QPS_RTS, NOT_CHECKED, NOT_CHECKED},
     .rxe = kRxeRequesterDiffers,
     .requester_if_rxe = IBV_WC_LOC_QP_OP_ERR,
     .responder_if_rxe = {0, -1, 0, IBV_QPS_RTS, NOT_CHECKED, NOT_CHECKED}},
    {.name = "read into a region without local write access",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .requester_read_only = true,
     .post = read_plain,
     .requester_wrs = 1,
     .requester = {IBV_WC_LOC_PROT_ERR},
     .requester_state = IBV_QPS_ERR,
     RESPONDER_UNMOVED},
    /* A QP in ERR answers nothing. */
    {.name = "send to a QP in the error state, retry_cnt 2",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .responder_receives = 1,
     .responder_fails = true,
     .retry_cnt = 2,
     .post = send_128,
     .requester_wrs = 1,
     .requester = {IBV_WC_RETRY_EXC_ERR},
     .requester_state = IBV_QPS_ERR,
     RESPONDER_FAILS},
    /* Nothing answers: the requester's retries run out. */
    {.name = "send to a destroyed QP, retry_cnt 2",
     RC_CASE,
     .responder_access = ACCESS_ALL,
     .responder_goes_away = true,
     .retry_cnt = 2,
     .post = send_128,
     .requester_wrs = 1,
     .requester = {IBV_WC_RETRY_EXC_ERR},
     .requester_state = IBV_QPS_ERR,
     .responder = {0, -1, 0, -1, NOT_CHECKED, NOT_CHECKED}},
    /* UC has no NAKs: the responder drops the message and stays in RTS. */
    {.name = "UC write with a bad rkey",
     .type = IBV_QPT_UC,
     .responder_access = ACCESS_ALL,
     .responder_receives = 1,
     .receive_bytes = 64,
     .post = write_bad_rkey,
     .requester_wrs = 1,
     .requester = {IBV_WC_SUCCESS},
     .requester_state = IBV_QPS_RTS,
     .responder = {0, -1, 0, IBV_QPS_RTS, 1, NOT_CHECKED}},
    /* A datagram with the wrong Q_Key is dropped (IBA C10-15); the next one arrives. */
    {.name = "UD send with a wrong qkey, then the right one",
     .type = IBV_QPT_UD,
     .responder_access = ACCESS_ALL,
     .responder_receives = 2,
     .receive_bytes = 64 + kUdGrh,
     .post = ud_wrong_then_right_qkey,
     .requester_wrs = 2,
     .requester = {IBV_WC_SUCCESS, IBV_WC_SUCCESS},
     .requester_state = IBV_QPS_RTS,
     .responder = {1, IBV_WC_SUCCESS, kUdGrh + 48, IBV_QPS_RTS, NOT_CHECKED, 1}},
};

static void send_info(int fd, const struct endpoint* e) {
  char gid[33];
  for (int i = 0; i < 16; ++i) snprintf(gid + 2 * i, 3, "%02x", e->gid.raw[i]);
  send_line(fd, "%u %u %u %llu %s", e->qp ? e->qp->qp_num : 0, e->psn, e->mr->rkey,
            (unsigned long long)(uintptr_t)e->buffer, gid);
}

static struct peer_info read_info(int fd) {
  char line[512], gid[33];
  struct peer_info p;
  unsigned long long addr;
  read_line(fd, line, sizeof line);
  if (sscanf(line, "%u %u %u %llu %32s", &p.qpn, &p.psn, &p.rkey, &addr, gid) != 5 || strlen(gid) != 32)
    fail("malformed endpoint from the peer: %s", line);
  p.addr = addr;
  for (int i = 0; i < 16; ++i) sscanf(gid + 2 * i, "%2hhx", &p.gid.raw[i]);
  return p;
}

/* ---- running the cases ---- */

static int qp_state(struct ibv_qp* qp) {
  struct ibv_qp_attr attr;
  struct ibv_qp_init_attr init;
  if (!qp) return -1;
  if (ibv_query_qp(qp, &attr, IBV_QP_STATE, &init)) fail("ibv_query_qp: %s", strerror(errno));
  return attr.qp_state;
}

/* The first affiliated asynchronous event of `qp` waiting on the device, -1 if none; others are acknowledged. */
static int take_async_event(struct ibv_context* context, struct ibv_qp* qp) {
  int found = -1;
  struct ibv_async_event event;
  while (ibv_get_async_event(context, &event) == 0) {
    if (found < 0 && qp && event.element.qp == qp) found = event.event_type;
    ibv_ack_async_event(&event);
  }
  return found;
}

static const char* state_name(int state) {
  switch (state) {
    case -1:
      return "destroyed";
    case IBV_QPS_RTS:
      return "RTS";
    case IBV_QPS_ERR:
      return "ERR";
    case IBV_QPS_SQE:
      return "SQE";
    default:
      return "other";
  }
}

static const char* status_name(int status) {
  return status < 0 ? "none" : ibv_wc_status_str((enum ibv_wc_status)status);
}

static const char* event_name(int event) { return event < 0 ? "none" : ibv_event_type_str((enum ibv_event_type)event); }

static void fill_pattern(unsigned char* buffer) {
  for (int i = 0; i < kBufferBytes; ++i) buffer[i] = (unsigned char)(i * 7 + 1);
}

/* The responder's half of case `c`: it reports what it saw, and prints
 * the requester's verdict. Returns 1 for a case that failed. */
static int respond(int fd, struct ibv_context* context, int gid_index, const struct probe_case* c) {
  struct endpoint e;
  make_endpoint(&e, context, gid_index, c->type, c->responder_access);
  if (!c->late_receives) post_receives(&e, c->responder_receives, c->receive_bytes ? c->receive_bytes : 64);
  struct peer_info requester = read_info(fd);
  send_info(fd, &e);
  connect_endpoint(&e, &requester, gid_index, c, false);
  if (c->responder_goes_away) {
    ibv_destroy_qp(e.qp);
    e.qp = NULL;
  }
  if (c->responder_fails) {
    struct ibv_qp_attr attr = {.qp_state = IBV_QPS_ERR};
    if (ibv_modify_qp(e.qp, &attr, IBV_QP_STATE)) fail("ERR: %s", strerror(errno));
  }
  send_line(fd, "ready");
  if (c->late_receives) {
    usleep(200 * 1000);
    post_receives(&e, c->responder_receives, c->receive_bytes ? c->receive_bytes : 64);
  }
  char line[512];
  read_line(fd, line, sizeof line); /* the requester has its completions */

  struct responder_view v = {.first_status = -1, .async_event = -1};
  for (double end = now_seconds() + 1.0; now_seconds() < end;) {
    struct ibv_wc wc;
    int n = ibv_poll_cq(e.cq, 1, &wc);
    if (n < 0) fail("ibv_poll_cq");
    if (n == 0) {
      usleep(1000);
      continue;
    }
    if (v.completions++ == 0) {
      v.first_status = wc.status;
      v.first_byte_len = wc.byte_len;
    }
  }
  v.qp_state = qp_state(e.qp);
  v.async_event = take_async_event(context, e.qp);
  unsigned char reference[kBufferBytes];
  fill_pattern(reference);
  v.memory_untouched = 1;
  for (int i = 0; i < 1024; ++i) v.memory_untouched &= e.buffer[i] == 0 && e.buffer[kBufferBytes - 1024 + i] == 0;
  /* The requester wrote its first 64 bytes at 0, or sent its first 48 (UD: after the 40-byte GRH). */
  v.memory_matches = c->type == IBV_QPT_UD ? memcmp(e.buffer + 1024 + kUdGrh, reference, 48) == 0
                                           : memcmp(e.buffer, reference, 64) == 0;
  send_line(fd, "%d %d %u %d %d %d %d", v.completions, v.first_status, v.first_byte_len, v.qp_state, v.memory_untouched,
            v.memory_matches, v.async_event);
  destroy_endpoint(&e);
  read_line(fd, line, sizeof line); /* the requester's verdict */
  printf("%s %s: responder saw %d completion(s), first %s, QP %s, async event %s\n",
         strncmp(line, "PASS", 4) ? "FAIL" : "PASS", c->name, v.completions, status_name(v.first_status),
         state_name(v.qp_state), event_name(v.async_event));
  fflush(stdout);
  return strncmp(line, "PASS", 4) != 0;
}

/* Why the responder's view `v` is not `want` ("" if it is). */
static void compare_responder(const struct responder_view* v, const struct responder_expectation* want, char* why,
                              size_t size) {
  if (v->completions != want->completions)
    appendf(why, size, "; responder %d completion(s), expected %d", v->completions, want->completions);
  else if (v->first_status != want->first_status)
    appendf(why, size, "; responder %s, expected %s", status_name(v->first_status), status_name(want->first_status));
  else if (v->first_status == IBV_WC_SUCCESS && v->first_byte_len != want->byte_len)
    appendf(why, size, "; responder byte_len %u, expected %u", v->first_byte_len, want->byte_len);
  if (v->qp_state != want->state)
    appendf(why, size, "; responder QP %s, expected %s", state_name(v->qp_state), state_name(want->state));
  if (want->memory_untouched != NOT_CHECKED && v->memory_untouched != want->memory_untouched)
    appendf(why, size, "; the responder's memory was written");
  if (want->memory_matches != NOT_CHECKED && v->memory_matches != want->memory_matches)
    appendf(why, size, "; the responder's memory does not hold what was sent");
}

/* The requester's half of case `c` (`self_is_rxe`, `peer_is_rxe`: which side is rxe);
 * returns 1 if either side's outcome differs from the expectation. */
static int request(int fd, struct ibv_context* context, int gid_index, const struct probe_case* c, bool self_is_rxe,
                   bool peer_is_rxe) {
  struct endpoint e;
  make_endpoint(&e, context, gid_index, c->type, c->requester_read_only ? 0 : ACCESS_ALL);
  fill_pattern(e.buffer);
  send_info(fd, &e);
  struct peer_info responder = read_info(fd);
  connect_endpoint(&e, &responder, gid_index, c, true);
  char line[512];
  read_line(fd, line, sizeof line); /* ready */

  /* What this side and the responder should see. */
  enum ibv_wc_status expected[kMaxWrs];
  memcpy(expected, c->requester, sizeof expected);
  int expected_wrs = c->requester_wrs;
  enum ibv_qp_state expected_state = c->requester_state;
  struct responder_expectation want = c->responder;
  const char* note = "";
  if ((c->rxe == kRxeResponderDiffers && peer_is_rxe) || (c->rxe == kRxeRequesterDiffers && self_is_rxe)) {
    expected[0] = c->requester_if_rxe;
    want = c->responder_if_rxe;
    note = " (rxe's own outcome)";
  }
  int refused = c->post(c, &e, &responder);
  if (refused && !(c->may_be_refused && refused == EINVAL)) fail("ibv_post_send: %s", strerror(refused));
  if (refused) {
    expected_wrs = 0;
    expected_state = IBV_QPS_RTS;
    want = (struct responder_expectation){0, -1, 0, IBV_QPS_RTS, NOT_CHECKED, NOT_CHECKED};
    note = " (refused at ibv_post_send: EINVAL)";
  }

  int statuses[kMaxWrs], reaped = 0;
  for (double end = now_seconds() + 20.0; reaped < expected_wrs && now_seconds() < end;) {
    struct ibv_wc wc;
    int n = ibv_poll_cq(e.cq, 1, &wc);
    if (n < 0) fail("ibv_poll_cq");
    if (n == 0) {
      usleep(100);
      continue;
    }
    statuses[reaped++] = wc.status;
  }
  int state = qp_state(e.qp);
  int event = take_async_event(context, e.qp);
  send_line(fd, "done");
  struct responder_view v;
  read_line(fd, line, sizeof line);
  if (sscanf(line, "%d %d %u %d %d %d %d", &v.completions, &v.first_status, &v.first_byte_len, &v.qp_state,
             &v.memory_untouched, &v.memory_matches, &v.async_event) != 7)
    fail("malformed report from the responder: %s", line);

  char why[1024] = "";
  for (int i = 0; i < expected_wrs; ++i) {
    if (i >= reaped)
      appendf(why, sizeof why, "; WR %d: no completion", i + 1);
    else if (statuses[i] != (int)expected[i])
      appendf(why, sizeof why, "; WR %d: %s, expected %s", i + 1, status_name(statuses[i]), status_name(expected[i]));
  }
  if (state != (int)expected_state)
    appendf(why, sizeof why, "; requester QP %s, expected %s", state_name(state), state_name(expected_state));
  compare_responder(&v, &want, why, sizeof why);
  send_line(fd, "%s", why[0] ? "FAIL" : "PASS");

  char seen[256] = "";
  for (int i = 0; i < reaped; ++i) appendf(seen, sizeof seen, "%s%s", i ? ", " : "", status_name(statuses[i]));
  printf(
      "%s %s%s: requester %s, QP %s, async event %s; responder %d completion(s), first %s, QP %s, async event %s%s\n",
      why[0] ? "FAIL" : "PASS", c->name, note, reaped ? seen : "no completion", state_name(state), event_name(event),
      v.completions, status_name(v.first_status), state_name(v.qp_state), event_name(v.async_event), why);
  fflush(stdout);
  destroy_endpoint(&e);
  return why[0] != 0;
}

static struct options parse(int argc, char** argv) {
  struct options o = {.device = NULL, .gid_index = -1, .port = 18620, .peer = NULL};
  int opt;
  while ((opt = getopt(argc, argv, "d:g:p:")) != -1) {
    switch (opt) {
      case 'd':
        o.device = optarg;
        break;
      case 'g':
        o.gid_index = atoi(optarg);
        break;
      case 'p':
        o.port = atoi(optarg);
        break;
      default:
        fprintf(stderr, "usage: %s [-d device] [-g gid index] [-p port] [requester's peer address]\n", argv[0]);
        exit(2);
    }
  }
  if (optind < argc) o.peer = argv[optind];
  return o;
}

int main(int argc, char** argv) {
  struct options o = parse(argc, argv);
  srand((unsigned)getpid());
  struct ibv_context* context = open_device(o.device);
  if (o.gid_index < 0) o.gid_index = first_ipv4_roce_v2_gid(context);
  int fd = control_connect(o.peer, o.port);
  /* Each side names its device: rxe's responder has outcomes of its own. */
  char line[512], peer_device[256] = "";
  send_line(fd, "device %s", ibv_get_device_name(context->device));
  read_line(fd, line, sizeof line);
  if (sscanf(line, "device %255s", peer_device) != 1) fail("malformed greeting from the peer: %s", line);
  const bool self_is_rxe = strncmp(ibv_get_device_name(context->device), "rxe", 3) == 0;
  const bool peer_is_rxe = strncmp(peer_device, "rxe", 3) == 0;
  int failures = 0;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i)
    failures += o.peer ? request(fd, context, o.gid_index, &cases[i], self_is_rxe, peer_is_rxe)
                       : respond(fd, context, o.gid_index, &cases[i]);
  close(fd);
  ibv_close_device(context);
  printf("%d of %zu cases as the specification asks\n", (int)(sizeof cases / sizeof cases[0]) - failures,
         sizeof cases / sizeof cases[0]);
  return failures;
}
