/* Writes a pattern to an iSCSI LUN through libiscsi (over iSER for an
 * iser:// URL), reads it back and compares, then compares the target's
 * backing file too: both RDMA directions (the target RDMA-READs what is
 * written and RDMA-WRITEs what is read), checked byte by byte.
 *
 * usage: iser_readwrite URL INITIATOR-IQN BACKING-FILE
 * Prints "checked N bytes" and exits 0 when every byte matches. */
#include <fcntl.h>
#include <iscsi/iscsi.h>
#include <iscsi/scsi-lowlevel.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { kBlock = 512, kBlocksPerCommand = 256, kCommands = 16 };

/* Every byte depends on its command and its offset. */
static void fill(unsigned char *at, size_t bytes, unsigned command) {
  for (size_t i = 0; i < bytes; ++i) at[i] = (unsigned char)(command * 131u + i * 7u + (i >> 9));
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s URL INITIATOR-IQN BACKING-FILE\n", argv[0]);
    return 2;
  }
  struct iscsi_context *iscsi = iscsi_create_context(argv[2]);
  if (iscsi == NULL) return 3;
  struct iscsi_url *url = iscsi_parse_full_url(iscsi, argv[1]);
  if (url == NULL) {
    fprintf(stderr, "bad URL: %s\n", iscsi_get_error(iscsi));
    return 3;
  }
  iscsi_set_session_type(iscsi, ISCSI_SESSION_NORMAL);
  iscsi_set_header_digest(iscsi, ISCSI_HEADER_DIGEST_NONE_CRC32C);
  if (iscsi_full_connect_sync(iscsi, url->portal, url->lun) != 0) {
    fprintf(stderr, "login failed: %s\n", iscsi_get_error(iscsi));
    return 4;
  }
  const size_t bytes = (size_t)kBlock * kBlocksPerCommand;
  unsigned char *written = malloc(bytes), *seen = malloc(bytes);
  if (written == NULL || seen == NULL) return 5;
  for (unsigned command = 0; command < kCommands; ++command) {
    fill(written, bytes, command);
    struct scsi_task *task = iscsi_write10_sync(iscsi, url->lun, command * kBlocksPerCommand, written, (uint32_t)bytes,
                                                kBlock, 0, 0, 0, 0, 0);
    if (task == NULL || task->status != SCSI_STATUS_GOOD) {
      fprintf(stderr, "WRITE10 %u failed: %s\n", command, iscsi_get_error(iscsi));
      return 6;
    }
    scsi_free_scsi_task(task);
  }
  for (unsigned command = 0; command < kCommands; ++command) {
    struct scsi_task *task =
        iscsi_read10_sync(iscsi, url->lun, command * kBlocksPerCommand, (uint32_t)bytes, kBlock, 0, 0, 0, 0, 0);
    if (task == NULL || task->status != SCSI_STATUS_GOOD || task->datain.size != (int)bytes) {
      fprintf(stderr, "READ10 %u failed: %s\n", command, iscsi_get_error(iscsi));
      return 7;
    }
    fill(written, bytes, command);
    if (memcmp(task->datain.data, written, bytes) != 0) {
      fprintf(stderr, "READ10 %u: the data differs from what was written\n", command);
      return 8;
    }
    scsi_free_scsi_task(task);
  }
  iscsi_logout_sync(iscsi);
  iscsi_destroy_url(url);
  iscsi_destroy_context(iscsi);

  int fd = open(argv[3], O_RDONLY);
  if (fd < 0) return 9;
  for (unsigned command = 0; command < kCommands; ++command) {
    fill(written, bytes, command);
    if (pread(fd, seen, bytes, (off_t)command * (off_t)bytes) != (ssize_t)bytes || memcmp(seen, written, bytes) != 0) {
      fprintf(stderr, "the backing file differs at command %u\n", command);
      return 10;
    }
  }
  close(fd);
  free(written);
  free(seen);
  printf("checked %zu bytes\n", (size_t)kCommands * bytes);
  return 0;
}
