#include "support/file_util.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

namespace softverbs {

bool write_text_file(const std::filesystem::path& path, std::string_view contents) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  size_t written = 0;
  while (written < contents.size()) {
    ssize_t n = write(fd, contents.data() + written, contents.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      int saved = errno;
      close(fd);
      errno = saved;
      return false;
    }
    written += static_cast<size_t>(n);
  }
  return close(fd) == 0;
}

std::optional<std::string> read_text_file(const std::filesystem::path& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string contents;
  char buffer[4096];
  for (;;) {
    ssize_t n = read(fd, buffer, sizeof buffer);
    if (n < 0) {
      if (errno == EINTR) continue;
      int saved = errno;
      close(fd);
      errno = saved;
      return std::nullopt;
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  return contents;
}

std::optional<std::string> read_first_line(const std::filesystem::path& path) {
  auto contents = read_text_file(path);
  if (!contents) return std::nullopt;
  return contents->substr(0, contents->find('\n'));
}

}  // namespace softverbs
