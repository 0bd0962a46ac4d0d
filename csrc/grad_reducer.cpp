#include "grad_reducer.h"

#include <exception>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/variable.h>

#include "storage_release.h"

namespace zero_ext {
namespace {

bool same_memory(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() &&
         a.strides() == b.strides();
}

} // namespace

GradReducer::GradReducer(const Layout& layout, ParamStore& store, Communicator& comm,
                         const StepGate& gate, std::optional<c10::ScalarType> reduce_dtype)
    : layout_(layout), store_(store), comm_(comm), gate_(gate),
      reduce_dtype_(reduce_dtype.value_or(at::kFloat)) {
  TORCH_INTERNAL_ASSERT(reduce_dtype_ == at::kFloat || reduce_dtype_ == at::kBFloat16 || reduce_dtype_ == at::kHalf,
                        "gradients are reduced in float32, bfloat16 or float16");
  at::NoGradGuard no_grad;
  const int64_t n_params = layout_.num_params();
  buckets_.resize(layout_.num_buckets());
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    const BucketShape& shape = layout_.bucket(b);
    BucketGrads& bucket = buckets_[b];
    const auto options = store_.bucket(b).flat.options();
    if (layout_.ddp_in_place()) {
      bucket.staging = at::zeros({shape.padded}, options);
    } else if (!layout_.transient_staging()) {
      bucket.staging = at::zeros({shape.padded}, options.dtype(reduce_dtype_));
    }
    if (!layout_.ddp_in_place() && shape.trainable > 0) {
      bucket.accum = store_.offload() ? at::zeros({shape.shard}, host_fp32(options.device()))
                                      : at::zeros({shape.shard}, options.dtype(at::kFloat));
    }
  }
  if (layout_.ddp_in_place()) {
    for (int64_t i = 0; i < n_params; ++i) {
      grad_views_.push_back(staging_region(layout_.bucket_of(i), i));
    }
  }
  for (const ShardPiece& piece : layout_.segments()) {
    at::Tensor grad = buckets_[piece.bucket].accum.narrow(0, piece.shard_offset, piece.length);
    if (layout_.replicated()) {
      grad = grad.view(store_.param(piece.param).sizes());
    }
    segment_grads_.push_back(grad);
  }
  stand_ins_.resize(n_params);
  for (int64_t i = 0; i < n_params; ++i) {
    if (layout_.trainable(i) && !layout_.ddp_in_place()) {
      stand_ins_[i] = unreadable_like(
          store_.param(i),
          "zero_ext: the gradient of '" + layout_.name(i) + "' is sharded over the ranks (stage " +
              std::to_string(layout_.stage()) + ") and lives in the optimizer, so param.grad holds no data. "
              "Clip with zero_ext.clip_grad_norm_(model.parameters(), max_norm) (torch.nn.utils."
              "clip_grad_norm_ cannot see sharded gradients); read full gradients with "
              "zero_ext.full_grads(model).");
    }
  }
  arrived_.assign(n_params, 0);
  detached_.assign(n_params, 0);
  local_has_grad_.assign(n_params, 0);
  global_has_grad_.assign(n_params, 0);
  start_round();
}

at::Tensor GradReducer::staging_region(int64_t b, int64_t i) {
  return buckets_[b].staging.narrow(0, layout_.offset(i), layout_.numel(i)).view(layout_.shape(i));
}

void GradReducer::ensure_staging(int64_t b) {
  if (!buckets_[b].staging.defined()) {
    buckets_[b].staging = at::empty({layout_.bucket(b).padded}, store_.bucket(b).flat.options().dtype(reduce_dtype_));
  }
}

void GradReducer::start_round() {
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    buckets_[b].waiting = layout_.bucket(b).trainable;
    buckets_[b].phase = BucketPhase::kFilling;
  }
  std::fill(arrived_.begin(), arrived_.end(), 0);
  next_launch_ = 0;
  late_ = false;
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
      // param.grad was None or replaced: it holds the whole accumulated value.
      view.copy_(grad);
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
  launch_ready_buckets();
  return b;
}

void GradReducer::launch_ready_buckets() {
  while (next_launch_ < layout_.num_buckets() && buckets_[next_launch_].waiting == 0) {
    launch(next_launch_++);
  }
}

void GradReducer::flush() {
  // Unused parameters contribute zeros, so the sequence of collectives is
  // the same on every rank.
  for (int64_t b = next_launch_; b < layout_.num_buckets(); ++b) {
    launch(b);
  }
  next_launch_ = layout_.num_buckets();
  wait_all();
}

void GradReducer::rerun_all() {
  start_round();  // every parameter counts as not arrived: pending grads are flushed
  flush();
}

