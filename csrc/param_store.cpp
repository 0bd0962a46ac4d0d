#include "param_store.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "storage_release.h"

namespace zero_ext {

at::TensorOptions host_fp32(const c10::Device& device) {
  auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  return device.is_cpu() ? options : options.pinned_memory(true);
}

ParamStore::ParamStore(std::vector<at::Tensor> params, const Layout& layout, const Mesh& mesh,
                       const Progress& progress, std::optional<c10::ScalarType> compute_dtype,
                       bool offload, bool deferred)
    : layout_(layout), mesh_(mesh), comm_(mesh.shard()), progress_(progress), params_(std::move(params)), offload_(offload), deferred_(deferred) {
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(params_.size()) == layout_.num_params());
  at::NoGradGuard no_grad;
  const int64_t n_buckets = layout_.num_buckets();
  values_.resize(n_buckets);
  materializing_.resize(n_buckets);
  // A copy of `values` in `options`: empty where the values do not exist yet.
  auto copy_of = [deferred](const at::Tensor& values, const at::TensorOptions& options) {
    at::Tensor out = at::empty({values.numel()}, options);
    return deferred ? out : out.copy_(values);
  };
  if (layout_.params_sharded()) {
    released_.resize(params_.size());
  }
  // Masters, the compute copy and (stage 3) the shard of a bucket whose flat
  // buffer holds its values; stage 3 then releases the flat buffer.
  auto keep_what_the_stage_keeps = [&](int64_t b) {
    const BucketShape& shape = layout_.bucket(b);
    BucketValues& values = values_[b];
    const bool fp32 = values.flat.scalar_type() == at::kFloat;
    const bool low_precision = compute_dtype.has_value() && fp32;
    if (low_precision || (offload_ && fp32 && shape.trainable > 0)) {
      // The master shard keeps the fp32 value the optimizer steps.
      at::Tensor mine = values.flat.narrow(0, layout_.shard_start(b), shape.shard);
      values.master = copy_of(mine, offload_ ? host_fp32(mine.device()) : mine.options());
      has_masters_ = true;
      if (offload_ && low_precision && !mine.device().is_cpu()) {
        values.host_compute = at::empty({shape.shard}, values.master.options().dtype(*compute_dtype));
      }
    }
    if (low_precision) {  // parameters compute in the low-precision copy
      values.flat = deferred ? at::zeros({shape.padded}, values.flat.options().dtype(*compute_dtype))
                             : values.flat.to(*compute_dtype);
      for (int64_t i = shape.first; i < shape.first + shape.count; ++i) {
        params_[i].set_data(values.flat.narrow(0, layout_.offset(i), layout_.numel(i)).view(params_[i].sizes()));
      }
    }
    at::Tensor mine = values.flat.narrow(0, layout_.shard_start(b), shape.shard);
    if (!layout_.params_sharded()) {
      values.shard = mine;
      return;
    }
    if (!values.master.defined() || offload_) {
      // [Note: one rank's shard is its flat buffer] Alone in the shard group
      // (world size 1), the shard is the whole bucket: a copy of its own
      // would make every gather a copy into freshly grown memory (6 ms of a
      // 143 ms step on CPU) for no memory saved. The parameters still point
      // at unreadable storage between uses, as on more ranks, and view a
      // copy while gathered for inspection (open_inspection_copy), so that
      // changes made there are discarded unless written back, as on more ranks.
      values.shard = comm_.local() && !values.master.defined() ? mine : copy_of(mine, mine.options());
    }  // else a gather casts the master ([Note: compute shard from the master])
    if (!shard_is_flat(b)) release_storage(values.flat);
    for (int64_t i = shape.first; i < shape.first + shape.count; ++i) {
      released_[i] = unreadable_storage(
          values.flat.device(), (values.flat.storage_offset() + shape.padded) * values.flat.element_size(),
          "zero_ext: parameter '" + layout_.name(i) + "' is sharded (stage 3) and holds no data "
          "outside its unit's forward and backward. Read or change it inside `with "
          "zero_ext.full_params(model):` (collective: every rank enters it; writeback=True "
          "keeps changes), or read zero_ext.full_state_dict(model).");
    }
    point_params(b, /*gathered=*/false);
  };

