// ParamStore, the fp32 masters and what follows from them: a stage 3
// gather's input cast from the master, the compute copies refreshed after a
// step (asynchronously from pinned memory with offload), stages 1-2's
// all-gather of the updated shards, and the masters gathered whole or loaded
// for checkpoints.
#include "param_store.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace zero_ext {

// [Note: compute shard from the master]
// Stage 3 with fp32 masters on the parameters' device keeps no shard in the
// compute dtype beside the master: each gather casts the master into this
// rank's slot of the (regrown) full buffer and all-gathers in place, as
// FSDP2's copy-in does. That saves 2 bytes per parameter over the ranks
// (bf16), all of it at world size 1, for one cast of the shard per gather.
// Offload keeps the device shard: its master is in host memory.
at::Tensor ParamStore::gather_input(int64_t b) {
  ensure_value(b);  // parked again by after_gather
  BucketValues& values = values_[b];
  if (values.shard.defined()) {
    return values.shard;
  }
  at::NoGradGuard no_grad;
  at::Tensor slot = values.flat.narrow(0, layout_.shard_start(b), layout_.bucket(b).shard);
  slot.copy_(values.master);
  return slot;
}

// [Note: offload refresh]
// Offloaded from an accelerator, the masters (and, with a compute dtype, the
// pinned host_compute shard the fused CPU Adam writes in the same pass) go
// back to the device with asynchronous copies from pinned memory on the
// compute stream, so the host does not wait for them; the next forward is
// queued behind them. An event after the copies guards the sources: the
// host writes them again (the next step, a load) only once it has passed,
// which it has long since done by then unless the device is a whole step
// behind. A compute-dtype cast never runs across devices.
void ParamStore::refresh_compute_copies(bool every_bucket) {
  at::NoGradGuard no_grad;
  // Frozen parameters only: their masters change by a load, which refreshes
  // every bucket, never by a step.
  auto may_be_stale = [&](size_t b) { return every_bucket || layout_.bucket(static_cast<int64_t>(b)).trainable > 0; };
  bool sent = false;
  if (!compute_copy_written_) {
    wait_host_sources_free();
    for (size_t b = 0; b < values_.size(); ++b) {
      BucketValues& values = values_[b];
      if (!values.master.defined() || !values.shard.defined() || !may_be_stale(b) ||
          (value_swapped(static_cast<int64_t>(b)) && !swap_->resident(value_slot_[b]))) {
        continue;  // a parked master refreshed its compute copy as it was parked after its step
      }
      if (values.host_compute.defined()) {
        values.host_compute.copy_(values.master);  // cast on the host, into pinned memory
      } else {
        const bool pinned_same_dtype = values.master.is_pinned() && values.master.dtype() == values.shard.dtype();
        values.shard.copy_(values.master, /*non_blocking=*/pinned_same_dtype);
        sent = sent || pinned_same_dtype;
      }
    }
  }
  for (size_t b = 0; b < values_.size(); ++b) {
    if (values_[b].host_compute.defined() && may_be_stale(b)) {
      values_[b].shard.copy_(values_[b].host_compute, /*non_blocking=*/true);
      sent = true;
    }
  }
  if (sent) {
    const c10::Device device = values_[0].flat.device();
    if (!host_sources_sent_.has_value()) {
      host_sources_sent_.emplace(device.type());
    }
    host_sources_sent_->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  }
  compute_copy_written_ = false;
}

void ParamStore::wait_host_sources_free() {
  if (host_sources_sent_.has_value() && !host_sources_sent_->query()) {
    host_sources_sent_->synchronize();
  }
}

void ParamStore::all_gather_updated(const std::function<bool(int64_t)>& touched) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works(values_.size());
  for (size_t b = 0; b < values_.size(); ++b) {
    if (touched(static_cast<int64_t>(b))) {
      works[b] = comm_of(b).all_gather(values_[b].flat, values_[b].shard, Purpose::kStepGather,
                                       static_cast<int64_t>(b));
    }
  }
  for (size_t b = 0; b < values_.size(); ++b) {
    comm_of(b).wait(works[b], [&] {
      return "all-gather of updated parameters of " + layout_.describe_bucket(b, progress_.where());
    });
  }
}

std::vector<at::Tensor> ParamStore::full_masters() {
  std::vector<int64_t> every(layout_.num_buckets());
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) every[b] = b;
  return full_masters_of(every);
}

std::vector<at::Tensor> ParamStore::full_masters_of(const std::vector<int64_t>& buckets) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> full(buckets.size());
  std::vector<c10::intrusive_ptr<c10d::Work>> works(buckets.size());
  for (size_t k = 0; k < buckets.size(); ++k) {
    const int64_t b = buckets[k];
    TORCH_CHECK(b >= 0 && b < layout_.num_buckets(), "zero_ext internal: no bucket ", b);
    BucketValues& values = values_[b];
    ensure_value(b);  // parked again below, once gathered
    at::Tensor shard = values.master.defined() ? values.master : values.shard.to(at::kFloat);
    if (layout_.replicated()) {
      full[k] = shard.clone();  // a snapshot, not the live buffer
      continue;
    }
    shard = shard.to(values.flat.device());
    full[k] = at::empty({layout_.bucket(b).padded}, shard.options());
    works[k] = comm_of(b).all_gather(full[k], shard, Purpose::kMasters, b);
  }
  for (size_t k = 0; k < buckets.size(); ++k) {
    comm_of(buckets[k]).wait(works[k], [&] {
      return "all-gather of master weights of " + layout_.describe_bucket(buckets[k], progress_.where());
    });
    park_value(buckets[k], /*dirty=*/false);
  }
  std::vector<at::Tensor> out;
  for (size_t k = 0; k < buckets.size(); ++k) {
    const BucketShape& shape = layout_.bucket(buckets[k]);
    for (int64_t i = shape.first; i < shape.first + shape.count; ++i) {
      out.push_back(full[k].narrow(0, layout_.offset(i), layout_.numel(i)).view(params_[i].sizes()));
    }
  }
  return out;
}

void ParamStore::load_masters(const std::vector<at::Tensor>& full_params) {
  TORCH_INTERNAL_ASSERT(full_params.size() == params_.size(), "one tensor per parameter");
  at::NoGradGuard no_grad;
  wait_host_sources_free();
  // Bucket by bucket, so swapped values come into memory one at a time.
  std::vector<std::vector<const ShardPiece*>> pieces_of_bucket(values_.size());
  const std::vector<ShardPiece> pieces = layout_.local_pieces();
  for (const ShardPiece& piece : pieces) pieces_of_bucket[piece.bucket].push_back(&piece);
  for (size_t b = 0; b < values_.size(); ++b) {
    BucketValues& values = values_[b];
    if (!values.master.defined()) continue;
    ensure_value(static_cast<int64_t>(b));
    for (const ShardPiece* piece : pieces_of_bucket[b]) {
      values.master.narrow(0, piece->shard_offset, piece->length)
          .copy_(full_params[piece->param].reshape(-1).narrow(0, piece->param_start, piece->length));
    }
    if (values.shard.defined()) {
      values.shard.copy_(values.master);
    }  // else the next gather casts the new master
    park_value(static_cast<int64_t>(b), /*dirty=*/true);
  }
}

std::vector<at::Tensor> ParamStore::local_value_shards() const {
  std::vector<at::Tensor> out;
  for (const auto& values : values_) {
    out.push_back(values.master.defined() ? values.master : values.shard);
  }
  return out;
}

} // namespace zero_ext
