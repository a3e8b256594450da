/* What the two processes of a probe (error_semantics_probe,
 * cm_semantics_probe) share: a TCP connection on which they agree each case
 * and exchange what they saw, one line at a time. */
#ifndef SOFTVERBS_TESTS_PROBE_CONTROL_H
#define SOFTVERBS_TESTS_PROBE_CONTROL_H

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

extern char* program_invocation_short_name;

static inline void fail(const char* format, ...) {
  va_list args;
  va_start(args, format);
  fprintf(stderr, "%s: ", program_invocation_short_name);
  vfprintf(stderr, format, args);
  fprintf(stderr, "\n");
  va_end(args);
  exit(100);
}

/* The passive side (`peer` NULL) accepts one connection on `port`, over
 * IPv4 or IPv6; the active side connects to `peer`, retrying for 30 s while
 * the other starts. */
static inline int control_connect(const char* peer, int port) {
  char service[16];
  snprintf(service, sizeof service, "%d", port);
  struct addrinfo hints = {
      .ai_family = peer ? AF_UNSPEC : AF_INET6, .ai_socktype = SOCK_STREAM, .ai_flags = peer ? 0 : AI_PASSIVE};
  struct addrinfo* found;
  int rc = getaddrinfo(peer, service, &hints, &found);
  if (rc) fail("%s: %s", peer ? peer : "listen", gai_strerror(rc));
  int fd = socket(found->ai_family, SOCK_STREAM, 0);
  if (peer) {
    for (int attempt = 0; connect(fd, found->ai_addr, found->ai_addrlen); ++attempt) {
      if (attempt == 300) fail("couldn't connect to %s:%d: %s", peer, port, strerror(errno));
      usleep(100 * 1000);
    }
  } else {
    int one = 1, zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero); /* IPv4 peers too */
    if (bind(fd, found->ai_addr, found->ai_addrlen) || listen(fd, 1)) fail("listen on %d: %s", port, strerror(errno));
    int accepted = accept(fd, NULL, NULL);
    if (accepted < 0) fail("accept: %s", strerror(errno));
    close(fd);
    fd = accepted;
  }
  freeaddrinfo(found);
  return fd;
}

static inline void send_line(int fd, const char* format, ...) {
  char line[512];
  va_list args;
  va_start(args, format);
  int n = vsnprintf(line, sizeof line - 1, format, args);
  va_end(args);
  if (n < 0 || n > (int)sizeof line - 2) fail("control line too long");
  line[n++] = '\n';
  for (int sent = 0; sent < n;) {
    ssize_t w = write(fd, line + sent, (size_t)(n - sent));
    if (w <= 0) fail("control connection: %s", w ? strerror(errno) : "closed");
    sent += (int)w;
  }
}

static inline void read_line(int fd, char* line, size_t size) {
  size_t n = 0;
  for (;;) {
    char ch;
    ssize_t r = read(fd, &ch, 1);
    if (r <= 0) fail("control connection: %s", r ? strerror(errno) : "closed by the peer");
    if (ch == '\n') break;
    if (n + 1 < size) line[n++] = ch;
  }
  line[n] = 0;
}

static inline double now_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static inline void appendf(char* out, size_t size, const char* format, ...) {
  size_t used = strlen(out);
  va_list args;
  va_start(args, format);
  vsnprintf(out + used, size - used, format, args);
  va_end(args);
}

#endif
