// GradReducer, the way out: folding reductions into the fp32 accumulators
// (on the device, or landed on the host with offload), non-finite checks,
// publishing the .grad the optimizer steps, zero_grad and full gradients.
// Arrival and reduction are in grad_reducer.cpp; accumulators kept in an
// offload file (offload_optimizer="nvme") in grad_accumulators_swap.cpp.
#include "grad_reducer.h"

#include <algorithm>
#include <exception>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/variable.h>

#include "storage_release.h"
#include "reusable_blocks.h"

namespace zero_ext {

// [Note: accumulator memory]
// zero_grad(set_to_none=True) frees each fp32 gradient shard, as plain
// PyTorch frees .grad: between steps (and at the forward's activation peak)
// a rank then holds no gradient memory. The storage is shrunk in place
// ([Note: release by resize]) so the segment views the optimizer reads stay
// the same tensors; the first write of the next round grows it back. The
// caching allocator hands the same block back on an accelerator; offload
// keeps its pinned host accumulators (pinning is what costs there).
void GradReducer::ensure_accum_memory(BucketGrads& bucket) {
  if (bucket.swap_slot >= 0) {  // [Note: swapped gradients]
    if (bucket.accum_has_value) {
      swap_->ensure(bucket.swap_slot);
    } else {
      swap_->ensure_memory(bucket.swap_slot);
    }
    return;
  }
  if (bucket.accum.defined() && storage_is_released(bucket.accum)) {
    grow_storage(bucket.accum, bucket.accum.numel() * bucket.accum.element_size(),
                 growth_allocator(bucket.accum.storage()));  // [Note: reusable host blocks]
    bucket.accum_has_value = false;
  }
}

void GradReducer::hold_value(BucketGrads& bucket) {
  if (bucket.swap_slot >= 0 && bucket.accum_has_value) {
    swap_->ensure(bucket.swap_slot);  // the caller writes and parks it
  }
  if (!bucket.accum_has_value) {
    ensure_accum_memory(bucket);
    bucket.accum.zero_();
    bucket.accum_has_value = true;  // a mark written now is added to, not copied over, by later folds
  }
}

void GradReducer::zero_if_released(BucketGrads& bucket) {
  if (bucket.accum.defined() && storage_is_released(bucket.accum)) {
    ensure_accum_memory(bucket);  // no reduction reached it since zero_grad: nothing accumulated
    bucket.accum.zero_();
  }
}

void GradReducer::fold_into_accum(BucketGrads& bucket, const at::Tensor& reduced, double factor) {
  ensure_accum_memory(bucket);
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
    note_host_copy(reduced);
    bucket.accum.copy_(reduced, /*non_blocking=*/true);
    bucket.host_factor = factor;
    host_transfers_pending_ = true;
  } else {
    // Later ones land next to it and are added on the host.
    if (!bucket.host_landing.defined()) {
      bucket.host_landing = at::empty({bucket.accum.numel()}, host_fp32(reduced.device()));
    }
    note_host_copy(reduced);
    bucket.host_landing.copy_(reduced, /*non_blocking=*/true);
    bucket.host_add_pending = true;
    bucket.host_factor = factor;
    host_transfers_pending_ = true;
  }
  bucket.accum_has_value = true;
  if (bucket.swap_slot >= 0) {
    swapped_sums_.push_back(reduced.sum().to(at::kFloat).reshape({}));  // for local_nonfinite, without reading the file
    swap_->park(bucket.swap_slot, /*dirty=*/true);
  }
}

// [Note: offload without a host sync in backward]
// An offloaded reduction is copied to pinned host memory asynchronously on
// the stream it retires on, and an event is recorded after the copy. The
// host adds and scales the landed results only when something reads the
// host gradients: settle() (the step, clip, full_grads, zero_grad) or the
// next backward's first landing, which reuses the buffers. By then the event
// has normally passed, so it is queried, not waited on. The non-finite check
// of the round reads device-side sums of the reduced results, taken before
// the copies (local_nonfinite), so nothing in backward waits for the host.
void GradReducer::note_host_copy(const at::Tensor& reduced) {
  if (host_round_closed_) {
    finish_host_adds();  // the last round's results are added before this round reuses the buffers
  }
  round_device_sums_.push_back(reduced.sum(at::kFloat));
  const c10::Stream stream = c10::impl::VirtualGuardImpl(reduced.device().type()).getStream(reduced.device());
  if (host_copy_stream_.has_value() && *host_copy_stream_ != stream) {
    host_copies_on_several_streams_ = true;
  }
  host_copy_stream_ = stream;
}