void GradReducer::launch(int64_t b) {
  const BucketShape& shape = layout_.bucket(b);
  BucketGrads& bucket = buckets_[b];
  at::NoGradGuard no_grad;
  if (shape.trainable == 0) {
    bucket.phase = BucketPhase::kRetired;  // frozen parameters only (stage 3): nothing to reduce
    return;
  }
  if (layout_.ddp_in_place()) {
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
  } else {
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
    if (shape.padded > shape.numel) {
      bucket.staging.narrow(0, shape.numel, shape.padded - shape.numel).zero_();
    }
  }
  // Pre-divide (gloo has no AVG/PREMUL_SUM everywhere), and remove the loss
  // scale in the same pass unless the reduction runs in fp16, whose range
  // the scale is there to use.
  const LossScaler& scaler = gate_.scaler();
  double divisor = static_cast<double>(comm_.size());
  if (scaler.enabled() && reduce_dtype_ != at::kHalf) {
    divisor *= scaler.scale();
  }
  if (divisor != 1.0) {
    bucket.staging.div_(divisor);
  }
  if (layout_.ddp_in_place()) {
    bucket.work = comm_.all_reduce_sum(bucket.staging);
  } else if (layout_.replicated()) {
    bucket.reduce_out = bucket.staging;
    bucket.work = comm_.all_reduce_sum(bucket.staging);
  } else if (comm_.distributed() && bucket.staging.device().is_cpu()) {
    // Gloo runs a reduce-scatter as an all-reduce plus a copy made inside
    // wait(), where no bounded wait (see communicator.h) can see it finish.
    // The same all-reduce issued here, in place, then read at this rank's shard.
    bucket.reduce_out = bucket.staging.narrow(0, layout_.shard_start(b), shape.shard);
    bucket.work = comm_.all_reduce_sum(bucket.staging);
  } else {
    const bool direct = !bucket.accum_has_value && bucket.accum.dtype() == bucket.staging.dtype() &&
                        bucket.accum.device() == bucket.staging.device();
    bucket.reduce_out = direct ? bucket.accum : at::empty({shape.shard}, bucket.staging.options());
    bucket.work = comm_.reduce_scatter_sum(bucket.reduce_out, bucket.staging);
  }
  bucket.phase = BucketPhase::kInFlight;
  in_flight_.push_back(b);
  retire_completed();
}

void GradReducer::retire_completed() {
  if (!layout_.transient_staging()) {
    return;  // only stages 2-3 free anything at retirement
  }
  while (!in_flight_.empty() &&
         (!buckets_[in_flight_.front()].work || buckets_[in_flight_.front()].work->isCompleted())) {
    retire(in_flight_.front());
    in_flight_.pop_front();
  }
}

void GradReducer::wait_all() {
  while (!in_flight_.empty()) {
    retire(in_flight_.front());
    in_flight_.pop_front();
  }
  finish_host_adds();
}

void GradReducer::retire(int64_t b) {
  at::NoGradGuard no_grad;
  BucketGrads& bucket = buckets_[b];
  comm_.wait(bucket.work, [&] {
    return "gradient reduction of " + layout_.describe_bucket(b, gate_.progress().where());
  });
  bucket.work.reset();
  bucket.phase = BucketPhase::kRetired;
  if (layout_.ddp_in_place()) {
    return;  // reduced in place
  }
  // Reduced in fp16 while still scaled (to use fp16's range); the scale is
  // divided out in fp32, as the result is added into the accumulator.
  const LossScaler& scaler = gate_.scaler();
  const double unscale = scaler.enabled() && reduce_dtype_ == at::kHalf ? 1.0 / scaler.scale() : 1.0;
  fold_into_accum(bucket, bucket.reduce_out, unscale);
  bucket.reduce_out.reset();
  if (layout_.transient_staging()) {
    bucket.staging.reset();
  }
}

void GradReducer::fold_into_accum(BucketGrads& bucket, const at::Tensor& reduced, double factor) {
  if (reduced.is_same(bucket.accum)) {
    TORCH_INTERNAL_ASSERT(factor == 1.0, "an fp32 reduction is unscaled before it runs");
  } else if (reduced.device() == bucket.accum.device()) {
    if (bucket.accum_has_value) {
      bucket.accum.add_(reduced, factor);
    } else {
      bucket.accum.copy_(reduced);
      if (factor != 1.0) bucket.accum.mul_(factor);
    }
  } else if (!bucket.accum_has_value) {
    // Offload from an accelerator: the first result lands directly in the
    // pinned accumulator, asynchronously; finish_host_adds() waits for it.
    bucket.accum.copy_(reduced, /*non_blocking=*/true);
    bucket.host_factor = factor;
    host_transfers_pending_ = true;
  } else {
    // Later ones land next to it and are added on the host.
    if (!bucket.host_landing.defined()) {
      bucket.host_landing = at::empty({bucket.accum.numel()}, host_fp32(reduced.device()));
    }
    bucket.host_landing.copy_(reduced, /*non_blocking=*/true);
    bucket.host_add_pending = true;
    bucket.host_factor = factor;
    host_transfers_pending_ = true;
  }
  bucket.accum_has_value = true;
}

