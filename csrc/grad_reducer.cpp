// GradReducer, the way in: gradient arrival, the order buckets launch in,
// reductions in flight and their retirement. A bucket's launch, per gradient
// layout, is in grad_reducer_launch.cpp; what a reduction becomes
// (accumulators, offload landing, .grad) in grad_accumulators.cpp.
#include "grad_reducer.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/variable.h>

#include "storage_release.h"
#include "reusable_blocks.h"

namespace zero_ext {

namespace {
// How long a hook polls for the oldest reduction where waits block the host
// (see [Note: reductions in flight]).
constexpr std::chrono::milliseconds kHostBoundWait{2000};
}  // namespace

GradReducer::GradReducer(const Layout& layout, ParamStore& store, Communicator& comm, Communicator& replica_comm,
                         Communicator& expert_comm, const StepGate& gate, std::optional<c10::ScalarType> reduce_dtype)
    : layout_(layout), store_(store), comm_(comm), expert_comm_(expert_comm), replica_comm_(replica_comm), hybrid_(replica_comm.size() > 1),
      streams_(store.device()), gate_(gate),
      reduce_dtype_(reduce_dtype.value_or(at::kFloat)) {
  TORCH_INTERNAL_ASSERT(reduce_dtype_ == at::kFloat || reduce_dtype_ == at::kBFloat16 || reduce_dtype_ == at::kHalf,
                        "gradients are reduced in float32, bfloat16 or float16");
  at::NoGradGuard no_grad;
  const int64_t n_params = layout_.num_params();
  allocate_buffers();
  make_stand_ins();
  size_in_flight_bound();
  host_waits_ = comm_.waits_on_host(store_.device().type());
  launch_on_arrival_ = !layout_.params_sharded();
  arrived_.assign(n_params, 0);
  detached_.assign(n_params, 0);
  local_has_grad_.assign(n_params, 0);
  global_has_grad_.assign(n_params, 0);
  start_round();
}

void GradReducer::allocate_buffers() {
  buckets_.resize(layout_.num_buckets());
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    const BucketShape& shape = layout_.bucket(b);
    BucketGrads& bucket = buckets_[b];
    const auto options = store_.bucket(b).flat.options();
    if (layout_.ddp_in_place()) {
      bucket.staging = at::zeros({shape.padded}, options);
    } else if (!staging_is_transient() && shape.trainable > 0) {  // frozen parameters only: never reduced
      bucket.staging = at::zeros({shape.padded}, options.dtype(reduce_dtype_));
    }
    if (!layout_.ddp_in_place() && shape.trainable > 0) {
      bucket.accum = store_.offload() ? at::zeros({shape.shard}, host_fp32(options.device()))
                                      : reusable_empty({shape.shard}, options.dtype(at::kFloat));
    }
  }
  if (layout_.ddp_in_place()) {
    for (int64_t i = 0; i < layout_.num_params(); ++i) {
      grad_views_.push_back(staging_region(layout_.bucket_of(i), i));
    }
  }
  for (const ShardPiece& piece : layout_.segments()) {
    at::Tensor grad = buckets_[piece.bucket].accum.narrow(0, piece.shard_offset, piece.length);
    if (layout_.segment_is_whole(piece.param)) {
      grad = grad.view(store_.param(piece.param).sizes());
    }
    segment_grads_.push_back(grad);
  }
  // Like after zero_grad(): no gradient memory until the first reduction
  // lands ([Note: accumulator memory]); the segment views above keep their shape.
  for (auto& bucket : buckets_) {
    if (bucket.accum.defined() && !store_.offload()) release_storage(bucket.accum);
  }
}

void GradReducer::make_stand_ins() {
  const int64_t n_params = layout_.num_params();
  stand_ins_.resize(n_params);
  for (int64_t i = 0; i < n_params; ++i) {
    if (layout_.trainable(i) && !layout_.ddp_in_place()) {
      stand_ins_[i] = unreadable_like(
          store_.param(i),
          "zero_ext: the gradient of '" + layout_.name(i) + "' is sharded over the ranks (stage " +
              std::to_string(layout_.stage()) + ") and lives in the optimizer, so param.grad holds no data. "
              "Clip with zero_ext.clip_grad_norm_(model.parameters(), max_norm) or "
              "zero_ext.clip_grad_value_(model.parameters(), clip_value) (torch.nn.utils' clip "
              "functions cannot see sharded gradients); read full gradients with "
              "zero_ext.full_grads(model).");
    }
  }
}

