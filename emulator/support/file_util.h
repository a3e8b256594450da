// Small file helpers shared by the registry, the sysfs tree and the CLI.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

namespace softverbs {

// Writes `contents` to `path` (created 0644 or truncated). False and errno on failure.
bool write_text_file(const std::filesystem::path& path, std::string_view contents);
// Whole file, or nullopt (errno set).
std::optional<std::string> read_text_file(const std::filesystem::path& path);
// First line without its newline, or nullopt.
std::optional<std::string> read_first_line(const std::filesystem::path& path);

}  // namespace softverbs