void GradReducer::finish_host_adds() {
  if (!host_transfers_pending_) {
    return;
  }
  const c10::Device device = store_.device();
  c10::impl::VirtualGuardImpl guard(device.type());
  guard.synchronizeStream(guard.getStream(device));  // the device-to-host copies are done
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    if (bucket.host_add_pending) {
      bucket.accum.add_(bucket.host_landing, bucket.host_factor);
    } else if (bucket.host_factor != 1.0) {
      bucket.accum.mul_(bucket.host_factor);  // a first result, landed scaled
    }
    bucket.host_add_pending = false;
    bucket.host_factor = 1.0;
  }
  host_transfers_pending_ = false;
}

at::Tensor GradReducer::local_nonfinite() const {
  // One read of the local shards: a sum is finite iff its terms are (short
  // of a finite overflow at ~1e38, which is no usable gradient either).
  std::vector<at::Tensor> sums;
  for (const auto& bucket : buckets_) {
    if (layout_.ddp_in_place() && bucket.staging.defined()) {
      sums.push_back(bucket.staging.sum());  // already all-reduced: the same on every rank
    } else if (bucket.accum.defined() && bucket.accum_has_value) {
      sums.push_back(bucket.accum.sum());
    }
  }
  if (sums.empty()) {
    return at::zeros({}, at::TensorOptions().dtype(at::kFloat));
  }
  return at::logical_not(at::isfinite(at::stack(sums).sum())).to(at::kFloat);
}

void GradReducer::mark_nonfinite_everywhere() {
  if (layout_.ddp_in_place()) {
    return;  // the all-reduce already spread it
  }
  // Under DDP the all-reduce spreads an inf to every rank's gradient. NaN in
  // one element of this rank's shard does the same, so a local check
  // (torch.amp.GradScaler's unscale_, say) decides alike on every rank.
  const auto& pieces = layout_.segments();
  for (size_t s = 0; s < segment_grads_.size(); ++s) {
    if (global_has_grad_[pieces[s].param] && segment_grads_[s].numel() > 0) {
      segment_grads_[s].reshape(-1).narrow(0, 0, 1).fill_(std::numeric_limits<double>::quiet_NaN());
      return;
    }
  }
}

void GradReducer::publish() {
  const int64_t n = layout_.num_params();
  if (layout_.ddp_in_place()) {
    for (int64_t i = 0; i < n; ++i) {
      store_.param(i).mutable_grad() = global_has_grad_[i] ? grad_views_[i] : at::Tensor();
      detached_[i] = 0;
    }
    return;
  }
  const auto& pieces = layout_.segments();
  const auto& segments = store_.segments();
  for (size_t s = 0; s < segments.size(); ++s) {
    segments[s].mutable_grad() = global_has_grad_[pieces[s].param] ? segment_grads_[s] : at::Tensor();
  }
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor& grad = store_.param(i).mutable_grad();
    if (layout_.trainable(i) && !grad.defined() && global_has_grad_[i]) {
      grad = stand_ins_[i];
    }
  }
}

bool GradReducer::holds_stand_in(int64_t i) const {
  const at::Tensor& grad = store_.param(i).grad();
  return grad.defined() && stand_ins_[i].defined() &&
         grad.unsafeGetTensorImpl() == stand_ins_[i].unsafeGetTensorImpl();
}

bool GradReducer::holds_stray_grad(int64_t i) const {
  const at::Tensor& grad = store_.param(i).grad();
  return layout_.ddp_in_place() ? grad.defined() && !same_memory(grad, grad_views_[i])
                                : grad.defined() && !holds_stand_in(i);
}

void GradReducer::check_no_unreduced_grads() const {
  if (layout_.ddp_in_place()) {
    return;
  }
  for (int64_t i = 0; i < layout_.num_params(); ++i) {
    TORCH_CHECK(!(layout_.trainable(i) && holds_stray_grad(i)), "zero_ext: parameter '", layout_.name(i),
                "' holds a gradient in .grad that did not pass zero_ext's reduction "
                "(was .grad assigned by hand during backward?). In stages 1-2 gradients "
                "live in the optimizer's shards; use zero_ext.full_grads(model) to read them.");
  }
}