void GradReducer::size_in_flight_bound() {
  // Stage 1 too: its staging stays, but an all-reduce in place sends twice
  // the bytes of the exchange, whose receive buffer and output live only
  // while in flight (bounded below, as stages 2-3's staging is).
  by_exchange_ = !layout_.ddp_in_place() && !layout_.replicated() &&
                 comm_.collectives_by_exchange(store_.device());
  // Two of the largest bucket in flight: one reducing while the next fills
  // and launches (see [Note: reductions in flight]).
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    const BucketShape& shape = layout_.bucket(b);
    if (shape.trainable == 0) {
      continue;  // never in flight
    }
    const int64_t scratch = by_exchange_ ? shape.padded : 0;  // the exchange's receive buffer
    const int64_t bytes = (shape.padded + shape.shard + scratch) * at::elementSize(reduce_dtype_);
    max_in_flight_bytes_ = std::max(max_in_flight_bytes_, 2 * bytes);
  }
  if (!staging_is_transient()) {
    for (const auto& bucket : buckets_) {  // persistent: the peak is all of it, always
      persistent_staging_bytes_ += bucket.staging.defined() ? bucket.staging.nbytes() : 0;
    }
    peak_staging_bytes_ = persistent_staging_bytes_;
  }
}

at::Tensor GradReducer::staging_region(int64_t b, int64_t i) {
  return buckets_[b].staging.narrow(0, layout_.offset(i), layout_.numel(i)).view(layout_.shape(i));
}

// [Note: one rank's staging is its accumulator]
// Alone in its group (world size 1), a rank's shard is the whole bucket and
// its reduction is a division at most: while the accumulator holds nothing
// yet, gradients are staged straight into it, and the reduction writes over
// itself (Communicator's local copies skip a tensor onto itself). One copy
// per gradient instead of two, and no staging buffer (measured at world 1,
// stage 2: 4 ms of a 138 ms step were the second copy and its fresh memory).
// Not with offload, a reduction dtype other than fp32, or a mesh (the
// replicas' all-reduce reads the result later). Stage 1 then keeps no
// persistent staging either: a backward that adds to what the accumulator
// holds stages apart, as stages 2-3 do, and frees it once reduced.
bool GradReducer::may_stage_into_accum() const {
  const GradLayout grad_layout = layout_.grad_layout();
  return (grad_layout == GradLayout::kShardedTransient || grad_layout == GradLayout::kShardedPersistent) &&
         comm_.local() && !hybrid_ && !store_.offload() && reduce_dtype_ == at::kFloat && swap_ == nullptr;
}

bool GradReducer::stages_into_accum(int64_t b) const {
  const BucketGrads& bucket = buckets_[b];
  return may_stage_into_accum() && !bucket.accum_has_value && bucket.accum.defined() &&
         bucket.accum.numel() == layout_.bucket(b).padded;
}

bool GradReducer::staging_is_transient() const { return layout_.transient_staging() || may_stage_into_accum(); }

void GradReducer::ensure_staging(int64_t b) {
  BucketGrads& bucket = buckets_[b];
  if (bucket.staging.defined()) {
    return;
  }
  if (stages_into_accum(b)) {
    ensure_accum_memory(bucket);
    bucket.staging = bucket.accum;
    return;
  }
  bucket.staging = reusable_empty({layout_.bucket(b).padded}, store_.bucket(b).flat.options().dtype(reduce_dtype_));
  filling_staging_bytes_ += bucket.staging.nbytes();
  note_staging_peak();
}

void GradReducer::start_round() {
  frozen_skip_allowed_ = false;  // until the next backward round allows it
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    buckets_[b].waiting = layout_.bucket(b).trainable;
    buckets_[b].phase = BucketPhase::kFilling;
  }
  std::fill(arrived_.begin(), arrived_.end(), 0);
  next_launch_ = 0;
  late_ = false;
  bound_lifted_ = false;
  if (!dropped_.empty()) {
    dropped_.erase(std::remove_if(dropped_.begin(), dropped_.end(),
                                  [](const Dropped& d) { return d.work->isCompleted(); }),
                   dropped_.end());
  }
}

int64_t GradReducer::on_grad_ready(int64_t i, bool sync) {
  retire_completed();
  at::Tensor& grad = store_.param(i).mutable_grad();
  if (!grad.defined()) {
    return -1;
  }
  local_has_grad_[i] = 1;
  const int64_t b = layout_.bucket_of(i);
  BucketGrads& bucket = buckets_[b];
  if (bucket.phase != BucketPhase::kFilling) {
    // Arrived after its bucket went out. It stays in param.grad; the
    // epilogue runs a second round for it on every rank.
    late_ = true;
    return -1;
  }
  at::NoGradGuard no_grad;
  if (layout_.ddp_in_place()) {
    const at::Tensor& view = grad_views_[i];
    if (!same_memory(grad, view)) {
      if (detached_[i]) {
        view.add_(grad);  // a late gradient of an earlier round, next to what that round reduced
        detached_[i] = 0;
      } else {
        view.copy_(grad);  // param.grad was None or replaced: it holds the whole accumulated value
      }
      grad = view;
    }
  } else {
    if (!sync) {
      // no_sync(): accumulate locally in param.grad. Stage 3 still counts the
      // arrival, to release the unit once its backward is over.
      if (layout_.params_sharded() && !arrived_[i]) {
        arrived_[i] = 1;
        if (--bucket.waiting == 0) {
          return b;
        }
      }
      return -1;
    }
    ensure_staging(b);
    at::Tensor region = staging_region(b, i);
    if (arrived_[i]) {
      region.add_(grad);
    } else {
      region.copy_(grad);
    }
    grad = at::Tensor();  // the full gradient lives on only in the bucket
  }
  if (!sync || arrived_[i]) {
    return -1;
  }
  arrived_[i] = 1;
  if (--bucket.waiting != 0) {
    return -1;
  }
  if (launch_on_arrival_) {
    launch_ready_buckets();
  }
  return b;
}

