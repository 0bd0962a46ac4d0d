// ParamStore, the buffers: the flat buffers the parameters view, laid out
// with rank 0's values at wrap(), the shards and masters each stage keeps,
// the segments the optimizer steps, stage 3's release and regrowth and the
// copies gathered for inspection. The masters' refresh and gathers are in
// param_store_masters.cpp, deferred initialization in
// param_store_materialize.cpp, offload to a file in param_store_swap.cpp.
#include "param_store.h"

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include "storage_release.h"
#include "reusable_blocks.h"

namespace zero_ext {

at::TensorOptions host_fp32(const c10::Device& device) {
  auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  return device.is_cpu() ? options : options.pinned_memory(true);
}

namespace {

// A copy of `values` in `options`: empty where the values do not exist yet.
at::Tensor copy_of(const at::Tensor& values, const at::TensorOptions& options, bool deferred) {
  at::Tensor out = at::empty({values.numel()}, options);
  return deferred ? out : out.copy_(values);
}

}  // namespace

ParamStore::ParamStore(std::vector<at::Tensor> params, const Layout& layout, const Mesh& mesh,
                       Communicator& expert_comm, const Progress& progress, std::optional<c10::ScalarType> compute_dtype,
                       bool offload, bool deferred)
    : layout_(layout), mesh_(mesh), comm_(mesh.shard()), expert_comm_(expert_comm), progress_(progress), params_(std::move(params)), offload_(offload), deferred_(deferred) {
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(params_.size()) == layout_.num_params());
  at::NoGradGuard no_grad;
  const int64_t n_buckets = layout_.num_buckets();
  values_.resize(n_buckets);
  materializing_.resize(n_buckets);
  if (layout_.params_sharded()) {
    released_.resize(params_.size());
  }
  std::vector<at::Tensor> to_broadcast;
  std::vector<int64_t> broadcast_buckets, expert_buckets;
  for (int64_t b = 0; b < n_buckets; ++b) {
    lay_out_flat(b);
    if (deferred) {
      // No values to send yet: lay the bucket out at once, so stage 3 never
      // holds more than one bucket whole here.
      keep_what_the_stage_keeps(b, compute_dtype);
    } else if (layout_.expert(b)) {
      expert_buckets.push_back(b);
    } else {
      to_broadcast.push_back(values_[b].flat);
      broadcast_buckets.push_back(b);
    }
  }
  if (!deferred) {
    mesh_.broadcast_from_rank0(to_broadcast, Purpose::kInitBroadcast, {}, [&](size_t k) {
      return "initial broadcast of parameters from rank 0 (" +
             layout_.describe_bucket(broadcast_buckets[k], progress_.where()) + ")";
    });
    // The ranks of an expert group hold the same experts; the others hold others.
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int64_t b : expert_buckets) {
      works.push_back(expert_comm_.broadcast_from_rank0(values_[b].flat, Purpose::kInitBroadcast, b, {}));
    }
    for (size_t k = 0; k < works.size(); ++k) {
      expert_comm_.wait(works[k], [&] {
        return "initial broadcast of experts from the expert group's rank 0 (" +
               layout_.describe_bucket(expert_buckets[k], progress_.where()) + ")";
      });
    }
    for (int64_t b = 0; b < n_buckets; ++b) keep_what_the_stage_keeps(b, compute_dtype);
  }
  build_segments();
}

void ParamStore::lay_out_flat(int64_t b) {
  const BucketShape& shape = layout_.bucket(b);
  const auto options = params_[shape.first].options();
  at::Tensor& flat = values_[b].flat;
  // Stage 3 frees and regrows it every use: from the start in blocks that are reused ([Note: reusable host blocks]).
  flat = reusable_empty({shape.padded}, options);
  if (!(deferred_ && layout_.params_sharded())) flat.zero_();
  for (int64_t i = shape.first; i < shape.first + shape.count; ++i) {
    TORCH_INTERNAL_ASSERT(params_[i].dtype() == options.dtype() && params_[i].device() == options.device(),
                          "a bucket mixes dtypes or devices");
    auto view = flat.narrow(0, layout_.offset(i), layout_.numel(i)).view(params_[i].sizes());
    if (!deferred_) view.copy_(params_[i].detach());
    params_[i].set_data(view);
  }
}

// Masters, the compute copy and (stage 3) the shard of a bucket whose flat
// buffer holds its values; stage 3 then releases the flat buffer.
void ParamStore::keep_what_the_stage_keeps(int64_t b, std::optional<c10::ScalarType> compute_dtype) {
  keep_master(b, compute_dtype);
  at::Tensor mine = values_[b].flat.narrow(0, layout_.shard_start(b), layout_.bucket(b).shard);
  if (!layout_.params_sharded()) {
    values_[b].shard = mine;
    return;
  }
  keep_shard(b, mine);
}

void ParamStore::keep_master(int64_t b, std::optional<c10::ScalarType> compute_dtype) {
  const BucketShape& shape = layout_.bucket(b);
  BucketValues& values = values_[b];
  const bool fp32 = values.flat.scalar_type() == at::kFloat;
  const bool low_precision = compute_dtype.has_value() && fp32;
  if (low_precision || (offload_ && fp32 && shape.trainable > 0)) {
    // The master shard keeps the fp32 value the optimizer steps.
    at::Tensor mine = values.flat.narrow(0, layout_.shard_start(b), shape.shard);
    values.master = copy_of(mine, offload_ ? host_fp32(mine.device()) : mine.options(), deferred_);
    has_masters_ = true;
    if (offload_ && low_precision && !mine.device().is_cpu()) {
      values.host_compute = at::empty({shape.shard}, values.master.options().dtype(*compute_dtype));
    }
  }
  if (low_precision) {  // parameters compute in the low-precision copy
    at::Tensor compute = reusable_empty({shape.padded}, values.flat.options().dtype(*compute_dtype));
    values.flat = deferred_ ? compute.zero_() : compute.copy_(values.flat);
    for (int64_t i = shape.first; i < shape.first + shape.count; ++i) {
      params_[i].set_data(values.flat.narrow(0, layout_.offset(i), layout_.numel(i)).view(params_[i].sizes()));
    }
  }
}

void ParamStore::keep_shard(int64_t b, const at::Tensor& mine) {
  const BucketShape& shape = layout_.bucket(b);
  BucketValues& values = values_[b];
  if (!values.master.defined() || offload_) {
    // [Note: one rank's shard is its flat buffer] Alone in the shard group
    // (world size 1), the shard is the whole bucket: a copy of its own
    // would make every gather a copy into freshly grown memory (6 ms of a
    // 143 ms step on CPU) for no memory saved. The parameters still point
    // at unreadable storage between uses, as on more ranks, and view a
    // copy while gathered for inspection (open_inspection_copy), so that
    // changes made there are discarded unless written back, as on more ranks.
    values.shard = comm_of(b).local() && !values.master.defined() ? mine : copy_of(mine, mine.options(), deferred_);
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
    grow_storage(values_[b].flat, nbytes, growth_allocator(values_[b].flat.storage()));  // [Note: reusable host blocks]
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

void ParamStore::bump_versions(const std::function<bool(int64_t)>& rewritten) {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (rewritten(static_cast<int64_t>(i))) {
      params_[i].unsafeGetTensorImpl()->bump_version();
    }
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