void GradReducer::close_host_round() {
  if (!host_transfers_pending_ || host_round_closed_) {
    return;
  }
  if (!host_copies_on_several_streams_ && host_copy_stream_.has_value()) {
    if (!host_copies_done_.has_value()) {
      host_copies_done_.emplace(host_copy_stream_->device_type());
    }
    host_copies_done_->record(*host_copy_stream_);
  }
  host_round_closed_ = true;
}

void GradReducer::finish_host_adds() {
  if (!host_transfers_pending_) {
    return;
  }
  const bool one_event = host_round_closed_ && !host_copies_on_several_streams_ && host_copies_done_.has_value();
  if (one_event) {
    if (!host_copies_done_->query()) {
      host_copies_done_->synchronize();  // the device is behind: the landed values are needed now
    }
  } else {
    const c10::Device device = store_.device();
    c10::impl::VirtualGuardImpl guard(device.type());
    guard.synchronizeDevice(device.index());  // copies on several streams, or a round broken off
  }
  host_round_closed_ = false;
  host_copies_on_several_streams_ = false;
  host_copy_stream_.reset();
  round_device_sums_.clear();  // those rounds were checked at their epilogues
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

void GradReducer::keep_back(BucketGrads& bucket, const at::Tensor& reduced, double factor) {
  // On the stream the reduction ran on, like the results it sums
  // ([Note: deferred replica all-reduce]).
  if (!bucket.unsynced.defined()) {
    bucket.unsynced = reduced.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);  // never a view of staging
    if (factor != 1.0) bucket.unsynced.mul_(factor);
  } else {
    bucket.unsynced.add_(reduced, factor);
  }
}

bool GradReducer::has_deferred() const {
  return std::any_of(buckets_.begin(), buckets_.end(), [](const BucketGrads& b) { return b.unsynced.defined(); });
}

void GradReducer::sync_deferred() {
  at::NoGradGuard no_grad;
  std::optional<c10::StreamGuard> on_reduction_stream;
  if (streams_.enabled()) {
    streams_.reduction_waits_for_compute();
    on_reduction_stream.emplace(streams_.reduction());
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    BucketGrads& bucket = buckets_[b];
    if (!bucket.unsynced.defined()) continue;
    if (replica_comm_.quantized_all_reduce_pays(bucket.unsynced, grad_format_)) {  // [Note: quantized collectives]
      if (!bucket.replica_residual.defined()) {
        bucket.replica_residual = at::zeros({bucket.unsynced.numel()}, bucket.unsynced.options().dtype(at::kFloat));
      }
      works[b] = replica_comm_.quantized_all_reduce_sum(bucket.unsynced, grad_format_, bucket.replica_residual,
                                                        Purpose::kDeferredSync, static_cast<int64_t>(b));
    } else {
      works[b] = replica_comm_.all_reduce_sum(bucket.unsynced, Purpose::kDeferredSync, static_cast<int64_t>(b));
    }
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    BucketGrads& bucket = buckets_[b];
    if (!bucket.unsynced.defined()) continue;
    replica_comm_.wait(works[b], [&] {
      return "all-reduce across replicas of deferred gradients of " +
             layout_.describe_bucket(static_cast<int64_t>(b), gate_.progress().where());
    });
    fold_into_accum(bucket, bucket.unsynced, 1.0);
    bucket.unsynced.reset();
  }
  close_host_round();
  finish_host_adds();  // offload: the host gradients are read next
  if (streams_.enabled()) {
    streams_.compute_waits_for_reduction();
  }
}

at::Tensor GradReducer::local_nonfinite() const {
  // One read of the local shards: a sum is finite iff its terms are (short
  // of a finite overflow at ~1e38, which is no usable gradient either).
  std::vector<at::Tensor> sums;
  if (!round_device_sums_.empty() || (store_.offload() && !store_.device().is_cpu())) {
    // Offload from an accelerator: this round's results, on the device
    // ([Note: offload without a host sync in backward]); earlier rounds were
    // checked at their own epilogues.
    sums = round_device_sums_;
  } else {
    for (const auto& bucket : buckets_) {
      if (layout_.ddp_in_place() && bucket.staging.defined()) {
        sums.push_back(bucket.staging.sum());  // already all-reduced: the same on every rank
      } else if (bucket.accum.defined() && bucket.accum_has_value && bucket.swap_slot < 0) {
        sums.push_back(bucket.accum.sum());
      }
    }
    sums.insert(sums.end(), swapped_sums_.begin(), swapped_sums_.end());
  }
  for (const auto& bucket : buckets_) {
    if (bucket.unsynced.defined()) {
      sums.push_back(bucket.unsynced.sum());  // kept back from the replicas, in this rank's shard
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
      BucketGrads& bucket = buckets_[pieces[s].bucket];
      hold_value(bucket);
      segment_grads_[s].reshape(-1).narrow(0, 0, 1).fill_(std::numeric_limits<double>::quiet_NaN());
      if (bucket.swap_slot >= 0) {
        swapped_sums_.push_back(at::full({}, std::numeric_limits<double>::quiet_NaN(), at::kFloat));
        swap_->park(bucket.swap_slot, /*dirty=*/true);
      }
      return;
    }
  }
}