  std::vector<at::Tensor> to_broadcast;
  for (int64_t b = 0; b < n_buckets; ++b) {
    const BucketShape& shape = layout_.bucket(b);
    const auto options = params_[shape.first].options();
    at::Tensor& flat = values_[b].flat;
    flat = deferred && layout_.params_sharded() ? at::empty({shape.padded}, options)
                                                : at::zeros({shape.padded}, options);
    for (int64_t i = shape.first; i < shape.first + shape.count; ++i) {
      TORCH_INTERNAL_ASSERT(params_[i].dtype() == options.dtype() && params_[i].device() == options.device(),
                            "a bucket mixes dtypes or devices");
      auto view = flat.narrow(0, layout_.offset(i), layout_.numel(i)).view(params_[i].sizes());
      if (!deferred) view.copy_(params_[i].detach());
      params_[i].set_data(view);
    }
    if (deferred) {
      // No values to send yet: lay the bucket out at once, so stage 3 never
      // holds more than one bucket whole here.
      keep_what_the_stage_keeps(b);
    } else {
      to_broadcast.push_back(flat);
    }
  }
  if (!deferred) {
    mesh_.broadcast_from_rank0(to_broadcast, Purpose::kInitBroadcast, {}, [&](size_t b) {
      return "initial broadcast of parameters from rank 0 (" +
             layout_.describe_bucket(static_cast<int64_t>(b), progress_.where()) + ")";
    });
  }
  if (!deferred) {
    for (int64_t b = 0; b < n_buckets; ++b) keep_what_the_stage_keeps(b);
  }

  build_segments();
}

void ParamStore::build_segments() {
  segments_.clear();
  segments_of_bucket_.assign(values_.size(), {});
  // Replicated (stage 0) or in a whole-parameter layout, a segment is a whole
  // parameter and keeps its shape, so optimizers that are not elementwise work.
  for (const ShardPiece& piece : layout_.segments()) {
    segments_of_bucket_[piece.bucket].push_back(static_cast<int64_t>(segments_.size()));
    const BucketValues& values = values_[piece.bucket];
    const at::Tensor& stepped = values.master.defined() ? values.master : values.shard;
    at::Tensor segment = stepped.narrow(0, piece.shard_offset, piece.length);
    if (layout_.segment_is_whole(piece.param)) {
      segment = segment.view(params_[piece.param].sizes());
    }
    segments_.push_back(segment);
  }
}

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

// [Note: deferred initialization]
// A model built on the meta device is wrapped with its buckets laid out but
// holding no values yet; wrap() then initializes it module by module. While a
// bucket is open its parameters view a full buffer in their own dtype (fp32
// where masters exist, so an initializer's values reach the master unrounded):
// the flat buffer itself when it has that dtype (regrown in stage 3), else a
// temporary. Closing broadcasts rank 0's values, keeps this rank's master and
// shard, and points the parameters back at the compute copy (stage 3:
// released). Stage 3 opens one unit at a time besides the root, so no rank
// holds the model whole; the full buffers are zero-filled, so a parameter no
// initializer touches is zero, never garbage.
namespace {

// Points parameter `param` at `view` as set_data does, but keeps its autograd
// accumulator (which zero_ext's hooks are on) although the dtype changes:
// it changes only while wrap() initializes the parameter under no_grad, and
// changes back before any backward can see it.
void retarget(const at::Tensor& param, const at::Tensor& view) {
  param.unsafeGetTensorImpl()->shallow_copy_from(view.getIntrusivePtr());
}

// The same into a storage without memory (stage 3 released), where a view
// could not be made: dtype, storage and offset set directly.
void point_into(const at::Tensor& param, const c10::Storage& storage, caffe2::TypeMeta dtype, int64_t offset) {
  c10::TensorImpl* impl = param.unsafeGetTensorImpl();
  const std::vector<int64_t> sizes = param.sizes().vec();
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * std::max<int64_t>(sizes[d + 1], 1);
  }
  impl->set_storage_and_dtype(storage, dtype);
  impl->set_sizes_and_strides(sizes, strides, offset);
}

} // namespace

void ParamStore::begin_materialize(int64_t b) {
  TORCH_CHECK(!materializing_[b].defined(), "zero_ext internal: bucket ", b, " is already being materialized");
  at::NoGradGuard no_grad;
  const BucketShape& shape = layout_.bucket(b);
  BucketValues& values = values_[b];
  const auto own_dtype = values.master.defined() ? at::kFloat : values.flat.scalar_type();
  at::Tensor full;
  if (values.flat.scalar_type() == own_dtype) {
    if (flat_released(b)) {
      regrow_flat(b);
      values.flat.zero_();
    } else if (shard_is_flat(b)) {
      values.flat.zero_();  // laid out empty: the padding must read zero
    }
    full = values.flat;
  } else {
    full = at::zeros({shape.padded}, values.flat.options().dtype(own_dtype));
  }
  for (int64_t i = shape.first; i < shape.first + shape.count; ++i) {
    retarget(params_[i], full.narrow(0, layout_.offset(i), layout_.numel(i)).view(params_[i].sizes()));
  }
  materializing_[b] = full;
}