void GradReducer::zero_grad(bool set_to_none) {
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    if (layout_.ddp_in_place()) {
      bucket.staging.zero_();
    } else {
      bucket.accum_has_value = false;
      if (!set_to_none && bucket.accum.defined()) {
        bucket.accum.zero_();
      }
    }
  }
  for (int64_t i = 0; i < layout_.num_params(); ++i) {
    at::Tensor& grad = store_.param(i).mutable_grad();
    if (set_to_none) {
      grad = at::Tensor();
    } else if (layout_.ddp_in_place() && global_has_grad_[i]) {
      grad = grad_views_[i];
    } else if (grad.defined() && !holds_stand_in(i)) {
      grad.zero_();
    }
  }
  if (set_to_none) {
    std::fill(local_has_grad_.begin(), local_has_grad_.end(), 0);
    std::fill(global_has_grad_.begin(), global_has_grad_.end(), 0);
    for (const auto& segment : store_.segments()) {
      segment.mutable_grad() = at::Tensor();
    }
  }
}

void GradReducer::forget_accumulated() {
  for (auto& bucket : buckets_) {
    bucket.accum_has_value = false;
  }
}

std::exception_ptr GradReducer::abandon(bool wait) {
  std::exception_ptr failure;
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    BucketGrads& bucket = buckets_[b];
    if (wait && bucket.work) {
      try {
        comm_.wait(bucket.work, [] { return std::string("reduction abandoned by a failed backward"); });
      } catch (...) {
        failure = failure ? failure : std::current_exception();
      }
    }
    bucket.work.reset();
    bucket.reduce_out.reset();
    bucket.host_add_pending = false;
    bucket.host_factor = 1.0;
  }
  in_flight_.clear();
  host_transfers_pending_ = false;
  if (layout_.ddp_in_place()) {
    publish();  // param.grad views the buffers again
  }
  std::fill(detached_.begin(), detached_.end(), 0);
  start_round();
  return failure;
}

std::vector<at::Tensor> GradReducer::full_grads() {
  at::NoGradGuard no_grad;
  const int64_t n = layout_.num_params();
  std::vector<at::Tensor> out(n);
  if (layout_.ddp_in_place()) {
    for (int64_t i = 0; i < n; ++i) {
      out[i] = grad_views_[i].to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    }
    return out;
  }
  const int64_t n_buckets = layout_.num_buckets();
  std::vector<at::Tensor> full(n_buckets);
  std::vector<c10::intrusive_ptr<c10d::Work>> works(n_buckets);
  for (int64_t b = 0; b < n_buckets; ++b) {
    const BucketShape& shape = layout_.bucket(b);
    BucketGrads& bucket = buckets_[b];
    if (shape.trainable == 0) {
      full[b] = at::zeros({shape.padded}, store_.bucket(b).flat.options().dtype(at::kFloat));
      continue;
    }
    at::Tensor shard = bucket.accum_has_value ? bucket.accum : at::zeros_like(bucket.accum);
    if (layout_.replicated()) {
      full[b] = shard.clone();  // a snapshot, not the live buffer
      continue;
    }
    shard = shard.to(store_.bucket(b).flat.device());  // offloaded: collectives run on the device
    full[b] = at::empty({shape.padded}, shard.options());
    works[b] = comm_.all_gather(full[b], shard);
  }
  for (int64_t b = 0; b < n_buckets; ++b) {
    comm_.wait(works[b], [&] {
      return "all-gather of gradients for full_grads() of " + layout_.describe_bucket(b, gate_.progress().where());
    });
  }
  for (int64_t i = 0; i < n; ++i) {
    out[i] = full[layout_.bucket_of(i)].narrow(0, layout_.offset(i), layout_.numel(i)).view(layout_.shape(i));
  }
  return out;
}

int64_t GradReducer::grad_bytes() const {
  int64_t bytes = 0;
  for (const auto& bucket : buckets_) {
    if (bucket.staging.defined()) bytes += bucket.staging.nbytes();
    if (bucket.accum.defined()) bytes += bucket.accum.nbytes();
  }
  return bytes;
}

int64_t GradReducer::host_bytes() const {
  int64_t bytes = 0;
  for (const auto& bucket : buckets_) {
    if (store_.offload() && bucket.accum.defined()) bytes += bucket.accum.nbytes();
    if (bucket.host_landing.defined()) bytes += bucket.host_landing.nbytes();
  }
  return bytes;
}

int64_t GradReducer::host_landing_buffers() const {
  int64_t n = 0;
  for (const auto& bucket : buckets_) n += bucket.host_landing.defined() ? 1 : 0;
  return n;
}

} // namespace zero_ext
