// Uninitialized, 64-byte aligned heap bytes (frame payloads are always written in full
// before they are read, so zero-filling them would only cost a memory pass).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>

namespace prime::ring {

class ByteBuffer {
 public:
  ByteBuffer() = default;
  explicit ByteBuffer(size_t size) : size_(size), capacity_((size + 63) / 64 * 64) {
    if (size == 0) return;
    data_.reset(static_cast<char*>(std::aligned_alloc(64, capacity_)));
    if (!data_) throw std::bad_alloc();
  }
  // Bytes owned elsewhere (pinned host memory of the CUDA staging pool): not freed by
  // this buffer; `keeper` is released with it.
  ByteBuffer(char* external, size_t size, std::shared_ptr<void> keeper)
      : data_(external, Free{false}), size_(size), capacity_(size), keeper_(std::move(keeper)) {}
  char* data() { return data_.get(); }
  const char* data() const { return data_.get(); }
  size_t size() const { return size_; }
  size_t capacity() const { return capacity_; }
  // Reuses the storage for `size` bytes (at most capacity()).
  void resize(size_t size) { size_ = size; }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(data_.get());
  }
  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(data_.get());
  }

 private:
  struct Free {
    Free() : owned(true) {}
    explicit Free(bool owns) : owned(owns) {}
    bool owned;
    void operator()(char* p) const {
      if (owned) std::free(p);
    }
  };
  std::unique_ptr<char, Free> data_;
  size_t size_ = 0;
  size_t capacity_ = 0;
  std::shared_ptr<void> keeper_;
};

}  // namespace prime::ring