void ParamStore::end_materialize(const std::vector<int64_t>& buckets) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> opened;
  for (int64_t b : buckets) {
    TORCH_CHECK(materializing_[b].defined(), "zero_ext internal: bucket ", b, " is not being materialized");
    opened.push_back(materializing_[b]);
  }
  mesh_.broadcast_from_rank0(opened, Purpose::kMaterialize, buckets, [&](size_t k) {
    return "broadcast of initialized parameters from rank 0 (" +
           layout_.describe_bucket(buckets[k], progress_.where()) + ")";
  });
  for (int64_t b : buckets) {
    const BucketShape& shape = layout_.bucket(b);
    BucketValues& values = values_[b];
    at::Tensor full = std::move(materializing_[b]);
    materializing_[b] = at::Tensor();
    const at::Tensor mine = full.narrow(0, layout_.shard_start(b), shape.shard);
    if (value_swapped(b)) swap_->ensure_memory(value_slot_[b]);  // overwritten whole below
    if (values.master.defined()) values.master.copy_(mine);
    const bool temporary = !full.is_same(values.flat);
    if (layout_.params_sharded()) {
      if (values.shard.defined() && !shard_is_flat(b)) values.shard.copy_(mine);
      if (!shard_is_flat(b)) release_storage(values.flat);
    } else if (temporary) {
      values.flat.copy_(full);
    }
    for (int64_t i = shape.first; i < shape.first + shape.count && temporary; ++i) {
      if (layout_.params_sharded()) {  // flat holds no memory: no bounds-checked view of it
        point_into(params_[i], released_[i], values.flat.dtype(), values.flat.storage_offset() + layout_.offset(i));
      } else {
        retarget(params_[i], values.flat.narrow(0, layout_.offset(i), layout_.numel(i)).view(params_[i].sizes()));
      }
    }
    if (layout_.params_sharded()) point_params(b, /*gathered=*/false);
    park_value(b, /*dirty=*/true);
  }
}

int64_t ParamStore::materializing_bytes() const {
  int64_t bytes = 0;
  for (size_t b = 0; b < values_.size(); ++b) {
    if (materializing_[b].defined() && !materializing_[b].is_same(values_[b].flat)) {
      bytes += materializing_[b].nbytes();
    }
  }
  return bytes;
}

std::vector<at::Tensor> ParamStore::segment_compute_copies() const {
  std::vector<at::Tensor> out(segments_.size());
  const auto& pieces = layout_.segments();
  for (size_t s = 0; s < segments_.size(); ++s) {
    const BucketValues& values = values_[pieces[s].bucket];
    if (values.host_compute.defined()) {
      out[s] = values.host_compute.narrow(0, pieces[s].shard_offset, segments_[s].numel()).view(segments_[s].sizes());
      continue;
    }
    if (!values.master.defined() || !values.shard.defined() || !values.shard.device().is_cpu()) {
      continue;
    }
    const auto dtype = values.shard.scalar_type();
    if (dtype != at::kBFloat16 && dtype != at::kHalf) {
      continue;
    }
    out[s] = values.shard.narrow(0, pieces[s].shard_offset, segments_[s].numel()).view(segments_[s].sizes());
  }
  return out;
}

void ParamStore::point_params(int64_t b, bool gathered) {
  const BucketShape& shape = layout_.bucket(b);
  const at::Tensor& full = values_[b].inspected.defined() ? values_[b].inspected : values_[b].flat;
  for (int64_t i = shape.first; i < shape.first + shape.count; ++i) {
    point_at(params_[i], gathered ? full.storage() : released_[i]);
  }
}

void ParamStore::regrow_flat(int64_t b) {
  if (shard_is_flat(b)) return;
  const size_t nbytes = layout_.bucket(b).padded * values_[b].flat.element_size();
  if (swap_ != nullptr && values_[b].flat.device().is_cpu()) {
    swap_->grow_tensor(values_[b].flat, nbytes);  // [Note: recycled host blocks]
  } else {
    grow_storage(values_[b].flat, nbytes);
  }
}

