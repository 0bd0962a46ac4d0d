#pragma once
// ReusableBlocks: host memory for the buffers a training step frees and asks
// for again.
//
// [Note: reusable host blocks]
// Stage 3 gathers every unit into a full buffer twice a step and frees it
// after use; gradient staging, the exchange's receive buffer and the reduced
// shard come and go with every bucket, and zero_grad(set_to_none=True) frees
// the gradient shards. Through malloc, glibc maps each such buffer the first
// time, raises its mmap threshold to the buffer's size when it is freed (up
// to 32 MiB), and from then on serves buffers of that size, and every smaller
// one (activations), from its heap, where they fragment: at world 2 a 14M GPT
// at stage 3 held 1408 MiB resident against DDP's 1036 although it held half
// DDP's state (issue 56). These buffers come instead from blocks mapped here
// (never through malloc, so no glibc threshold moves), kept when freed and
// handed out again for the same size: after the first steps none is mapped
// or faulted in again. Of each size, the blocks kept (in use and idle) are at
// most the most in use at once over the last two steps (end_step): the units
// and reductions in flight. A gather of every unit for inspection does not
// stay reserved once training goes on; blocks past the bound are unmapped,
// back to the system at once.
//
// What glibc keeps besides: a step's activations (MiBs each, served from the
// heap once glibc's threshold rose) leave holes in the heap when freed that
// stay resident, in DDP's loop as in ours. With ZERO_EXT_TRIM_HEAP=1, at each
// step's end where the heap holds kFreeHeapToRelease or more free,
// malloc_trim hands its free pages back: on the 14M GPT (world 2, stage 3)
// peak resident memory 1030-1053 MiB -> 946-953 (DDP 1035), but the next
// step faults them in again, 833-842 -> 962-972 ms a step (+16%), so it is
// off unless asked for.
//
// Only plain (unpinned) CPU buffers of kMinBytes and more come from here;
// a GPU's caching allocator already reuses its blocks.

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

namespace zero_ext {

class ReusableBlocks final : public c10::Allocator {
 public:
  static constexpr size_t kMinBytes = size_t(1) << 20;  // smaller ones: malloc serves them well

  // The process's one instance (every wrapped model shares it; never freed,
  // as tensors may outlive any model).
  static ReusableBlocks& get();

  at::DataPtr allocate(size_t nbytes) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  // A step ended: the blocks kept idle from now on fit in the most bytes in
  // use at once during this step or the one before.
  void end_step();

  // Set-up is not a step: wrap() (sharding, first broadcasts) and load() use
  // blocks in sizes and numbers no step asks for, which end_step would keep
  // through the first two steps, over the first forward's peak (14M GPT,
  // world 2: 85 MiB idle after wrap, 20 MiB of it still at step 2). Every
  // idle block is unmapped, and so is every block in use now once it comes
  // back, unless a step asked for its size again meanwhile.
  void release_idle();

  struct Stats {
    int64_t in_use_bytes = 0;
    int64_t idle_bytes = 0;
    int64_t mapped_total = 0;  // blocks mapped since the process started
    int64_t reused_total = 0;  // allocations served by an idle block
  };
  Stats stats();

 private:
  // The blocks of one size (whole pages).
  struct SizeClass {
    int64_t in_use = 0;
    std::vector<void*> idle;  // longest idle first
    int64_t peak_this_step = 0;  // most in use at once
    int64_t peak_last_step = 0;
  };
  static void give_back(void* ptr);
  void release(void* ptr);

  std::mutex mutex_;
  std::map<size_t, SizeClass> sizes_;
  std::unordered_map<void*, size_t> block_sizes_;  // every block mapped, in use or idle
  int64_t mapped_total_ = 0;
  int64_t reused_total_ = 0;
};

// With ZERO_EXT_TRIM_HEAP=1: glibc's free heap pages back to the system,
// where it holds kFreeHeapToRelease or more free (a no-op elsewhere).
constexpr size_t kFreeHeapToRelease = size_t(32) << 20;
void release_free_heap();

// A buffer of `sizes` and `options` whose memory comes from ReusableBlocks
// where that applies (plain CPU, kMinBytes and more), else from at::empty.
at::Tensor reusable_empty(at::IntArrayRef sizes, const at::TensorOptions& options);
// The allocator that regrows a released storage ([Note: release by resize]):
// ReusableBlocks for a plain CPU storage, else the storage's own.
c10::Allocator* growth_allocator(const c10::Storage& storage);

} // namespace zero_ext
