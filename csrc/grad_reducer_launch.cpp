// GradReducer, a bucket's launch: its gradients staged (missing ones as
// zeros), pre-divided, and its reduction issued, one step per gradient
// layout ([Note: gradient layouts] in layout.h); then counted in flight and
// bounded ([Note: reductions in flight] in grad_reducer.h).
#include "grad_reducer.h"
#include "reusable_blocks.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/autograd/variable.h>

namespace zero_ext {

// [Note: retiring from a launch] A launch over the in-flight bound retires
// the oldest reduction (bound_in_flight -> retire). retire frees a transient
// staging once the stream it was allocated on (the compute stream: the
// stream current when retire is entered) waits for the reduction stream.
// Entered with the launch's guard still on the reduction stream, it made the
// reduction stream wait for itself, and the compute stream could reuse the
// staging while the collective still read it: each launch leaves the
// reduction stream before bound_in_flight.

// One step per gradient layout ([Note: gradient layouts] in layout.h), each
// staging the bucket on the compute stream, then issuing its reduction from
// the reduction stream ([Note: the reduction stream]), which stays current
// through the accounting of what is in flight and its bound.
void GradReducer::launch(int64_t b) {
  RECORD_USER_SCOPE(std::string(layout_.replicated() || layout_.ddp_in_place() ? "zero_ext::all_reduce bucket "
                                                                              : "zero_ext::reduce_scatter bucket ") +
                    std::to_string(b));  // a profiler label; free when none runs
  at::NoGradGuard no_grad;
  if (retires_unreduced(b)) {
    return;
  }
  switch (layout_.grad_layout()) {
    case GradLayout::kDdpInPlace: launch_ddp_in_place(b); break;
    case GradLayout::kReplicated: launch_replicated(b); break;
    case GradLayout::kShardedPersistent: launch_sharded_persistent(b); break;
    case GradLayout::kShardedTransient: launch_sharded_transient(b); break;
  }
}

bool GradReducer::retires_unreduced(int64_t b) {
  BucketGrads& bucket = buckets_[b];
  if (layout_.bucket(b).trainable == 0) {
    bucket.phase = BucketPhase::kRetired;  // frozen parameters only: nothing to reduce
    return true;
  }
  if (frozen_skip_allowed_ && frozen_now(b)) {
    if (bucket.staging_stale) {
      bucket.staging.zero_();  // param.grad may view it until settled: zeros, as before the skip
      bucket.staging_stale = false;
    }
    bucket.phase = BucketPhase::kRetired;  // [Note: buckets frozen since wrap]
    ++frozen_skips_;
    return true;
  }
  return false;
}

void GradReducer::launch_ddp_in_place(int64_t b) {
  const BucketShape& shape = layout_.bucket(b);
  BucketGrads& bucket = buckets_[b];
  for (int64_t i = shape.first; i < shape.first + shape.count; ++i) {
    at::Tensor& grad = store_.param(i).mutable_grad();
    const at::Tensor& view = grad_views_[i];
    if (same_memory(grad, view)) {
      // already in place
    } else if (grad.defined()) {
      // After a detach only the new part is in param.grad; before it, all.
      if (detached_[i]) {
        view.add_(grad);
      } else {
        view.copy_(grad);
      }
    } else if (!detached_[i]) {
      view.zero_();  // param.grad was cleared: contribute no stale value
    }
    // Detach while the reduction runs, so a late AccumulateGrad cannot
    // write into memory the collective is reading.
    grad = at::Tensor();
    detached_[i] = 1;
  }
  bucket.staging_stale = false;  // every slot written above
  std::optional<c10::StreamGuard> on_reduction_stream;
  begin_reduction(b, on_reduction_stream);
  bucket.work = comm_of(b).all_reduce_sum(bucket.staging, Purpose::kGradReduce, b);
  go_in_flight(b);
  on_reduction_stream.reset();  // before retiring: see [Note: retiring from a launch]
  bound_in_flight();
}

void GradReducer::launch_replicated(int64_t b) {
  BucketGrads& bucket = buckets_[b];
  stage_missing_as_zeros(b);
  std::optional<c10::StreamGuard> on_reduction_stream;
  begin_reduction(b, on_reduction_stream);
  bucket.reduce_out = bucket.staging;
  bucket.work = comm_of(b).all_reduce_sum(bucket.staging, Purpose::kGradReduce, b);
  go_in_flight(b);
  on_reduction_stream.reset();  // before retiring: see [Note: retiring from a launch]
  bound_in_flight();
}

void GradReducer::launch_sharded_persistent(int64_t b) {
  stage_missing_as_zeros(b);
  std::optional<c10::StreamGuard> on_reduction_stream;
  begin_reduction(b, on_reduction_stream);
  const int64_t scratch_bytes = issue_reduce_scatter(b);
  go_in_flight(b);
  if (staging_is_transient()) {
    // Alone in its group: staged apart from the accumulator as stages 2-3
    // stage ([Note: one rank's staging is its accumulator]).
    if (!buckets_[b].staging.is_same(buckets_[b].accum)) count_staging_in_flight(b, scratch_bytes);
  } else if (by_exchange_ || reduces_quantized(b)) {
    count_exchange_in_flight(b, scratch_bytes);
  }
  on_reduction_stream.reset();  // before retiring: see [Note: retiring from a launch]
  bound_in_flight();
}

void GradReducer::launch_sharded_transient(int64_t b) {
  stage_missing_as_zeros(b);
  std::optional<c10::StreamGuard> on_reduction_stream;
  begin_reduction(b, on_reduction_stream);
  const int64_t scratch_bytes = issue_reduce_scatter(b);
  go_in_flight(b);
  if (!buckets_[b].staging.is_same(buckets_[b].accum)) {
    count_staging_in_flight(b, scratch_bytes);
  }
  on_reduction_stream.reset();  // before retiring: see [Note: retiring from a launch]
  bound_in_flight();
}

void GradReducer::stage_missing_as_zeros(int64_t b) {
  const BucketShape& shape = layout_.bucket(b);
  BucketGrads& bucket = buckets_[b];
  ensure_staging(b);
  for (int64_t i = shape.first; i < shape.first + shape.count; ++i) {
    if (arrived_[i]) {
      continue;
    }
    at::Tensor& grad = store_.param(i).mutable_grad();
    at::Tensor region = staging_region(b, i);
    if (grad.defined() && !holds_stand_in(i)) {
      region.copy_(grad);  // accumulated under no_sync(), or late
      grad = at::Tensor();
    } else {
      region.zero_();  // unused here (a stand-in stays): zeros keep the collective in step
    }
  }
  for (const auto& [start, length] : layout_.gaps(b)) {
    bucket.staging.narrow(0, start, length).zero_();  // padding: reduced, never read
  }
}

void GradReducer::begin_reduction(int64_t b, std::optional<c10::StreamGuard>& on_reduction_stream) {
  BucketGrads& bucket = buckets_[b];
  bucket.defers = defers_replica_sync();
  bucket.result_unscaled = false;
  if (!layout_.ddp_in_place() && !bucket.defers) {
    ensure_accum_memory(bucket);  // on the compute stream, which frees it at zero_grad
  }
  // From here on the reduction stream ([Note: the reduction stream]).
  if (streams_.enabled()) {
    streams_.reduction_waits_for_compute();
    on_reduction_stream.emplace(streams_.reduction());
  }
  // Pre-divide (gloo has no AVG/PREMUL_SUM everywhere), and remove the loss
  // scale in the same pass unless the reduction runs in fp16, whose range
  // the scale is there to use.
  const LossScaler& scaler = gate_.scaler();
  // An expert bucket too divides by the whole data-parallel size ([Note: expert buckets] in layout.h).
  double divisor = divide_factor_ > 0.0 ? divide_factor_ : static_cast<double>(comm_.size() * replica_comm_.size());
  if (scaler.enabled() && reduce_dtype_ != at::kHalf) {
    divisor *= scaler.scale();
  }
  if (divisor != 1.0) {
    bucket.staging.div_(divisor);
  }
}

bool GradReducer::reduces_quantized(int64_t b) const {
  return grad_format_.enabled() && !comm_of(b).local() && !layout_.ddp_in_place() && !layout_.replicated();
}

int64_t GradReducer::issue_reduce_scatter(int64_t b) {
  const BucketShape& shape = layout_.bucket(b);
  BucketGrads& bucket = buckets_[b];
  const bool quantized = reduces_quantized(b);
  // The exchange's receive buffer; quantized: the fp32 values sent and the payloads both ways.
  const int64_t scratch_bytes =
      quantized ? 4 * bucket.staging.numel() + 2 * comm_of(b).size() * grad_format_.payload_bytes(shape.shard)
                : (by_exchange_ ? bucket.staging.nbytes() : 0);
  if (quantized) {
    // [Note: quantized collectives]: written from the backend's thread,
    // never straight into the accumulator (as the exchange below).
    if (!bucket.residual.defined()) {
      bucket.residual = at::zeros({bucket.staging.numel()}, bucket.staging.options().dtype(at::kFloat));
    }
    bucket.reduce_out = at::empty({shape.shard}, bucket.staging.options());
    bucket.work = comm_of(b).quantized_reduce_scatter_sum(bucket.reduce_out, bucket.staging, grad_format_,
                                                         bucket.residual, Purpose::kGradReduce, b);
  } else if (!comm_of(b).local() && bucket.staging.is_cpu() && !by_exchange_) {
    // Any other CPU reduction: an all-reduce in place (gloo's reduce-scatter
    // is one, plus a copy inside wait() that no bounded wait can see), read
    // at this rank's shard.
    bucket.reduce_out = bucket.staging.narrow(0, layout_.shard_start(b), shape.shard);
    bucket.work = comm_of(b).all_reduce_sum(bucket.staging, Purpose::kGradReduce, b);
  } else {
    // Never straight into the accumulator from a gloo thread: a reduction a
    // failed backward abandons may still write it after zero_grad() freed it.
    const bool direct = !by_exchange_ && !bucket.defers && !bucket.accum_has_value && bucket.swap_slot < 0 &&
                        bucket.accum.dtype() == bucket.staging.dtype() &&
                        bucket.accum.device() == bucket.staging.device();
    bucket.reduce_out = direct ? bucket.accum : reusable_empty({shape.shard}, bucket.staging.options());
    bucket.work = comm_of(b).reduce_scatter_sum(bucket.reduce_out, bucket.staging, Purpose::kGradReduce, b);
  }
  return scratch_bytes;
}

void GradReducer::go_in_flight(int64_t b) {
  BucketGrads& bucket = buckets_[b];
  bucket.phase = BucketPhase::kInFlight;
  in_flight_.push_back(b);
  if (hybrid_ && !bucket.defers) {
    bucket.replica_pending = true;
    if (!host_waits_) {
      issue_replica_reduction(b);  // ordered after the shard's reduction on the streams: no host wait
    }
  }
}

void GradReducer::count_staging_in_flight(int64_t b, int64_t scratch_bytes) {
  // The staging moves from filling to in flight, with the output it needs.
  BucketGrads& bucket = buckets_[b];
  const bool own_output = !bucket.reduce_out.is_alias_of(bucket.staging) && !bucket.reduce_out.is_same(bucket.accum);
  filling_staging_bytes_ -= bucket.staging.nbytes();
  bucket.in_flight_bytes = bucket.staging.nbytes() + (own_output ? bucket.reduce_out.nbytes() : 0) + scratch_bytes;
  in_flight_bytes_ += bucket.in_flight_bytes;
  note_staging_peak();
}

void GradReducer::count_exchange_in_flight(int64_t b, int64_t scratch_bytes) {
  // Stage 1: the staging stays; the exchange's buffers are what is in flight.
  BucketGrads& bucket = buckets_[b];
  bucket.in_flight_bytes = bucket.reduce_out.nbytes() + scratch_bytes;
  in_flight_bytes_ += bucket.in_flight_bytes;
  peak_staging_bytes_ = std::max(peak_staging_bytes_, persistent_staging_bytes_ + in_flight_bytes_);
}

} // namespace zero_ext
