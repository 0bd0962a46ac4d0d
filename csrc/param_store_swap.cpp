// ParamStore, offload to a file (offload_*="nvme"): the buckets' values
// (fp32 masters, else stage 3 shards) as slots of the model's SwapSpace,
// brought in for a gather or the optimizer's step and parked again.
#include "param_store.h"

#include <cstdint>
#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include "storage_release.h"

namespace zero_ext {

// [Note: persistent small buckets]
// A bucket below the persistence threshold stays in memory: a read costs the
// drive's latency plus bytes over its bandwidth, and below the default
// (128 KiB, measured in docs/mixed-precision-and-offload.md) the latency is
// most of it, so a small unit (the root's norms and position embeddings,
// say) would cost a latency per use for little memory saved. DeepSpeed's
// stage3_param_persistence_threshold.
//
// [Note: swapped values]
// offload_*="nvme": a bucket's value (the fp32 master, else the stage 3
// shard) is a slot of the model's SwapSpace ([Note: swapped buffers]): in
// the file between uses, in memory while a gather reads it (then parked
// clean: nothing written) and while the optimizer steps it (then written
// back). Alone in its group, stage 3 keeps the shard apart from the flat
// buffer here ([Note: one rank's shard is its flat buffer] would keep the
// whole model in memory). While parked, the optimizer's segments view a
// storage of no memory whose data access raises, never the freed buffer.
void ParamStore::enable_swap(SwapSpace& swap, bool params, bool masters, int64_t persist_bytes) {
  at::NoGradGuard no_grad;
  swap_ = &swap;
  value_slot_.assign(values_.size(), -1);
  held_.assign(values_.size(), 0);
  held_dirty_.assign(values_.size(), 0);
  parked_segments_.resize(values_.size());
  bool split = false;
  for (size_t b = 0; b < values_.size(); ++b) {
    BucketValues& values = values_[b];
    const bool wanted = (values.master.defined() && (masters || params)) ||
                        (layout_.params_sharded() && params && values.shard.defined());
    if (!wanted || !values.flat.device().is_cpu()) continue;
    const at::Tensor& candidate = values.master.defined() ? values.master : values.shard;
    if (candidate.numel() * candidate.element_size() < persist_bytes) continue;  // [Note: persistent small buckets]
    if (!values.master.defined() && shard_is_flat(static_cast<int64_t>(b))) {
      values.shard = deferred_ ? at::empty_like(values.flat) : values.flat.clone();
      release_storage(values.flat);
      split = true;
    }
    at::Tensor& value = values.master.defined() ? values.master : values.shard;
    value_slot_[b] = 0;  // set below, once the segments view the split shards
    parked_segments_[b] = unreadable_storage(
        value.device(), value.nbytes(),
        "zero_ext: this tensor is a segment of a parameter shard kept in the offload file (offload_*='nvme'); "
        "it holds its values only during optimizer.step(). Read parameters with zero_ext.full_params(model) "
        "or zero_ext.full_state_dict(model).");
  }
  if (split) build_segments();
  for (size_t b = 0; b < values_.size(); ++b) {
    if (value_slot_[b] < 0) continue;
    at::Tensor& value = values_[b].master.defined() ? values_[b].master : values_[b].shard;
    if (deferred_) release_storage(value);  // no value yet: end_materialize writes it
    value_slot_[b] = swap.add(value, (values_[b].master.defined() ? "the fp32 master of " : "the parameter shard of ") +
                                         layout_.describe_bucket(static_cast<int64_t>(b), ""));
    for (int64_t s : segments_of_bucket_[b]) point_at(segments_[s], parked_segments_[b]);  // open() parks it
  }
}

void ParamStore::ensure_value(int64_t b) {
  if (!value_swapped(b)) return;
  swap_->ensure(value_slot_[b]);
  const at::Tensor& value = values_[b].master.defined() ? values_[b].master : values_[b].shard;
  for (int64_t s : segments_of_bucket_[b]) point_at(segments_[s], value.storage());
}

void ParamStore::park_value(int64_t b, bool dirty) {
  if (!value_swapped(b)) return;
  if (held_[b]) {  // parked by unhold_value, with what changed meanwhile
    held_dirty_[b] = held_dirty_[b] || dirty;
    return;
  }
  for (int64_t s : segments_of_bucket_[b]) point_at(segments_[s], parked_segments_[b]);
  swap_->park(value_slot_[b], dirty);
}

void ParamStore::prefetch_value(int64_t b) {
  if (value_swapped(b)) swap_->prefetch(value_slot_[b]);
}

void ParamStore::after_gather(int64_t b) { park_value(b, /*dirty=*/false); }

void ParamStore::hold_value(int64_t b) {
  if (!value_swapped(b)) return;
  ensure_value(b);
  held_[b] = 1;
}

void ParamStore::unhold_value(int64_t b, bool stepped) {
  if (!value_swapped(b)) return;
  const bool dirty = held_dirty_[b] != 0;
  held_[b] = held_dirty_[b] = 0;
  if (stepped) {
    park_stepped(b);
  } else {
    park_value(b, dirty);
  }
}

void ParamStore::park_stepped(int64_t b) {
  if (!value_swapped(b)) return;
  BucketValues& values = values_[b];
  if (values.master.defined() && values.shard.defined()) {
    at::NoGradGuard no_grad;
    values.shard.copy_(values.master);
  }
  park_value(b, /*dirty=*/true);
}

} // namespace zero_ext
