// offload_*="nvme" ([Note: swapped buffers] in swap_space.h): the
// optimizer's step brings buckets' values and gradients into memory and
// parks them again (zero_ext/optim/streamed_step.py), through the store and
// the reducer, which hold the swap space's slots. The file itself is opened
// at construction (sharded_model_config.cpp).
#include "sharded_model.h"

#include <string>
#include <vector>

namespace zero_ext {

bool ShardedModel::swapped() { return swap_ != nullptr; }

void ShardedModel::check_buckets(const std::vector<int64_t>& buckets) const {
  for (int64_t b : buckets) {
    TORCH_CHECK(b >= 0 && b < layout_.num_buckets(), "zero_ext internal: no bucket ", b);
  }
}

void ShardedModel::swap_in(std::vector<int64_t> buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!swap_) return;
  check_buckets(buckets);
  at::NoGradGuard no_grad;
  for (int64_t b : buckets) {
    store_.prefetch_value(b);  // every read of the batch in flight before the first wait
    reducer_.prefetch_grads(b);
  }
  for (int64_t b : buckets) {
    store_.hold_value(b);
    reducer_.ensure_grads(b);
  }
}

void ShardedModel::swap_prefetch(std::vector<int64_t> buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!swap_) return;
  check_buckets(buckets);
  for (int64_t b : buckets) {
    store_.prefetch_value(b);
    reducer_.prefetch_grads(b);
  }
}

void ShardedModel::swap_out(std::vector<int64_t> buckets, bool stepped, bool grads_dirty) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!swap_) return;
  check_buckets(buckets);
  for (int64_t b : buckets) {
    store_.unhold_value(b, stepped);
    reducer_.park_grads(b, grads_dirty);
  }
}

void ShardedModel::swap_drain() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (swap_) swap_->drain();
}

void ShardedModel::swap_in_grads(std::vector<int64_t> buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!swap_) return;
  check_buckets(buckets);
  at::NoGradGuard no_grad;
  for (int64_t b : buckets) reducer_.prefetch_grads(b);
  for (int64_t b : buckets) reducer_.ensure_grads(b);
}

void ShardedModel::swap_out_grads(std::vector<int64_t> buckets, bool dirty) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!swap_) return;
  check_buckets(buckets);
  for (int64_t b : buckets) reducer_.park_grads(b, dirty);
}

c10::Dict<std::string, int64_t> ShardedModel::swap_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  c10::Dict<std::string, int64_t> out;
  if (!swap_) return out;
  out.insert("file_bytes", swap_->file_bytes());
  out.insert("bytes_written", swap_->bytes_written());
  out.insert("bytes_read", swap_->bytes_read());
  out.insert("resident_bytes", swap_->resident_bytes());
  out.insert("peak_resident_bytes", swap_->peak_resident_bytes());
  out.insert("io_buffer_bytes", swap_->io_buffer_bytes());
  out.insert("slots", swap_->num_slots());
  return out;
}

void ShardedModel::swap_reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (swap_) swap_->reset_peak();
}

void ShardedModel::swap_fail_writes_after(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(swap_, "zero_ext internal: no offload file");
  swap_->fail_writes_after(bytes);
}

} // namespace zero_ext