void ParamStore::open_inspection_copy(int64_t b) {
  BucketValues& values = values_[b];
  if (!shard_is_flat(b) || values.inspected.defined()) return;
  TORCH_INTERNAL_ASSERT(values.flat.storage_offset() == 0, "a flat buffer starts its storage");
  at::NoGradGuard no_grad;
  values.inspected = values.flat.clone();
}

void ParamStore::release_flat(int64_t b) {
  values_[b].inspected.reset();  // changes made for inspection go, unless written back
  if (shard_is_flat(b)) return;
  if (swap_ != nullptr && values_[b].flat.device().is_cpu() && !flat_released(b)) {
    swap_->release_tensor(values_[b].flat);
  } else {
    release_storage(values_[b].flat);
  }
}

bool ParamStore::flat_released(int64_t b) const {
  return storage_is_released(values_[b].flat);
}

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

void ParamStore::bump_versions(const std::function<bool(int64_t)>& rewritten) {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (rewritten(static_cast<int64_t>(i))) {
      params_[i].unsafeGetTensorImpl()->bump_version();
    }
  }
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
      works[b] = comm_.all_gather(values_[b].flat, values_[b].shard, Purpose::kStepGather, static_cast<int64_t>(b));
    }
  }
  for (size_t b = 0; b < values_.size(); ++b) {
    comm_.wait(works[b], [&] {
      return "all-gather of updated parameters of " + layout_.describe_bucket(b, progress_.where());
    });
  }
}

void ParamStore::write_back_shards() {
  at::NoGradGuard no_grad;
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    // Gathered buckets only: full_params on a submodule gathers its units alone.
    // Without a compute shard the caller loads the masters instead.
    if (values_[b].inspected.defined()) {
      values_[b].flat.copy_(values_[b].inspected);  // the shard is flat
    } else if (layout_.params_sharded() && values_[b].shard.defined() && !flat_released(b)) {
      ensure_value(b);
      values_[b].shard.copy_(values_[b].flat.narrow(0, layout_.shard_start(b), layout_.bucket(b).shard));
      park_value(b, /*dirty=*/true);
    }
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
    works[k] = comm_.all_gather(full[k], shard, Purpose::kMasters, b);
  }
  for (size_t k = 0; k < buckets.size(); ++k) {
    comm_.wait(works[k], [&] {
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

void ParamStore::check_shapes() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& wrapped = layout_.shape(i);
    TORCH_CHECK(params_[i].sizes() == c10::IntArrayRef(wrapped), "zero_ext: parameter '", layout_.name(i),
                "' changed shape after zero_ext.wrap() (from ", c10::IntArrayRef(wrapped), " to ",
                params_[i].sizes(), "); its buckets, shards and optimizer state were laid out for "
                "the old shape. Resize parameters (a grown embedding, say) before calling wrap(), "
                "or wrap the resized model anew.");
  }
}

bool ParamStore::still_in_place(int64_t i) const {
  const at::Tensor& flat = values_[layout_.bucket_of(i)].flat;
  const auto* storage = params_[i].storage().unsafeGetStorageImpl();
  const bool released_here = layout_.params_sharded() && storage == released_[i].unsafeGetStorageImpl();
  const at::Tensor& inspected = values_[layout_.bucket_of(i)].inspected;
  const bool inspected_here = inspected.defined() && storage == inspected.storage().unsafeGetStorageImpl();
  return (released_here || inspected_here || storage == flat.storage().unsafeGetStorageImpl()) &&
         params_[i].storage_offset() == flat.storage_offset() + layout_.offset(i) &&
         params_[i].dtype() == flat.dtype();
}

int64_t ParamStore::param_bytes() const {
  int64_t bytes = 0;
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    const BucketValues& values = values_[b];
    bytes += values.flat.storage().nbytes();
    if (layout_.params_sharded() && values.shard.defined() && !shard_is_flat(b)) bytes += values.shard.storage().nbytes();
    if (values.host_compute.defined()) bytes += values.host_compute.nbytes();  // pinned, in host memory
  }
  return bytes;
}

int64_t ParamStore::host_compute_bytes() const {
  int64_t bytes = 0;
  for (const auto& values : values_) {
    if (values.host_compute.defined()) bytes += values.host_compute.nbytes();
  }
  return bytes;
}

int64_t ParamStore::master_bytes() const {
  int64_t bytes = 0;
  for (const auto& values : values_) {
    if (values.master.defined()) bytes += values.master.storage().nbytes();  // 0 while swapped out
  }
  return bytes;
}

} // namespace zero_ext
