/* What both ends of an rdma_cm connection see when it is refused, rejected,
 * accepted and ended, including by a process that exits: the event types,
 * their status, private data and negotiated values. Written against plain
 * librdmacm, so that the same binary runs on softverbs' shim, on the
 * kernel's rdma_cm and on an HCA, and either side may be either:
 *
 *   cm_semantics_probe -b LOCAL_ADDRESS [-p PORT]                 (passive)
 *   cm_semantics_probe -b LOCAL_ADDRESS [-p PORT] PEER_ADDRESS    (active)
 *
 * The two agree each case over TCP (PORT, to the same address), and each
 * case listens or connects on rdma_cm port PORT + 1 + its index. Each side
 * prints one line per case and exits with the number of cases in which what
 * it saw differs from what the kernel's rdma_cm gives. */
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/wait.h>

#include "probe_control.h"

enum {
  kEventWaitSeconds = 15,
  kRejectNoListener = 8, /* IB_CM_REJ_INVALID_SERVICE_ID */
  kRejectConsumer = 28,  /* IB_CM_REJ_CONSUMER_DEFINED */
  kReqPrivateData = 56,  /* a REQ's 92 bytes less rdma_cm's 36-byte header */
  kRepPrivateData = 196,
  kRejPrivateData = 148,
  kUdpQkey = 0x01234567, /* RDMA_UDP_QKEY */
};

static const char kHello[] = "hello from the active side";
static const char kWelcome[] = "welcome";
static const char kNoThanks[] = "no thanks";

struct options {
  const char* local;
  const char* peer; /* NULL: the passive side */
  int port;
};

/* What one rdma_cm event said, copied before it is acknowledged. */
struct seen_event {
  enum rdma_cm_event_type type; /* -1: none came */
  int status;
  struct rdma_cm_id* id;
  struct rdma_cm_id* listen_id;
  uint8_t private_data[256];
  uint8_t private_data_len;
  uint8_t initiator_depth, responder_resources;
  uint32_t ud_qp_num, ud_qkey;
};

static const char* event_name(int type) { return type < 0 ? "no event" : rdma_event_str(type); }

/* The next event on `channel`, or type -1 after `seconds`. */
static struct seen_event next_event(struct rdma_event_channel* channel, double seconds) {
  struct seen_event seen = {.type = (enum rdma_cm_event_type) - 1};
  struct pollfd pfd = {.fd = channel->fd, .events = POLLIN};
  if (poll(&pfd, 1, (int)(seconds * 1000)) <= 0) return seen;
  struct rdma_cm_event* event;
  if (rdma_get_cm_event(channel, &event)) fail("rdma_get_cm_event: %s", strerror(errno));
  seen.type = event->event;
  seen.status = event->status;
  seen.id = event->id;
  seen.listen_id = event->listen_id;
  if (event->id && event->id->ps == RDMA_PS_UDP &&
      (event->event == RDMA_CM_EVENT_ESTABLISHED || event->event == RDMA_CM_EVENT_UNREACHABLE ||
       event->event == RDMA_CM_EVENT_CONNECT_REQUEST)) {
    seen.private_data_len = event->param.ud.private_data_len;
    if (event->param.ud.private_data)
      memcpy(seen.private_data, event->param.ud.private_data, event->param.ud.private_data_len);
    seen.ud_qp_num = event->param.ud.qp_num;
    seen.ud_qkey = event->param.ud.qkey;
  } else {
    seen.private_data_len = event->param.conn.private_data_len;
    if (event->param.conn.private_data)
      memcpy(seen.private_data, event->param.conn.private_data, event->param.conn.private_data_len);
    seen.initiator_depth = event->param.conn.initiator_depth;
    seen.responder_resources = event->param.conn.responder_resources;
  }
  rdma_ack_cm_event(event);
  return seen;
}

static void expect_event(char* why, size_t size, const struct seen_event* seen, enum rdma_cm_event_type type,
                         int status) {
  if ((int)seen->type != (int)type)
    appendf(why, size, "; %s, expected %s", event_name(seen->type), event_name(type));
  else if (seen->status != status)
    appendf(why, size, "; %s with status %d, expected %d", event_name(type), seen->status, status);
}

