#include "buffer_pool.h"

namespace prime::ring {
namespace {

// Below this the allocator serves from its heap (no fresh pages): not worth pooling.
constexpr size_t kPoolMin = 64 << 10;

}  // namespace

std::shared_ptr<BufferPool> BufferPool::create(size_t max_cached_bytes) {
  return std::make_shared<BufferPool>(Key{}, max_cached_bytes);
}

Buffer BufferPool::acquire(size_t size) {
  if (size < kPoolMin) return std::make_shared<ByteBuffer>(size);
  std::unique_ptr<ByteBuffer> buffer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = idle_.lower_bound(size);
    if (it != idle_.end() && it->first <= 2 * size) {  // do not spend a huge buffer on a small need
      buffer = std::move(it->second);
      cached_ -= it->first;
      idle_.erase(it);
    }
  }
  if (!buffer) buffer = std::make_unique<ByteBuffer>(size);
  buffer->resize(size);
  std::weak_ptr<BufferPool> pool = weak_from_this();
  return Buffer(buffer.release(), [pool](ByteBuffer* raw) {
    std::unique_ptr<ByteBuffer> owned(raw);
    if (auto p = pool.lock()) p->release(std::move(owned));
  });
}

void BufferPool::release(std::unique_ptr<ByteBuffer> buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t cap = buffer->capacity();
  if (cached_ + cap > max_cached_) return;  // freed on return
  cached_ += cap;
  idle_.emplace(cap, std::move(buffer));
}

}  // namespace prime::ring
