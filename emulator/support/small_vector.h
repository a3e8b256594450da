// A vector with its storage inline, for the data path's short lists (SGEs,
// iovecs): no heap allocation per work request.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <span>
#include <type_traits>

namespace softverbs {

// Room for `Capacity` elements, left uninitialized: a std::array (or a plain
// array) of a type with default member initializers, such as Sge,
// RemoteRange or Completion, runs them for every element, and on the data
// path that zeroing cost more than the work (ReceivePlacement's two lists
// zeroed 1.3 KiB for each shared-memory WRITE, ~18% of its execute_send in
// ib_write_lat; poll_cq's batch of 16 Completions ~80% of poll_cq). The
// elements are trivially copyable and destructible: an element's life
// starts when it is written as a whole (construct_at, a copy).
template <typename T, size_t Capacity>
union UninitializedArray {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>);
  UninitializedArray() {}
  T* data() { return items; }
  const T* data() const { return items; }
  static constexpr size_t size() { return Capacity; }
  T items[Capacity];
};

template <typename T, size_t Capacity>
class SmallVector {
 public:
  SmallVector() = default;
  SmallVector(const SmallVector& other) : size_(other.size_) {
    std::uninitialized_copy_n(other.items_.data(), size_, items_.data());
  }
  SmallVector& operator=(const SmallVector& other) {
    if (this == &other) return *this;  // the copy must not copy a range onto itself
    size_ = other.size_;
    std::uninitialized_copy_n(other.items_.data(), size_, items_.data());
    return *this;
  }

  // False (and nothing stored) when full; callers size Capacity by the
  // device's limits, so a full list is a bug upstream, never silent loss.
  bool push_back(const T& value) {
    if (size_ == Capacity) return false;
    std::construct_at(items_.data() + size_++, value);
    return true;
  }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T& operator[](size_t index) { return items_.items[index]; }
  const T& operator[](size_t index) const { return items_.items[index]; }
  T* data() { return items_.data(); }
  const T* data() const { return items_.data(); }
  T* begin() { return items_.data(); }
  T* end() { return items_.data() + size_; }
  const T* begin() const { return items_.data(); }
  const T* end() const { return items_.data() + size_; }
  operator std::span<const T>() const { return {items_.data(), size_}; }

 private:
  // Copied only as far as size_: a data-path list is built per packet, and
  // copying (or zeroing) 36 iovecs (576 bytes) for the one to three a
  // packet uses cost more than using them.
  UninitializedArray<T, Capacity> items_;
  size_t size_ = 0;
};

}  // namespace softverbs