static void expect_private_data(char* why, size_t size, const struct seen_event* seen, const char* text, int length) {
  if (seen->type < 0) return;
  if (seen->private_data_len != length)
    appendf(why, size, "; %s private_data_len %d, expected %d", event_name(seen->type), seen->private_data_len, length);
  else if (memcmp(seen->private_data, text, strlen(text) + 1) != 0)
    appendf(why, size, "; %s private data differs", event_name(seen->type));
}

static struct sockaddr_storage address_of(const char* text, int port) {
  struct addrinfo hints = {.ai_flags = AI_NUMERICHOST}, *found;
  if (getaddrinfo(text, NULL, &hints, &found)) fail("not a numeric address: %s", text);
  struct sockaddr_storage address;
  memset(&address, 0, sizeof address);
  memcpy(&address, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  if (address.ss_family == AF_INET)
    ((struct sockaddr_in*)&address)->sin_port = htons((uint16_t)port);
  else
    ((struct sockaddr_in6*)&address)->sin6_port = htons((uint16_t)port);
  return address;
}

static void create_qp(struct rdma_cm_id* id, bool ud) {
  struct ibv_qp_init_attr init = {
      .cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
      .qp_type = ud ? IBV_QPT_UD : IBV_QPT_RC,
  };
  if (rdma_create_qp(id, NULL, &init)) fail("rdma_create_qp: %s", strerror(errno));
}

static void destroy(struct rdma_cm_id* id) {
  if (!id) return;
  if (id->qp) rdma_destroy_qp(id);
  rdma_destroy_id(id);
}

/* ---- the cases ---- */

enum ending {
  kRefused,              /* nobody listens */
  kRejected,             /* the passive side rejects, with private data */
  kPassiveDisconnects,   /* accepted with private data, then rdma_disconnect on the passive side */
  kActiveDisconnects,    /* ... on the active side */
  kActiveDestroysId,     /* the active side destroys its connected id */
  kActiveProcessExits,   /* the active side's process exits while connected */
  kActiveProcessKilled,  /* ... is killed */
  kPassiveProcessExits,  /* the passive side's process exits while connected */
  kPassiveProcessKilled, /* ... is killed */
  kUdRefused,            /* RDMA_PS_UDP: nobody listens */
  kUdRejected,           /* RDMA_PS_UDP: the passive side rejects */
  kUdAccepted,           /* RDMA_PS_UDP: the passive side accepts, naming its QP and Q_Key */
};

struct cm_case {
  const char* key; /* for -c */
  const char* name;
  enum ending ending;
};

static const struct cm_case cases[] = {
    {"refused", "connect where nobody listens", kRefused},
    {"rejected", "rejected with private data", kRejected},
    {"passive-disconnects", "accepted, then the passive side disconnects", kPassiveDisconnects},
    {"active-disconnects", "accepted, then the active side disconnects", kActiveDisconnects},
    {"active-destroys", "accepted, then the active side destroys its id", kActiveDestroysId},
    {"active-exits", "accepted, then the active side's process exits", kActiveProcessExits},
    {"active-killed", "accepted, then the active side's process is killed", kActiveProcessKilled},
    {"passive-exits", "accepted, then the passive side's process exits", kPassiveProcessExits},
    {"passive-killed", "accepted, then the passive side's process is killed", kPassiveProcessKilled},
    {"ud-refused", "UD: resolve where nobody listens", kUdRefused},
    {"ud-rejected", "UD: rejected", kUdRejected},
    {"ud-accepted", "UD: accepted", kUdAccepted},
};

static bool is_ud(const struct cm_case* c) { return c->ending >= kUdRefused; }
static bool active_child(const struct cm_case* c) {
  return c->ending == kActiveProcessExits || c->ending == kActiveProcessKilled;
}
static bool passive_child(const struct cm_case* c) {
  return c->ending == kPassiveProcessExits || c->ending == kPassiveProcessKilled;
}

/* The end of a child that connected (`ok`) or failed to: it tells its
 * parent on `report`, then exits without a word to rdma_cm, or is killed. */
static void end_child(bool ok, bool killed, int report) {
  if (write(report, ok ? "1" : "0", 1) != 1) _exit(1);
  if (killed) kill(getpid(), SIGKILL);
  exit(0);
}

/* Whether the child `pid` connected, as it said on `report` before it ended. */
static bool child_connected(pid_t pid, int report) {
  char said = '0';
  if (read(report, &said, 1) != 1) said = '0';
  close(report);
  int status;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return said == '1';
}

/* The passive side's connection: listen, take the request and check it,
 * then reject or accept. Returns the connected id (NULL if rejected). */
static struct rdma_cm_id* take_request(const struct cm_case* c, struct rdma_event_channel* channel,
                                       struct rdma_cm_id* listener, char* why, size_t size) {
  (void)listener;
  struct seen_event request = next_event(channel, kEventWaitSeconds);
  expect_event(why, size, &request, RDMA_CM_EVENT_CONNECT_REQUEST, 0);
  if ((int)request.type != RDMA_CM_EVENT_CONNECT_REQUEST) return NULL;
  struct rdma_cm_id* id = request.id;
  if (is_ud(c)) {
    /* SIDR_REQ: the whole 216 bytes less rdma_cm's header. */
    if (memcmp(request.private_data, kHello, sizeof kHello) != 0)
      appendf(why, size, "; the request's private data differs");
  } else {
    expect_private_data(why, size, &request, kHello, kReqPrivateData);
    /* The active side's responder resources are this side's initiator depth. */
    if (request.initiator_depth != 2 || request.responder_resources != 3)
      appendf(why, size, "; request's initiator_depth %d and responder_resources %d, expected 2 and 3",
              request.initiator_depth, request.responder_resources);
  }
  if (c->ending == kRejected || c->ending == kUdRejected) {
    if (rdma_reject(id, kNoThanks, sizeof kNoThanks)) fail("rdma_reject: %s", strerror(errno));
    rdma_destroy_id(id);
    return NULL;
  }
  create_qp(id, is_ud(c));
  struct rdma_conn_param accept = {
      .private_data = kWelcome, .private_data_len = sizeof kWelcome, .responder_resources = 1, .initiator_depth = 1};
  if (is_ud(c)) accept.qp_num = id->qp->qp_num;
  if (rdma_accept(id, &accept)) fail("rdma_accept: %s", strerror(errno));
  if (!is_ud(c)) {
    struct seen_event established = next_event(channel, kEventWaitSeconds);
    expect_event(why, size, &established, RDMA_CM_EVENT_ESTABLISHED, 0);
  }
  return id;
}

static void passive_listen(const struct options* o, int cm_port, bool ud, struct rdma_event_channel** channel,
                           struct rdma_cm_id** listener) {
  *channel = rdma_create_event_channel();
  if (!*channel || rdma_create_id(*channel, listener, NULL, ud ? RDMA_PS_UDP : RDMA_PS_TCP))
    fail("rdma_create_id: %s", strerror(errno));
  struct sockaddr_storage address = address_of(o->local, cm_port);
  if (rdma_bind_addr(*listener, (struct sockaddr*)&address) || rdma_listen(*listener, 4))
    fail("rdma_bind_addr/rdma_listen on %s port %d: %s", o->local, cm_port, strerror(errno));
}

/* The passive side of case `c`; returns 1 if what it saw differs. */
static int passive(int fd, const struct options* o, const struct cm_case* c, int cm_port) {
  char why[1024] = "", line[512];
  struct rdma_event_channel* channel = NULL;
  struct rdma_cm_id* listener = NULL;
  struct rdma_cm_id* id = NULL;
  const bool listens = c->ending != kRefused && c->ending != kUdRefused && !passive_child(c);
  if (listens) passive_listen(o, cm_port, is_ud(c), &channel, &listener);
  if (passive_child(c)) {
    /* A child listens and accepts, and ends once connected. */
    int report[2];
    if (pipe(report)) fail("pipe: %s", strerror(errno));
    pid_t child = fork();
    if (child == 0) {
      passive_listen(o, cm_port, false, &channel, &listener);
      send_line(fd, "ready");
      id = take_request(c, channel, listener, why, sizeof why);
      read_line(fd, line, sizeof line); /* the active side is connected */
      end_child(why[0] == 0, c->ending == kPassiveProcessKilled, report[1]);
    }
    close(report[1]);
    if (!child_connected(child, report[0])) appendf(why, sizeof why, "; the child failed to connect");
    send_line(fd, "gone");
  } else {
    send_line(fd, "ready");
  }
  if (listens) id = take_request(c, channel, listener, why, sizeof why);
  switch (c->ending) {
    case kPassiveDisconnects: {
      read_line(fd, line, sizeof line); /* the active side is connected */
      if (id && rdma_disconnect(id)) fail("rdma_disconnect: %s", strerror(errno));
      struct seen_event disconnected = next_event(channel, kEventWaitSeconds);
      expect_event(why, sizeof why, &disconnected, RDMA_CM_EVENT_DISCONNECTED, 0);
      break;
    }
    case kActiveDisconnects:
    case kActiveDestroysId:
    case kActiveProcessExits:
    case kActiveProcessKilled: {
      struct seen_event disconnected = next_event(channel, kEventWaitSeconds);
      expect_event(why, sizeof why, &disconnected, RDMA_CM_EVENT_DISCONNECTED, 0);
      break;
    }
    default:
      break;
  }
  if (is_ud(c) && id) send_line(fd, "qp %u", id->qp->qp_num);
  read_line(fd, line, sizeof line); /* the active side is done */
  destroy(id);
  destroy(listener);
  if (channel) rdma_destroy_event_channel(channel);
  printf("%s %s (passive side)%s\n", why[0] ? "FAIL" : "PASS", c->name, why);
  fflush(stdout);
  return why[0] != 0;
}

/* The active side's connection: resolve, connect with private data, and
 * the event that ends the attempt. */
static struct seen_event connect_to(const struct options* o, const struct cm_case* c, int cm_port,
                                    struct rdma_event_channel** channel, struct rdma_cm_id** id, char* why,
                                    size_t size) {
  *channel = rdma_create_event_channel();
  if (!*channel || rdma_create_id(*channel, id, NULL, is_ud(c) ? RDMA_PS_UDP : RDMA_PS_TCP))
    fail("rdma_create_id: %s", strerror(errno));
  struct sockaddr_storage local = address_of(o->local, 0), remote = address_of(o->peer, cm_port);
  if (rdma_resolve_addr(*id, (struct sockaddr*)&local, (struct sockaddr*)&remote, 5000))
    fail("rdma_resolve_addr: %s", strerror(errno));
  struct seen_event step = next_event(*channel, kEventWaitSeconds);
  expect_event(why, size, &step, RDMA_CM_EVENT_ADDR_RESOLVED, 0);
  if (rdma_resolve_route(*id, 5000)) fail("rdma_resolve_route: %s", strerror(errno));
  step = next_event(*channel, kEventWaitSeconds);
  expect_event(why, size, &step, RDMA_CM_EVENT_ROUTE_RESOLVED, 0);
  create_qp(*id, is_ud(c));
  struct rdma_conn_param param = {.private_data = kHello,
                                  .private_data_len = sizeof kHello,
                                  .responder_resources = 2,
                                  .initiator_depth = 3,
                                  .retry_count = 7,
                                  .rnr_retry_count = 7};
  if (rdma_connect(*id, &param)) fail("rdma_connect: %s", strerror(errno));
  return next_event(*channel, kEventWaitSeconds * 2);
}

/* The active side of case `c`; returns 1 if what it saw differs. */
static int active(int fd, const struct options* o, const struct cm_case* c, int cm_port) {
  char why[1024] = "", line[512];
  struct rdma_event_channel* channel = NULL;
  struct rdma_cm_id* id = NULL;
  read_line(fd, line, sizeof line); /* ready */
  if (active_child(c)) {
    int report[2];
    if (pipe(report)) fail("pipe: %s", strerror(errno));
    pid_t child = fork();
    if (child == 0) {
      struct seen_event outcome = connect_to(o, c, cm_port, &channel, &id, why, sizeof why);
      expect_event(why, sizeof why, &outcome, RDMA_CM_EVENT_ESTABLISHED, 0);
      end_child(why[0] == 0, c->ending == kActiveProcessKilled, report[1]);
    }
    close(report[1]);
    if (!child_connected(child, report[0])) appendf(why, sizeof why, "; the child failed to connect");
  } else {
    struct seen_event outcome = connect_to(o, c, cm_port, &channel, &id, why, sizeof why);
    switch (c->ending) {
      case kRefused:
        expect_event(why, sizeof why, &outcome, RDMA_CM_EVENT_REJECTED, kRejectNoListener);
        break;
      case kRejected:
        expect_event(why, sizeof why, &outcome, RDMA_CM_EVENT_REJECTED, kRejectConsumer);
        expect_private_data(why, sizeof why, &outcome, kNoThanks, kRejPrivateData);
        break;
      case kUdRefused:
      case kUdRejected:
        expect_event(why, sizeof why, &outcome, RDMA_CM_EVENT_UNREACHABLE, c->ending == kUdRefused ? 1 : 2);
        break;
      case kUdAccepted: {
        expect_event(why, sizeof why, &outcome, RDMA_CM_EVENT_ESTABLISHED, 0);
        unsigned qpn = 0;
        read_line(fd, line, sizeof line);
        if (sscanf(line, "qp %u", &qpn) != 1) fail("malformed QP number: %s", line);
        if (outcome.ud_qp_num != qpn || outcome.ud_qkey != kUdpQkey)
          appendf(why, sizeof why, "; QP %#x and Q_Key %#x, expected %#x and %#x", outcome.ud_qp_num, outcome.ud_qkey,
                  qpn, kUdpQkey);
        break;
      }
      default: {
        expect_event(why, sizeof why, &outcome, RDMA_CM_EVENT_ESTABLISHED, 0);
        expect_private_data(why, sizeof why, &outcome, kWelcome, kRepPrivateData);
        if (c->ending == kPassiveDisconnects) send_line(fd, "connected");
        if (passive_child(c)) {
          send_line(fd, "connected");
          read_line(fd, line, sizeof line); /* gone */
        }
        if (c->ending == kActiveDisconnects && rdma_disconnect(id)) fail("rdma_disconnect: %s", strerror(errno));
        if (c->ending == kActiveDestroysId) {
          destroy(id);
          id = NULL;
          break;
        }
        struct seen_event disconnected = next_event(channel, kEventWaitSeconds);
        expect_event(why, sizeof why, &disconnected, RDMA_CM_EVENT_DISCONNECTED, 0);
      }
    }
  }
  send_line(fd, "done");
  destroy(id);
  if (channel) rdma_destroy_event_channel(channel);
  printf("%s %s (active side)%s\n", why[0] ? "FAIL" : "PASS", c->name, why);
  fflush(stdout);
  return why[0] != 0;
}

/* Whether the comma-separated `list` holds `key`. */
static bool lists(const char* list, const char* key) {
  const size_t length = strlen(key);
  for (const char* at = list; (at = strstr(at, key)) != NULL; at += length)
    if ((at == list || at[-1] == ',') && (at[length] == ',' || at[length] == 0)) return true;
  return false;
}

int main(int argc, char** argv) {
  struct options o = {.local = NULL, .peer = NULL, .port = 18630};
  const char* only = NULL; /* -c: the keys of the cases to run, comma-separated; all without */
  int opt;
  while ((opt = getopt(argc, argv, "b:c:p:")) != -1) {
    if (opt == 'b')
      o.local = optarg;
    else if (opt == 'c')
      only = optarg;
    else if (opt == 'p')
      o.port = atoi(optarg);
    else {
      fprintf(stderr, "usage: %s -b local-address [-c case-key,...] [-p port] [passive side's address]\n", argv[0]);
      return 2;
    }
  }
  if (!o.local) fail("-b local-address is needed");
  if (optind < argc) o.peer = argv[optind];
  int fd = control_connect(o.peer, o.port);
  int count = 0, failures = 0;
  for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); ++i) {
    if (only && !lists(only, cases[i].key)) continue;
    ++count;
    failures += o.peer ? active(fd, &o, &cases[i], o.port + 1 + i) : passive(fd, &o, &cases[i], o.port + 1 + i);
  }
  close(fd);
  printf("%d of %d cases as the kernel's rdma_cm gives them\n", count - failures, count);
  return failures;
}