// [Note: issue order]
// Stage 3 issues gathers (on the gather group) and reductions (on the
// reduction group) during backward. NCCL requires work on different
// communicators to be issued in the same order on every rank, or kernels
// that cannot run side by side deadlock (CUDA_DEVICE_MAX_CONNECTIONS=1 makes
// it likely). A bucket whose last gradient arrives is a moment that differs
// between ranks when a parameter is used on some ranks only; the end of a
// unit's last use in backward (its UnitInputBoundary node) is not: every rank
// runs the same units (the agreement checks it), and the gathers of the
// backward prefetch hang off the same events. So stage 3 launches a unit's
// buckets there, gradients not yet arrived as zeros (one that still comes is
// late: it waits in param.grad for the next round), and the rest at the
// epilogue, in bucket order.
void GradReducer::launch_buckets(const std::vector<int64_t>& buckets) {
  for (int64_t b : buckets) {
    if (buckets_[b].phase == BucketPhase::kFilling) {
      launch(b);
    }
  }
}

void GradReducer::launch_ready_buckets() {
  while (next_launch_ < layout_.num_buckets() && buckets_[next_launch_].waiting == 0) {
    launch(next_launch_++);
  }
}

bool GradReducer::frozen_now(int64_t b) const {
  const BucketShape& shape = layout_.bucket(b);
  for (int64_t i = shape.first; i < shape.first + shape.count; ++i) {
    if (layout_.trainable(i) && store_.param(i).requires_grad()) {
      return false;
    }
  }
  return true;
}

void GradReducer::flush() {
  // Unused parameters contribute zeros, so the sequence of collectives is
  // the same on every rank.
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    if (buckets_[b].phase == BucketPhase::kFilling) {
      launch(b);
    }
  }
  next_launch_ = layout_.num_buckets();
  wait_all();
  unsynced_since_reduce_ = false;
}

void GradReducer::rerun_all() {
  start_round();  // every parameter counts as not arrived: pending grads are flushed
  flush();
}

double GradReducer::result_unscale() const {
  // Reduced in fp16 while still scaled (to use fp16's range); the scale is
  // divided out in fp32, as the result is added into the accumulator.
  const LossScaler& scaler = gate_.scaler();
  return scaler.enabled() && reduce_dtype_ == at::kHalf ? 1.0 / scaler.scale() : 1.0;
}

void GradReducer::issue_replica_reduction(int64_t b) {
  BucketGrads& bucket = buckets_[b];
  TORCH_INTERNAL_ASSERT(bucket.replica_pending, "replica reduction issued twice");
  RECORD_USER_SCOPE("zero_ext::all_reduce across replicas bucket " + std::to_string(b));
  comm_of(b).wait(bucket.work, [&] {
    return "gradient reduction of " + layout_.describe_bucket(b, gate_.progress().where());
  });
  bucket.work.reset();
  // Stage 0 reduces the staging itself; the others read this rank's result.
  at::Tensor* result = bucket.reduce_out.defined() ? &bucket.reduce_out : &bucket.staging;
  if (bucket.unsynced.defined()) {
    // Earlier backwards kept theirs back: one all-reduce carries them all
    // ([Note: deferred replica all-reduce]), in fp32 and unscaled.
    bucket.unsynced.add_(*result, result_unscale());
    bucket.reduce_out = std::exchange(bucket.unsynced, at::Tensor());
    bucket.result_unscaled = true;
    result = &bucket.reduce_out;
  }
  if (replica_comm_.quantized_all_reduce_pays(*result, grad_format_)) {  // [Note: quantized collectives]
    if (!bucket.replica_residual.defined()) {
      bucket.replica_residual = at::zeros({result->numel()}, result->options().dtype(at::kFloat));
    }
    bucket.replica_work =
        replica_comm_.quantized_all_reduce_sum(*result, grad_format_, bucket.replica_residual, Purpose::kReplicaReduce, b);
  } else {
    bucket.replica_work = replica_comm_.all_reduce_sum(*result, Purpose::kReplicaReduce, b);
  }
  bucket.replica_pending = false;
}

