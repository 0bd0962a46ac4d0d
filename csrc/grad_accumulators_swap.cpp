// GradReducer, offload to a file (offload_optimizer="nvme"): the fp32
// accumulators as slots of the model's SwapSpace, and the segments' .grad
// pointed at a bucket's accumulator while it is in memory, at unreadable
// stand-ins while it is parked. Folding into a swapped accumulator is in
// grad_accumulators.cpp.
#include "grad_reducer.h"

#include <cstdint>
#include <string>

#include <ATen/ATen.h>

#include "storage_release.h"

namespace zero_ext {

// [Note: swapped gradients]
// offload_optimizer="nvme": each fp32 accumulator is a slot of the model's
// SwapSpace ([Note: swapped buffers]). A reduction's result is folded in as
// it retires (the accumulator read back first if a backward of this step
// already wrote it, else overwritten whole) and parked at once, written
// behind; the optimizer's step brings each bucket in for its turn. No
// reduction writes an accumulator directly and staging never aliases one.
// The non-finite check sums each folded result as it comes, so it never
// reads the file. Between a step's turns a segment's .grad is an unreadable
// stand-in of its shape, never the freed buffer.
void GradReducer::enable_swap(SwapSpace& swap, int64_t persist_bytes) {
  swap_ = &swap;
  segments_of_bucket_.assign(buckets_.size(), {});
  const auto& pieces = layout_.segments();
  for (size_t s = 0; s < pieces.size(); ++s) {
    segments_of_bucket_[pieces[s].bucket].push_back(static_cast<int64_t>(s));
    segment_stand_ins_.push_back(unreadable_like(
        segment_grads_[s], "zero_ext: this gradient is kept in the offload file (offload_optimizer='nvme') and "
                           "holds its values only during optimizer.step(). Read gradients with "
                           "zero_ext.full_grads(model); clip with optimizer.clip_grad_norm_ or zero_ext.clip_grad_norm_. "
                           "torch.amp.GradScaler reads them before the step: with offload to files use zero_ext's "
                           "own fp16 loss scaling (mixed_precision='fp16') instead."));
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    BucketGrads& bucket = buckets_[b];
    if (!bucket.accum.defined() || layout_.ddp_in_place() || !bucket.accum.device().is_cpu()) continue;
    if (bucket.accum.numel() * bucket.accum.element_size() < persist_bytes) continue;
    if (!storage_is_released(bucket.accum)) release_storage(bucket.accum);
    bucket.swap_slot = swap.add(bucket.accum, "the gradient of " + layout_.describe_bucket(static_cast<int64_t>(b), ""));
  }
}

void GradReducer::point_segment_grads(int64_t b, bool resident) {
  const auto& segments = store_.segments();
  for (int64_t s : segments_of_bucket_[b]) {
    at::Tensor& grad = segments[s].mutable_grad();
    if (grad.defined()) {
      grad = resident ? segment_grads_[s] : segment_stand_ins_[s];
    }
  }
}

void GradReducer::ensure_grads(int64_t b) {
  BucketGrads& bucket = buckets_[b];
  if (bucket.swap_slot < 0) return;
  if (!bucket.accum_has_value) {  // no gradient since zero_grad: zeros, as zero_if_released gives
    swap_->ensure_memory(bucket.swap_slot);
    bucket.accum.zero_();
    bucket.accum_has_value = true;
  } else {
    swap_->ensure(bucket.swap_slot);
  }
  point_segment_grads(b, /*resident=*/true);
}

void GradReducer::park_grads(int64_t b, bool dirty) {
  BucketGrads& bucket = buckets_[b];
  if (bucket.swap_slot < 0) return;
  point_segment_grads(b, /*resident=*/false);
  swap_->park(bucket.swap_slot, dirty);
}

void GradReducer::prefetch_grads(int64_t b) {
  const BucketGrads& bucket = buckets_[b];
  if (bucket.swap_slot >= 0 && bucket.accum_has_value) swap_->prefetch(bucket.swap_slot);
}

} // namespace zero_ext
