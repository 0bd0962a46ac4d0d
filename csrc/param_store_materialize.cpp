// ParamStore, deferred initialization: a meta-device model's buckets opened
// one at a time for its initializers, then closed, rank 0's values kept as
// this rank's master and shard ([Note: deferred initialization]).
#include "param_store.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include "storage_release.h"

namespace zero_ext {

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

} // namespace zero_ext
