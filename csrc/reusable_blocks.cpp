#include "reusable_blocks.h"

#include <sys/mman.h>
#include <unistd.h>
#if defined(__linux__)
#include <malloc.h>  // glibc: mallinfo2, malloc_trim
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include <ATen/EmptyTensor.h>

namespace zero_ext {

ReusableBlocks& ReusableBlocks::get() {
  static ReusableBlocks* blocks = new ReusableBlocks();  // never destroyed: see the header
  return *blocks;
}

at::DataPtr ReusableBlocks::allocate(size_t nbytes) {
  if (nbytes < kMinBytes) {
    return c10::GetCPUAllocator()->allocate(nbytes);
  }
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = (nbytes + page - 1) / page * page;
  void* ptr = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    SizeClass& size = sizes_[bytes];
    if (!size.idle.empty()) {
      ptr = size.idle.back();  // the most recently freed: its pages are the likeliest still in cache
      size.idle.pop_back();
      ++reused_total_;
    } else {
      ++mapped_total_;
    }
    ++size.in_use;
    size.peak_this_step = std::max(size.peak_this_step, size.in_use);
  }
  if (ptr == nullptr) {
    ptr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) {
      std::lock_guard<std::mutex> lock(mutex_);
      --sizes_[bytes].in_use;
      --mapped_total_;
      TORCH_CHECK(false, "zero_ext: could not map ", bytes, " bytes of host memory for a training buffer (",
                  std::strerror(errno), "). Free memory, lower bucket_mb, or offload (offload_params=\"nvme\").");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    block_sizes_[ptr] = bytes;
  }
  return at::DataPtr(ptr, ptr, &ReusableBlocks::give_back, c10::Device(c10::DeviceType::CPU));
}

void ReusableBlocks::copy_data(void* dest, const void* src, std::size_t count) const {
  std::memcpy(dest, src, count);
}

void ReusableBlocks::give_back(void* ptr) {
  get().release(ptr);
}

void ReusableBlocks::release(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto owner = block_sizes_.find(ptr);
  TORCH_INTERNAL_ASSERT(owner != block_sizes_.end(), "a reusable block freed twice or never handed out");
  SizeClass& size = sizes_[owner->second];
  --size.in_use;
  if (size.in_use + static_cast<int64_t>(size.idle.size()) < std::max(size.peak_this_step, size.peak_last_step)) {
    size.idle.push_back(ptr);
  } else {
    munmap(ptr, owner->second);
    block_sizes_.erase(owner);
  }
}

void ReusableBlocks::end_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [bytes, size] : sizes_) {
    size.peak_last_step = size.peak_this_step;
    size.peak_this_step = size.in_use;
    const int64_t keep = std::max<int64_t>(0, size.peak_last_step - size.in_use);
    while (static_cast<int64_t>(size.idle.size()) > keep) {  // the longest idle go first
      munmap(size.idle.front(), bytes);
      block_sizes_.erase(size.idle.front());
      size.idle.erase(size.idle.begin());
    }
  }
  release_free_heap();
}

void ReusableBlocks::release_idle() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [bytes, size] : sizes_) {
    for (void* ptr : size.idle) {
      munmap(ptr, bytes);
      block_sizes_.erase(ptr);
    }
    size.idle.clear();
    // Not in_use: a block set-up still holds (a collective in flight on a
    // hybrid mesh) is unmapped when it comes back, not kept idle.
    size.peak_this_step = size.peak_last_step = 0;
  }
}

ReusableBlocks::Stats ReusableBlocks::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  Stats out;
  for (const auto& [bytes, size] : sizes_) {
    out.in_use_bytes += size.in_use * static_cast<int64_t>(bytes);
    out.idle_bytes += static_cast<int64_t>(size.idle.size() * bytes);
  }
  out.mapped_total = mapped_total_;
  out.reused_total = reused_total_;
  return out;
}

void release_free_heap() {
  static const bool asked = [] {
    const char* value = std::getenv("ZERO_EXT_TRIM_HEAP");
    return value != nullptr && std::string(value) == "1";
  }();
  if (!asked) return;
#if defined(__GLIBC__)
#if __GLIBC_PREREQ(2, 33)
  const size_t free_bytes = mallinfo2().fordblks;
#else
  const size_t free_bytes = static_cast<unsigned int>(mallinfo().fordblks);
#endif
  if (free_bytes >= kFreeHeapToRelease) malloc_trim(0);
#endif
}

at::Tensor reusable_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (!options.device().is_cpu() || options.pinned_memory()) {
    return at::empty(sizes, options);
  }
  return at::detail::empty_generic(sizes, &ReusableBlocks::get(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()), std::nullopt);
}

c10::Allocator* growth_allocator(const c10::Storage& storage) {
  c10::Allocator* own = storage.allocator();
  return storage.device().is_cpu() && own == c10::GetCPUAllocator() ? &ReusableBlocks::get() : own;
}

} // namespace zero_ext