void GradReducer::advance_replica_reductions() {
  for (int64_t b : in_flight_) {
    BucketGrads& bucket = buckets_[b];
    if (!bucket.replica_pending) {
      continue;
    }
    if (bucket.work && !bucket.work->isCompleted()) {
      return;  // later ones wait their turn: every rank issues them in launch order
    }
    issue_replica_reduction(b);
  }
}

bool GradReducer::reduction_completed(const BucketGrads& bucket) const {
  return !bucket.replica_pending && (!bucket.work || bucket.work->isCompleted()) &&
         (!bucket.replica_work || bucket.replica_work->isCompleted());
}

bool GradReducer::reduction_done_within(int64_t b, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  BucketGrads& bucket = buckets_[b];
  if (!Communicator::done_within(bucket.work, limit)) {
    return false;
  }
  if (bucket.replica_pending) {
    issue_replica_reduction(b);  // the oldest in flight: every earlier one has retired
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
  return Communicator::done_within(bucket.replica_work, std::max(left, std::chrono::milliseconds(0)));
}

void GradReducer::bound_in_flight() {
  retire_completed();
  if (!layout_.transient_staging() && !by_exchange_) {
    return;
  }
  while (in_flight_.size() > 1 && in_flight_bytes_ > max_in_flight_bytes_) {
    if (host_waits_) {
      if (bound_lifted_) {
        return;
      }
      if (!reduction_done_within(in_flight_.front(), kHostBoundWait)) {
        bound_lifted_ = true;
        ++bound_lifts_;
        return;
      }
    }
    retire_oldest();  // NCCL: the compute stream waits, the host goes on
  }
}

void GradReducer::retire_oldest() {
  const int64_t b = in_flight_.front();
  retire(b);
  in_flight_.pop_front();
}

void GradReducer::retire_completed() {
  if (hybrid_) {
    advance_replica_reductions();
  }
  if (!layout_.transient_staging() && !by_exchange_) {
    return;  // only stages 2-3 free anything at retirement, and exchanges their buffers
  }
  while (!in_flight_.empty() && reduction_completed(buckets_[in_flight_.front()])) {
    retire_oldest();
  }
}

void GradReducer::wait_all() {
  while (!in_flight_.empty()) {
    retire_oldest();
  }
  close_host_round();  // no wait: see [Note: offload without a host sync in backward]
  if (streams_.enabled()) {
    streams_.compute_waits_for_reduction();  // the accumulators, for the optimizer and the next round
  }
}

void GradReducer::retire(int64_t b) {
  at::NoGradGuard no_grad;
  BucketGrads& bucket = buckets_[b];
  std::optional<c10::StreamGuard> on_reduction_stream;
  if (streams_.enabled()) {
    on_reduction_stream.emplace(streams_.reduction());
  }
  if (bucket.replica_pending) {
    issue_replica_reduction(b);  // waits for the shard's reduction
  }
  comm_of(b).wait(bucket.work, [&] {
    return "gradient reduction of " + layout_.describe_bucket(b, gate_.progress().where());
  });
  replica_comm_.wait(bucket.replica_work, [&] {
    return "gradient all-reduce across replicas of " + layout_.describe_bucket(b, gate_.progress().where());
  });
  bucket.replica_work.reset();
  if (streams_.enabled() && staging_is_transient()) {
    // The staging was allocated on the compute stream: it frees it once
    // the collective that read it is done ([Note: the reduction stream]).
    ReductionStream::wait(on_reduction_stream->original_stream(), streams_.reduction());
    bucket.staging.reset();
  }
  bucket.work.reset();
  bucket.phase = BucketPhase::kRetired;
  in_flight_bytes_ -= bucket.in_flight_bytes;
  bucket.in_flight_bytes = 0;
  if (layout_.ddp_in_place()) {
    return;  // reduced in place
  }
  const double unscale = bucket.result_unscaled ? 1.0 : result_unscale();
  if (bucket.defers) {
    keep_back(bucket, bucket.reduce_out, unscale);
  } else {
    fold_into_accum(bucket, bucket.reduce_out, unscale);
  }
  bucket.reduce_out.reset();
  if (staging_is_transient()) {
    bucket.staging.reset();
  }
}

int64_t GradReducer::residual_bytes() const {
  int64_t bytes = 0;
  for (const auto& bucket : buckets_) {
    bytes += bucket.residual.defined() ? static_cast<int64_t>(bucket.residual.nbytes()) : 0;
    bytes += bucket.replica_residual.defined() ? static_cast<int64_t>(bucket.replica_residual.nbytes()) : 0;
  }
  return bytes;
}

} // namespace zero_ext