void GradReducer::publish(bool provisional) {
  const int64_t n = layout_.num_params();
  auto has_grad = [&](int64_t i) { return provisional ? layout_.trainable(i) : global_has_grad_[i] != 0; };
  if (layout_.ddp_in_place()) {
    for (int64_t i = 0; i < n; ++i) {
      at::Tensor& grad = store_.param(i).mutable_grad();
      if (provisional && detached_[i] && grad.defined() && !same_memory(grad, grad_views_[i])) {
        continue;  // a late gradient: added to its view when the next round takes it
      }
      grad = has_grad(i) ? grad_views_[i] : at::Tensor();
      detached_[i] = 0;
    }
    return;
  }
  const auto& pieces = layout_.segments();
  const auto& segments = store_.segments();
  for (auto& bucket : buckets_) {
    if (bucket.swap_slot < 0) zero_if_released(bucket);
  }
  for (size_t s = 0; s < segments.size(); ++s) {
    // Swapped: an unreadable stand-in until the step brings the bucket in (ensure_grads).
    const at::Tensor& grad = buckets_[pieces[s].bucket].swap_slot >= 0 ? segment_stand_ins_[s] : segment_grads_[s];
    segments[s].mutable_grad() = has_grad(pieces[s].param) ? grad : at::Tensor();
  }
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor& grad = store_.param(i).mutable_grad();
    if (layout_.trainable(i) && !grad.defined() && has_grad(i)) {
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

bool GradReducer::adopt_written_grads() {
  bool found = false;
  for (int64_t i = 0; i < layout_.num_params(); ++i) {
    if (layout_.trainable(i) && holds_stray_grad(i)) {
      local_has_grad_[i] = 1;
      found = true;
    }
  }
  if (found) unsynced_since_reduce_ = true;
  return found;
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

void GradReducer::mark_nonfinite_on_device(const at::Tensor& flag) {
  if (layout_.ddp_in_place()) {
    return;  // the all-reduce already spread it
  }
  if (host_transfers_pending_) {
    return;  // host gradients still landing: marked at settle (mark_nonfinite_everywhere)
  }
  at::NoGradGuard no_grad;
  if (swap_ != nullptr && !flag.gt(0).any().item<bool>()) {
    return;  // on the host anyway: no bucket read back from the file to add a zero
  }
  const auto& pieces = layout_.segments();
  for (size_t s = 0; s < segment_grads_.size(); ++s) {
    if (layout_.trainable(pieces[s].param) && segment_grads_[s].numel() > 0) {
      BucketGrads& bucket = buckets_[pieces[s].bucket];
      hold_value(bucket);
      const at::Tensor& target = segment_grads_[s];
      const at::Tensor poison = at::where(flag.gt(0), std::numeric_limits<double>::quiet_NaN(), 0.0).to(at::kFloat);
      target.reshape(-1).narrow(0, 0, 1).add_(poison.to(target.device()));
      if (bucket.swap_slot >= 0) {
        swapped_sums_.push_back(poison.sum().reshape({}));
        swap_->park(bucket.swap_slot, /*dirty=*/true);
      }
      return;
    }
  }
}

void GradReducer::zero_grad(bool set_to_none) {
  finish_host_adds();  // the host accumulators are written below
  swapped_sums_.clear();
  unsynced_since_reduce_ = false;  // what no_sync() accumulated is dropped
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    bucket.unsynced.reset();
    if (layout_.ddp_in_place()) {
      // set_to_none: no param.grad views the staging until the next flush,
      // which writes every slot (a copy, or zeros for a parameter with no
      // gradient; the padding between slots stays zero): a memset of every
      // bucket per step saved, which plain PyTorch does not pay either.
      if (set_to_none) {
        bucket.staging_stale = true;
      } else {
        bucket.staging.zero_();
        bucket.staging_stale = false;
      }
    } else {
      bucket.accum_has_value = false;
      if (!bucket.accum.defined()) {
        continue;
      }
      if (bucket.swap_slot >= 0) {
        swap_->discard(bucket.swap_slot);  // the next fold writes it whole
        continue;
      }
      if (!set_to_none) {
        ensure_accum_memory(bucket);
        bucket.accum.zero_();
      } else if (!store_.offload()) {
        release_storage(bucket.accum);  // [Note: accumulator memory]
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
  swapped_sums_.clear();
  for (auto& bucket : buckets_) {
    bucket.accum_has_value = false;
    bucket.unsynced.reset();
  }
}

std::exception_ptr GradReducer::abandon(bool wait) {
  std::exception_ptr failure;
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    BucketGrads& bucket = buckets_[b];
    // A replica all-reduce not issued yet stays unissued: this rank's
    // sequence is broken anyway, and its peers fail or diagnose the stall.
    for (auto [work, comm] : {std::make_pair(bucket.work, &comm_of(b)), std::make_pair(bucket.replica_work, &replica_comm_)}) {
      if (wait && work) {
        try {
          comm->wait(work, [] { return std::string("reduction abandoned by a failed backward"); });
        } catch (...) {
          failure = failure ? failure : std::current_exception();
        }
      }
      if (work && !work->isCompleted()) {
        dropped_.push_back({work, {bucket.staging, bucket.reduce_out}});
      }
    }
    if (bucket.staging.defined() && bucket.staging.is_same(bucket.accum) && !bucket.accum_has_value) {
      bucket.accum.zero_();  // staged into the accumulator ([Note: one rank's staging is its accumulator])
    }
    if (staging_is_transient()) {
      bucket.staging.reset();  // the round's partial gradients go (a dropped entry may still hold it)
    }
    bucket.work.reset();
    bucket.replica_work.reset();
    bucket.replica_pending = false;
    bucket.reduce_out.reset();
    // Kept-back results go too, on every rank: whether this round's share
    // was folded in already depends on timing, so keeping them could leave
    // ranks with different buckets to send ([Note: deferred replica all-reduce]).
    bucket.unsynced.reset();
    bucket.in_flight_bytes = 0;
    bucket.host_add_pending = false;
    bucket.host_factor = 1.0;
  }
  in_flight_.clear();
  in_flight_bytes_ = 0;
  filling_staging_bytes_ = 0;
  if (streams_.enabled()) {
    streams_.compute_waits_for_reduction();  // what the compute stream frees next was last used there
  }
  if (host_transfers_pending_) {
    // Copies into pinned memory may be in flight: the host writes it next.
    c10::impl::VirtualGuardImpl guard(store_.device().type());
    guard.synchronizeDevice(store_.device().index());
  }
  host_transfers_pending_ = false;
  host_round_closed_ = false;
  host_copies_on_several_streams_ = false;
  host_copy_stream_.reset();
  round_device_sums_.clear();
  if (layout_.ddp_in_place()) {
    publish(/*provisional=*/false);  // param.grad views the buffers again
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
    if (bucket.swap_slot >= 0 && bucket.accum_has_value) swap_->ensure(bucket.swap_slot);  // parked below
    at::Tensor shard = bucket.accum_has_value ? bucket.accum : at::zeros({bucket.accum.numel()}, bucket.accum.options());
    if (layout_.replicated()) {
      full[b] = shard.clone();  // a snapshot, not the live buffer
      continue;
    }
    shard = shard.to(store_.bucket(b).flat.device());  // offloaded: collectives run on the device
    full[b] = at::empty({shape.padded}, shard.options());
    works[b] = comm_of(b).all_gather(full[b], shard, Purpose::kFullGrads, b);
  }
  for (int64_t b = 0; b < n_buckets; ++b) {
    comm_of(b).wait(works[b], [&] {
      return "all-gather of gradients for full_grads() of " + layout_.describe_bucket(b, gate_.progress().where());
    });
    if (buckets_[b].swap_slot >= 0) swap_->park(buckets_[b].swap_slot, /*dirty=*/false);
  }
  for (int64_t i = 0; i < n; ++i) {
    out[i] = full[layout_.bucket_of(i)].narrow(0, layout_.offset(i), layout_.numel(i)).view(layout_.shape(i));
  }
  return out;
}

int64_t GradReducer::grad_bytes() const {
  int64_t bytes = 0;
  for (const auto& bucket : buckets_) {
    if (bucket.staging.defined() && !bucket.staging.is_same(bucket.accum)) bytes += bucket.staging.nbytes();
    if (bucket.accum.defined()) bytes += bucket.accum.storage().nbytes();  // 0 when released
    if (bucket.unsynced.defined()) bytes += bucket.unsynced.nbytes();
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
