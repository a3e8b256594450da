// A vector with its storage inline, for the data path's short lists (SGEs,
// iovecs): no heap allocation per work request.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <span>

namespace softverbs {

template <typename T, size_t Capacity>
class SmallVector {
 public:
  SmallVector() = default;
  SmallVector(const SmallVector& other) : size_(other.size_) { std::copy_n(other.items_.data(), size_, items_.data()); }
  SmallVector& operator=(const SmallVector& other) {
    if (this == &other) return *this;  // copy_n must not copy a range onto itself
    size_ = other.size_;
    std::copy_n(other.items_.data(), size_, items_.data());
    return *this;
  }

  // False (and nothing stored) when full; callers size Capacity by the
  // device's limits, so a full list is a bug upstream, never silent loss.
  bool push_back(const T& value) {
    if (size_ == Capacity) return false;
    items_[size_++] = value;
    return true;
  }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T& operator[](size_t index) { return items_[index]; }
  const T& operator[](size_t index) const { return items_[index]; }
  T* data() { return items_.data(); }
  const T* data() const { return items_.data(); }
  T* begin() { return items_.data(); }
  T* end() { return items_.data() + size_; }
  const T* begin() const { return items_.data(); }
  const T* end() const { return items_.data() + size_; }
  operator std::span<const T>() const { return {items_.data(), size_}; }

 private:
  // Not value-initialized, and copied only as far as size_: a data-path
  // list is built per packet, and zeroing 36 iovecs (576 bytes) for the one
  // to three a packet uses cost more than using them.
  std::array<T, Capacity> items_;
  size_t size_ = 0;
};

}  // namespace softverbs
