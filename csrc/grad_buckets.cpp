#include "grad_buckets.h"

#include "param_storage.h"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/intrusive_ptr.h>

// Include what you use: Node's hook methods need function.h, which some
// torch releases pull in through other headers and others (2.11) do not.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace zero_ext {
namespace {

// Post hook on a parameter's AccumulateGrad node: runs after the engine has
// accumulated this backward's gradient into param.grad.
class ParamReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ParamReadyHook(GradBuckets* owner, int64_t index) : owner_(owner), index_(index) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    owner_->on_grad_ready(index_);
    return outputs;
  }

 private:
  GradBuckets* owner_;  // owner removes this hook in its destructor
  int64_t index_;
};

// Pre hook on a parameter's AccumulateGrad node: drops the gradient stand-in
// (see [Note: gradient stand-ins]) before the engine accumulates into .grad.
class ClearStandInHook : public torch::autograd::FunctionPreHook {
 public:
  ClearStandInHook(at::Tensor param, at::Tensor stand_in)
      : param_(std::move(param)), stand_in_(std::move(stand_in)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    at::Tensor& grad = param_.mutable_grad();
    if (grad.defined() && grad.unsafeGetTensorImpl() == stand_in_.unsafeGetTensorImpl()) {
      grad = at::Tensor();
    }
    return grads;
  }

 private:
  at::Tensor param_;  // the node holds it strongly already
  at::Tensor stand_in_;
};

bool same_memory(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.data_ptr() == b.data_ptr() &&
         a.sizes() == b.sizes() && a.strides() == b.strides();
}

int64_t round_up(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

// fp32 in host memory; pinned when it feeds an accelerator, so transfers can
// run asynchronously.
at::TensorOptions host_fp32(const c10::Device& device) {
  auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  return device.is_cpu() ? options : options.pinned_memory(true);
}

} // namespace

GradBuckets::GradBuckets(std::vector<at::Tensor> params,
                         std::vector<std::string> names,
                         std::vector<int64_t> trainable,
                         std::vector<int64_t> params_per_bucket,
                         std::vector<int64_t> unit_of_bucket,
                         int64_t stage,
                         std::string group_name,
                         std::string gather_group_name,
                         int64_t prefetch,
                         int64_t compute_dtype,
                         int64_t reduce_dtype,
                         bool offload)
    : stage_(stage), comm_(group_name),
      gather_comm_(gather_group_name.empty() ? group_name : gather_group_name),
      params_(std::move(params)),
      names_(std::move(names)), trainable_(trainable.begin(), trainable.end()),
      prefetch_(prefetch) {
  TORCH_CHECK(stage_ >= 0 && stage_ <= 3, "zero_ext: stage must be 0, 1, 2 or 3");
  if (const char* fault = std::getenv("ZERO_EXT_TEST_FAULT")) {  // point:rank:step
    std::istringstream spec(fault);
    std::string point, rank, step;
    std::getline(spec, point, ':');
    std::getline(spec, rank, ':');
    std::getline(spec, step, ':');
    try {
      if (!rank.empty() && std::stoll(rank) == comm_.rank()) {
        fault_point_ = point;
        fault_step_ = step.empty() ? -1 : std::stoll(step);
      }
    } catch (const std::exception&) {
      fault_point_.clear();  // malformed: no fault
    }
  }
  TORCH_CHECK(params_.size() == names_.size() && params_.size() == trainable_.size(),
              "zero_ext internal: one name and trainable flag per parameter");
  TORCH_CHECK(stage_ == 3 || unit_of_bucket.empty() ||
                  unit_of_bucket.size() == params_per_bucket.size(),
              "zero_ext internal: one unit per bucket");
  const int64_t n_params = static_cast<int64_t>(params_.size());
  const int64_t world = comm_.size();
  for (const auto& p : params_) {
    shapes_.push_back(p.sizes().vec());
  }
  at::NoGradGuard no_grad;
  offload_ = offload;
  reduce_dtype_ = reduce_dtype >= 0 ? static_cast<at::ScalarType>(reduce_dtype) : at::kFloat;
  // Stage 0 keeps DDP's layout (param.grad is the reduced buffer) only when
  // gradients are reduced in the parameters' own fp32.
  ddp_layout_ = stage_ == 0 && compute_dtype < 0 && !offload && reduce_dtype_ == at::kFloat;
  replicated_ = stage_ == 0 && !ddp_layout_;
  TORCH_CHECK(reduce_dtype_ == at::kFloat || reduce_dtype_ == at::kBFloat16 || reduce_dtype_ == at::kHalf,
              "zero_ext: gradients can be reduced in float32, bfloat16 or float16");

  bucket_of_.assign(n_params, -1);
  offset_.assign(n_params, 0);
  int64_t next = 0;
  std::vector<c10::intrusive_ptr<c10d::Work>> broadcasts;
  for (int64_t count : params_per_bucket) {
    TORCH_CHECK(count > 0 && next + count <= n_params, "zero_ext internal: bad bucket plan");
    Bucket bucket;
    bucket.first = next;
    bucket.count = count;
    bucket.unit = stage_ == 3 ? unit_of_bucket.at(buckets_.size()) : -1;
    const auto options = params_[next].options();
    for (int64_t i = next; i < next + count; ++i) {
      TORCH_CHECK(params_[i].dtype() == options.dtype() && params_[i].device() == options.device(),
                  "zero_ext internal: a bucket mixes dtypes or devices");
      TORCH_CHECK(trainable_[i] || stage_ == 3,
                  "zero_ext internal: frozen parameters are bucketed in stage 3 only");
      bucket_of_[i] = static_cast<int64_t>(buckets_.size());
      offset_[i] = bucket.numel;
      bucket.numel += params_[i].numel();
      bucket.trainable += trainable_[i] ? 1 : 0;
    }
    bucket.padded = round_up(std::max<int64_t>(bucket.numel, 1), world);
    bucket.shard = replicated_ ? bucket.padded : bucket.padded / world;
    bucket.param_flat = at::zeros({bucket.padded}, options);
    for (int64_t i = next; i < next + count; ++i) {
      auto view = bucket.param_flat.narrow(0, offset_[i], params_[i].numel()).view(params_[i].sizes());
      view.copy_(params_[i].detach());
      params_[i].set_data(view);
    }
    // Every rank starts from rank 0's parameters, as DDP does.
    broadcasts.push_back(comm_.broadcast_from_rank0(bucket.param_flat));
    if (ddp_layout_) {
      bucket.staging = at::zeros({bucket.padded}, options);
    } else if (stage_ <= 1) {
      bucket.staging = at::zeros({bucket.padded}, options.dtype(reduce_dtype_));
    }
    if (!ddp_layout_ && bucket.trainable > 0) {
      bucket.accum = offload_ ? at::zeros({bucket.shard}, host_fp32(options.device()))
                              : at::zeros({bucket.shard}, options.dtype(at::kFloat));
    }
    buckets_.push_back(std::move(bucket));
    next += count;
  }
  TORCH_CHECK(next == n_params, "zero_ext internal: bucket plan does not cover every parameter");
  for (size_t b = 0; b < broadcasts.size(); ++b) {
    comm_.wait(broadcasts[b], [&] { return "initial broadcast of parameters from rank 0 (" + describe_bucket(b) + ")"; });
  }

  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    const bool fp32 = bucket.param_flat.scalar_type() == at::kFloat;
    const bool low_precision = compute_dtype >= 0 && fp32;
    if (low_precision || (offload_ && fp32 && bucket.trainable > 0)) {
      // The master shard keeps the fp32 value the optimizer steps.
      at::Tensor mine = bucket.param_flat.narrow(0, shard_start(bucket), bucket.shard);
      bucket.master = offload_ ? at::empty({bucket.shard}, host_fp32(mine.device())).copy_(mine)
                               : mine.clone();
      has_masters_ = true;
    }
    if (low_precision) {  // parameters compute in the low-precision copy
      bucket.param_flat = bucket.param_flat.to(static_cast<at::ScalarType>(compute_dtype));
      for (int64_t i = bucket.first; i < bucket.first + bucket.count; ++i) {
        params_[i].set_data(
            bucket.param_flat.narrow(0, offset_[i], params_[i].numel()).view(params_[i].sizes()));
      }
    }
    at::Tensor mine = bucket.param_flat.narrow(0, shard_start(bucket), bucket.shard);
    if (stage_ == 3) {
      bucket.param_shard = mine.clone();
      release_storage(bucket.param_flat);
      released_.resize(params_.size());
      for (int64_t i = bucket.first; i < bucket.first + bucket.count; ++i) {
        released_[i] = unreadable_storage(
            bucket.param_flat.device(),
            "zero_ext: parameter '" + names_[i] + "' is sharded (stage 3) and holds no data "
            "outside its unit's forward and backward. Read or change it inside `with "
            "zero_ext.full_params(model):` (collective: every rank enters it; writeback=True "
            "keeps changes), or read zero_ext.full_state_dict(model).");
      }
      point_params(bucket, /*gathered=*/false);
      if (static_cast<int64_t>(units_.size()) <= bucket.unit) {
        units_.resize(bucket.unit + 1);
      }
      units_[bucket.unit].buckets.push_back(static_cast<int64_t>(b));
    } else {
      bucket.param_shard = mine;
    }
  }
  unit_gathers_.assign(units_.size(), 0);  // the units with parameters, the same on every rank

  if (ddp_layout_) {
    for (int64_t i = 0; i < n_params; ++i) {
      grad_views_.push_back(staging_region(buckets_[bucket_of_[i]], i));
    }
  } else {
    // Segments: the local shard of each bucket cut at parameter boundaries.
    // Replicated (stage 0), a segment is a whole parameter and keeps its shape,
    // so optimizers that are not elementwise still work.
    for (size_t b = 0; b < buckets_.size(); ++b) {
      Bucket& bucket = buckets_[b];
      const int64_t lo = shard_start(bucket);
      const int64_t hi = lo + bucket.shard;
      for (int64_t i = bucket.first; i < bucket.first + bucket.count; ++i) {
        const int64_t start = std::max(lo, offset_[i]);
        const int64_t end = std::min(hi, offset_[i] + params_[i].numel());
        if (!trainable_[i] || start >= end) {
          continue;
        }
        const at::Tensor& stepped = bucket.master.defined() ? bucket.master : bucket.param_shard;
        at::Tensor segment = stepped.narrow(0, start - lo, end - start);
        at::Tensor grad = bucket.accum.narrow(0, start - lo, end - start);
        if (replicated_) {
          segment = segment.view(params_[i].sizes());
          grad = grad.view(params_[i].sizes());
        }
        segments_.push_back(segment);
        segment_grads_.push_back(grad);
        segment_param_.push_back(i);
        segment_offset_.push_back(start - lo);
      }
    }
  }

  arrived_.assign(n_params, 0);
  detached_.assign(n_params, 0);
  local_has_grad_.assign(n_params, 0);
  global_has_grad_.assign(n_params, 0);
  accumulators_.resize(n_params);
  hook_keys_.assign(n_params, 0);
  grad_stand_ins_.resize(n_params);
  for (int64_t i = 0; i < n_params; ++i) {
    if (!trainable_[i]) {
      continue;
    }
    auto node = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(node, "zero_ext: parameter '", names_[i],
                "' has no gradient accumulator; is it a leaf that requires grad?");
    hook_keys_[i] = node->add_post_hook(std::make_unique<ParamReadyHook>(this, i));
    if (!ddp_layout_) {
      grad_stand_ins_[i] = unreadable_like(
          params_[i],
          "zero_ext: the gradient of '" + names_[i] + "' is sharded over the ranks (stage " +
              std::to_string(stage_) + ") and lives in the optimizer, so param.grad holds no data. "
              "Clip with zero_ext.clip_grad_norm_(model.parameters(), max_norm) (torch.nn.utils."
              "clip_grad_norm_ cannot see sharded gradients); read full gradients with "
              "zero_ext.full_grads(model).");
      node->add_pre_hook(std::make_unique<ClearStandInHook>(params_[i], grad_stand_ins_[i]));
    }
    accumulator_nodes_.push_back(node.get());
    accumulators_[i] = std::move(node);
  }
  start_round();
}

GradBuckets::~GradBuckets() {
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    if (accumulators_[i]) {
      accumulators_[i]->del_post_hook(hook_keys_[i]);
    }
  }
}

at::Tensor GradBuckets::staging_region(Bucket& bucket, int64_t i) {
  return bucket.staging.narrow(0, offset_[i], params_[i].numel()).view(params_[i].sizes());
}

void GradBuckets::ensure_staging(Bucket& bucket) {
  if (!bucket.staging.defined()) {
    bucket.staging = at::empty({bucket.padded}, bucket.param_flat.options().dtype(reduce_dtype_));
  }
}

int64_t GradBuckets::shard_start(const Bucket& bucket) const {
  return replicated_ ? 0 : comm_.rank() * bucket.shard;
}

std::string GradBuckets::describe_bucket(int64_t b) const {
  const Bucket& bucket = buckets_[b];
  std::ostringstream out;
  out << "bucket " << b << " of " << buckets_.size() << " (stage " << stage_ << ", "
      << bucket.count << " parameters from '" << names_[bucket.first] << "', "
      << bucket.padded << " elements; " << where() << ")";
  return out.str();
}

std::string GradBuckets::describe_unit(int64_t u) const {
  std::ostringstream out;
  out << "unit " << u;
  if (!units_[u].buckets.empty()) {
    out << " (parameters from '" << names_[buckets_[units_[u].buckets.front()].first] << "')";
  }
  return out.str();
}

std::string GradBuckets::where() const {
  std::ostringstream out;
  out << "step " << step_index_ << ", synced backward " << synced_in_step_ << " of the step";
  return out.str();
}

void GradBuckets::maybe_inject_fault(const char* point) {
  if (fault_point_ != point || (fault_step_ >= 0 && fault_step_ != step_index_)) {
    return;
  }
  fault_point_.clear();  // once
  TORCH_CHECK(false, "zero_ext test fault: raised in ", point, " on rank ", comm_.rank(), " at step ",
              step_index_, " (ZERO_EXT_TEST_FAULT)");
}

void GradBuckets::arm_epilogue() {
  if (epilogue_.pending()) {
    return;
  }
  auto self = c10::intrusive_ptr<GradBuckets>::unsafe_reclaim_from_nonowning(this);
  epilogue_.arm([self]() { self->run_epilogue(); });
}

double GradBuckets::on_output_grad() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!current_backward_executes_any(accumulator_nodes_)) {
    return 1.0;  // autograd.grad and the like: the caller gets true gradients
  }
  arm_epilogue();
  output_hook_task_ = current_backward().graph_task_id;
  return scaler_.scale();
}

void GradBuckets::attach_output_hook(const at::Tensor& output) {
  if (!output.requires_grad()) {
    return;
  }
  c10::weak_intrusive_ptr<GradBuckets> weak(
      c10::intrusive_ptr<GradBuckets>::unsafe_reclaim_from_nonowning(this));
  output.register_hook([weak](const at::Tensor& /*grad*/) {
    if (auto self = weak.lock()) {
      self->on_output_grad();
    }
  });
}

void GradBuckets::on_grad_ready(int64_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable();
  try {
    on_grad_ready_locked(i);
  } catch (...) {
    mark_broken();
    throw;
  }
}

void GradBuckets::mark_broken() {
  try {
    throw;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    broken_ = what.substr(0, what.find('\n'));
  } catch (...) {
    broken_ = "an unknown error";
  }
}

void GradBuckets::check_usable() const {
  TORCH_CHECK(!comm_.failed() && !gather_comm_.failed(), "zero_ext: rank ", comm_.rank(),
              " cannot go on training: an earlier collective of this model failed (see the first "
              "error), so this rank's collectives are out of step with the other ranks'. Restart "
              "every rank from the last checkpoint.");
  TORCH_CHECK(broken_.empty(), "zero_ext: rank ", comm_.rank(), " cannot go on training: an earlier "
              "error inside zero_ext's gradient hooks or reduction (", broken_, ") left this rank's "
              "collectives out of step with the other ranks', which wait for the ones it skipped "
              "and fail within the process group's timeout. Restart every rank from the last "
              "checkpoint.");
}

void GradBuckets::on_grad_ready_locked(int64_t i) {
  arm_epilogue();  // fallback when no forward output was hooked
  if (!fault_point_.empty()) {
    maybe_inject_fault("grad_hook");
  }
  retire_completed();
  at::Tensor& grad = params_[i].mutable_grad();
  if (!grad.defined()) {
    return;
  }
  local_has_grad_[i] = 1;
  Bucket& bucket = buckets_[bucket_of_[i]];
  if (bucket.launched) {
    // Arrived after its bucket went out (a parameter reached twice through a
    // reentrant checkpoint, say). It stays in param.grad; the epilogue runs a
    // second round for it on every rank.
    late_ = true;
    return;
  }
  at::NoGradGuard no_grad;
  if (ddp_layout_) {
    const at::Tensor& view = grad_views_[i];
    if (!same_memory(grad, view)) {
      // param.grad was None or replaced: it holds the whole accumulated value.
      view.copy_(grad);
      grad = view;
    }
  } else {
    if (!sync_) {
      // no_sync(): accumulate locally in param.grad. Stage 3 still counts the
      // arrival, to release the unit once its backward is over.
      if (stage_ == 3 && !arrived_[i]) {
        arrived_[i] = 1;
        if (--bucket.waiting == 0) {
          maybe_release_after_unit_backward(bucket.unit);
        }
      }
      return;
    }
    ensure_staging(bucket);
    at::Tensor region = staging_region(bucket, i);
    if (arrived_[i]) {
      region.add_(grad);
    } else {
      region.copy_(grad);
    }
    grad = at::Tensor();  // the full gradient lives on only in the bucket
  }
  if (!sync_ || arrived_[i]) {
    return;
  }
  arrived_[i] = 1;
  if (--bucket.waiting == 0) {
    launch_ready_buckets();
    if (stage_ == 3) {
      maybe_release_after_unit_backward(bucket.unit);
    }
  }
}

void GradBuckets::launch_ready_buckets() {
  const int64_t n = static_cast<int64_t>(buckets_.size());
  while (next_launch_ < n && buckets_[next_launch_].waiting == 0) {
    launch(next_launch_++);
  }
}

void GradBuckets::launch(int64_t b) {
  Bucket& bucket = buckets_[b];
  at::NoGradGuard no_grad;
  if (bucket.trainable == 0) {
    bucket.launched = true;  // frozen parameters only (stage 3): nothing to reduce
    return;
  }
  if (ddp_layout_) {
    for (int64_t i = bucket.first; i < bucket.first + bucket.count; ++i) {
      at::Tensor& grad = params_[i].mutable_grad();
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
    ensure_staging(bucket);
    for (int64_t i = bucket.first; i < bucket.first + bucket.count; ++i) {
      if (arrived_[i]) {
        continue;
      }
      at::Tensor& grad = params_[i].mutable_grad();
      at::Tensor region = staging_region(bucket, i);
      if (grad.defined() && !holds_stand_in(i)) {
        region.copy_(grad);  // accumulated under no_sync(), or late
        grad = at::Tensor();
      } else {
        region.zero_();  // unused here (a stand-in stays): zeros keep the collective in step
      }
    }
    if (bucket.padded > bucket.numel) {
      bucket.staging.narrow(0, bucket.numel, bucket.padded - bucket.numel).zero_();
    }
  }
  // Pre-divide (gloo has no AVG/PREMUL_SUM everywhere), and remove the loss
  // scale in the same pass unless the reduction runs in fp16, whose range
  // the scale is there to use.
  double divisor = static_cast<double>(comm_.size());
  if (scaler_.enabled() && reduce_dtype_ != at::kHalf) {
    divisor *= scaler_.scale();
  }
  if (divisor != 1.0) {
    bucket.staging.div_(divisor);
  }
  if (ddp_layout_) {
    bucket.work = comm_.all_reduce_sum(bucket.staging);
  } else if (replicated_) {
    bucket.reduce_out = bucket.staging;
    bucket.work = comm_.all_reduce_sum(bucket.staging);
  } else if (comm_.distributed() && bucket.staging.device().is_cpu()) {
    // Gloo runs a reduce-scatter as an all-reduce plus a copy made inside
    // wait(), where no bounded wait (see communicator.h) can see it finish.
    // The same all-reduce issued here, in place, then read at this rank's shard.
    bucket.reduce_out = bucket.staging.narrow(0, shard_start(bucket), bucket.shard);
    bucket.work = comm_.all_reduce_sum(bucket.staging);
  } else {
    const bool direct = !bucket.accum_has_value && bucket.accum.dtype() == bucket.staging.dtype() &&
                        bucket.accum.device() == bucket.staging.device();
    bucket.reduce_out = direct ? bucket.accum : at::empty({bucket.shard}, bucket.staging.options());
    bucket.work = comm_.reduce_scatter_sum(bucket.reduce_out, bucket.staging);
  }
  bucket.launched = true;
  in_flight_.push_back(b);
  retire_completed();
}

void GradBuckets::retire_completed() {
  // Stages 2-3 free a bucket's full gradients once its reduction is done.
  // Only reductions already complete are retired during backward: waiting
  // inside a hook could deadlock with a peer that reaches this bucket only in
  // its epilogue, after another collective of its backward (a layer used on
  // some ranks only next to a tensor-parallel all-reduce, say).
  if (stage_ < 2) {
    return;
  }
  while (!in_flight_.empty() &&
         (!buckets_[in_flight_.front()].work || buckets_[in_flight_.front()].work->isCompleted())) {
    retire(in_flight_.front());
    in_flight_.pop_front();
  }
}

void GradBuckets::wait_all() {
  while (!in_flight_.empty()) {
    retire(in_flight_.front());
    in_flight_.pop_front();
  }
  finish_host_adds();
}

void GradBuckets::retire(int64_t b) {
  at::NoGradGuard no_grad;
  Bucket& bucket = buckets_[b];
  comm_.wait(bucket.work, [&] { return "gradient reduction of " + describe_bucket(b); });
  bucket.work.reset();
  if (ddp_layout_) {
    return;  // reduced in place
  }
  // Reduced in fp16 while still scaled (to use fp16's range); the scale is
  // divided out in fp32, as the result is added into the accumulator.
  const double unscale = scaler_.enabled() && reduce_dtype_ == at::kHalf ? 1.0 / scaler_.scale() : 1.0;
  fold_into_accum(bucket, bucket.reduce_out, unscale);
  bucket.reduce_out.reset();
  if (stage_ >= 2) {
    bucket.staging.reset();  // stages 2-3 keep no full gradient
  }
}

void GradBuckets::fold_into_accum(Bucket& bucket, const at::Tensor& reduced, double factor) {
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
    // Later ones land next to it and are added on the host (never copied
    // over it: every backward of a step counts).
    if (!bucket.host_landing.defined()) {
      bucket.host_landing = at::empty({bucket.shard}, host_fp32(reduced.device()));
    }
    bucket.host_landing.copy_(reduced, /*non_blocking=*/true);
    bucket.host_add_pending = true;
    bucket.host_factor = factor;
    host_transfers_pending_ = true;
  }
  bucket.accum_has_value = true;
}

void GradBuckets::finish_host_adds() {
  if (!host_transfers_pending_) {
    return;
  }
  const c10::Device device = params_[0].device();
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

at::Tensor GradBuckets::local_nonfinite() const {
  // One read of the local shards: a sum is finite iff its terms are (short
  // of a finite overflow at ~1e38, which is no usable gradient either). The
  // flag stays on the accumulators' device: no host sync of its own.
  std::vector<at::Tensor> sums;
  for (const auto& bucket : buckets_) {
    if (ddp_layout_ && bucket.staging.defined()) {
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

void GradBuckets::mark_nonfinite_everywhere() {
  if (ddp_layout_) {
    return;  // the all-reduce already spread it
  }
  // A rank sees only its shard; under DDP the all-reduce spreads an inf to
  // every rank's gradient. NaN in one element of this rank's shard does the
  // same, so a local check (torch.amp.GradScaler's unscale_, say) decides
  // alike on every rank.
  for (size_t s = 0; s < segment_grads_.size(); ++s) {
    if (global_has_grad_[segment_param_[s]] && segment_grads_[s].numel() > 0) {
      segment_grads_[s].reshape(-1).narrow(0, 0, 1).fill_(std::numeric_limits<double>::quiet_NaN());
      return;
    }
  }
}

void GradBuckets::start_round() {
  for (auto& bucket : buckets_) {
    bucket.waiting = bucket.trainable;
    bucket.launched = false;
  }
  std::fill(arrived_.begin(), arrived_.end(), 0);
  next_launch_ = 0;
  late_ = false;
}

bool GradBuckets::exchange_grad_mask_and_flags(const at::Tensor& nonfinite) {
  const int64_t n = static_cast<int64_t>(params_.size());
  // Besides the mask and the flags, each rank fills a row of its own with
  // where it is (step, synced backward, gathers per unit): the sum hands every
  // rank every row, so all of them see the same divergence and raise alike.
  const int64_t width = 2 + static_cast<int64_t>(unit_gathers_.size());
  const int64_t world = comm_.size();
  at::Tensor mask = at::zeros({n + 2 + world * width}, at::TensorOptions().dtype(at::kFloat));
  float* data = mask.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    data[i] = static_cast<float>(local_has_grad_[i]);
  }
  data[n] = late_ ? 1.0f : 0.0f;
  data[n + 1] = 0.0f;
  float* row = data + n + 2 + comm_.rank() * width;
  row[0] = static_cast<float>(step_index_ % (int64_t{1} << 23));  // exact in a float
  row[1] = static_cast<float>(synced_in_step_);
  for (size_t u = 0; u < unit_gathers_.size(); ++u) {
    row[2 + u] = static_cast<float>(unit_gathers_[u]);
    unit_gathers_[u] = 0;
  }
  // The collective runs on the parameters' device (NCCL cannot reduce CPU
  // tensors); the non-finite flag joins it there, read back with the rest.
  at::Tensor on_device = mask.to(params_[0].device());
  if (nonfinite.defined()) {
    on_device.narrow(0, n + 1, 1).copy_(nonfinite.reshape({1}));
  }
  if (comm_.distributed()) {
    comm_.wait(comm_.all_reduce_sum(on_device), [&] {
      return "exchange of which parameters got gradients (stage " + std::to_string(stage_) + ", " + where() + ")";
    });
  }
  mask = on_device.cpu();
  data = mask.data_ptr<float>();
  check_ranks_agree(data + n + 2, width);
  for (int64_t i = 0; i < n; ++i) {
    global_has_grad_[i] = data[i] > 0.0f;
  }
  late_ = data[n] > 0.0f;
  return data[n + 1] > 0.0f;
}

void GradBuckets::check_ranks_agree(const float* rows, int64_t width) const {
  const int64_t world = comm_.size();
  auto ranks_where = [&](int64_t column, float value) {
    std::ostringstream out;
    const char* sep = "";
    for (int64_t r = 0; r < world; ++r) {
      if (rows[r * width + column] == value) {
        out << sep << r;
        sep = ", ";
      }
    }
    return out.str();
  };
  for (int64_t r = 1; r < world; ++r) {
    const float* mine = rows + r * width;
    if (mine[0] != rows[0] || mine[1] != rows[1]) {
      std::ostringstream out;
      for (int64_t q = 0; q < world; ++q) {
        out << (q ? "; " : "") << "rank " << q << " at step " << rows[q * width] << " after "
            << rows[q * width + 1] << " synced backward(s) in the step";
      }
      TORCH_CHECK(false, "zero_ext: the ranks have diverged (stage ", stage_, "): ", out.str(),
                  ". Every rank must run the same number of backward passes between optimizer "
                  "steps and the same number of steps (a loop whose length depends on the rank's "
                  "data, or an exception caught on some ranks only, breaks this); their "
                  "gradient reductions were paired with each other's and are discarded.");
    }
  }
  for (int64_t u = 0; u < width - 2; ++u) {
    for (int64_t r = 1; r < world; ++r) {
      const float mine = rows[r * width + 2 + u];
      const float first = rows[2 + u];
      if (mine != first) {
        TORCH_CHECK(false, "zero_ext: stage 3 ", describe_unit(u), " was gathered ", first,
                    " time(s) on rank(s) ", ranks_where(2 + u, first), " but ", mine,
                    " time(s) on rank(s) ", ranks_where(2 + u, mine), " since the last gradient "
                    "exchange (", where(), "): the ranks ran different modules, so their parameter "
                    "gathers were paired with each other's. In stage 3 every rank must run the "
                    "same units in each forward and backward: run a module that is skipped on "
                    "some ranks (rank-dependent control flow, an expert no token was routed to) "
                    "on every rank, or leave it out of units= so it stays gathered with its parent.");
      }
    }
  }
}

void GradBuckets::publish_grads() {
  if (ddp_layout_) {
    for (size_t i = 0; i < params_.size(); ++i) {
      params_[i].mutable_grad() = global_has_grad_[i] ? grad_views_[i] : at::Tensor();
      detached_[i] = 0;
    }
    return;
  }
  for (size_t s = 0; s < segments_.size(); ++s) {
    segments_[s].mutable_grad() =
        global_has_grad_[segment_param_[s]] ? segment_grads_[s] : at::Tensor();
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& grad = params_[i].mutable_grad();
    if (trainable_[i] && !grad.defined() && global_has_grad_[i]) {
      grad = grad_stand_ins_[i];
    }
  }
}

bool GradBuckets::holds_stand_in(size_t i) const {
  const at::Tensor& grad = params_[i].grad();
  return grad.defined() && grad_stand_ins_[i].defined() &&
         grad.unsafeGetTensorImpl() == grad_stand_ins_[i].unsafeGetTensorImpl();
}

void GradBuckets::verify_hooks(bool after_sync) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!trainable_[i]) {
      continue;
    }
    auto current = torch::autograd::impl::try_get_grad_accumulator(params_[i]);
    TORCH_CHECK(!current || current.get() == accumulators_[i].get(),
                "zero_ext: parameter '", names_[i],
                "' got a gradient that zero_ext never saw: its autograd accumulator was "
                "re-created after zero_ext.wrap() (its .data was replaced by a tensor of "
                "another dtype or device, or it was re-registered). Its gradient would "
                "silently miss the reduction. Change parameters in place "
                "(param.data.copy_(...)) or wrap the model after changing them.");
    TORCH_CHECK(!(after_sync && !ddp_layout_ && params_[i].grad().defined() && !holds_stand_in(i)),
                "zero_ext: parameter '", names_[i],
                "' holds a gradient in .grad that did not pass zero_ext's reduction "
                "(was .grad assigned by hand during backward?). In stages 1-2 gradients "
                "live in the optimizer's shards; use zero_ext.full_grads(model) to read them.");
  }
}

void GradBuckets::run_epilogue() {
  std::lock_guard<std::mutex> lock(mutex_);
  epilogue_.fired();
  const auto info = current_backward();
  last_graph_task_ = info.graph_task_id;
  last_keep_graph_ = info.keep_graph;
  ++epilogues_run_;
  try {
    TORCH_CHECK(!scaler_.enabled() || output_hook_task_ == info.graph_task_id,
                "zero_ext: fp16 loss scaling scales the gradient where it enters the model, at "
                "its forward outputs, and this backward reached the model's parameters without "
                "passing through any of them (a loss built from parameters directly?). Its "
                "gradients would be unscaled wrongly. Compute the loss from the model's outputs, "
                "or pass mixed_precision=zero_ext.MixedPrecision(torch.float16, loss_scale=1.0) "
                "and scale the loss yourself (torch.amp.GradScaler).");
    // no_sync(): nothing to reduce. (A backward that accumulates nothing
    // here, like torch.autograd.grad, never armed the epilogue: see
    // on_output_grad. Whether to reduce must not depend on what this rank
    // happened to receive, or ranks would disagree on the collectives.)
    if (!sync_) {
      verify_hooks(false);
      start_round();
      release_after_backward(info.keep_graph);
      return;
    }
    ++synced_epilogues_;
    ++synced_in_step_;
    if (!fault_point_.empty()) {
      maybe_inject_fault("epilogue");
    }
    // Flush in bucket order: unused parameters contribute zeros, so the
    // sequence of collectives is the same on every rank.
    for (int64_t b = next_launch_; b < static_cast<int64_t>(buckets_.size()); ++b) {
      launch(b);
    }
    next_launch_ = static_cast<int64_t>(buckets_.size());
    wait_all();
    bool any_nonfinite =
        exchange_grad_mask_and_flags(ddp_layout_ && !skip_nonfinite_ ? at::Tensor() : local_nonfinite());
    if (late_) {
      ++late_rounds_;
      start_round();  // every parameter counts as not arrived: pending grads are flushed
      for (int64_t b = 0; b < static_cast<int64_t>(buckets_.size()); ++b) {
        launch(b);
      }
      wait_all();
      if (!ddp_layout_ || skip_nonfinite_) {
        at::Tensor flag = local_nonfinite().reshape({1}).to(params_[0].device());
        if (comm_.distributed()) {
          comm_.wait(comm_.all_reduce_sum(flag), [] { return std::string("exchange of the non-finite gradient flag"); });
        }
        any_nonfinite = flag.item<float>() > 0.0f;
      }
    }
    if (any_nonfinite) {
      found_nonfinite_ = true;
      ++nonfinite_backwards_;
      mark_nonfinite_everywhere();
    }
    publish_grads();
    verify_hooks(true);
  } catch (...) {
    // Collectives of this backward may be in flight or skipped here while the
    // other ranks go on: this rank's sequence no longer matches theirs.
    mark_broken();
    for (auto& bucket : buckets_) {
      bucket.work.reset();
      bucket.reduce_out.reset();
      bucket.host_add_pending = false;
      bucket.host_factor = 1.0;
    }
    host_transfers_pending_ = false;
    in_flight_.clear();
    std::fill(detached_.begin(), detached_.end(), 0);
    start_round();
    throw;
  }
  start_round();
  release_after_backward(info.keep_graph);
}

void GradBuckets::set_sync(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_ = sync;
}

void GradBuckets::zero_grad(bool set_to_none) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!epilogue_.pending() || epilogue_.is_stale(),
              "zero_ext: zero_grad() was called while a backward is running; call it "
              "between steps");
  reset_if_stale_locked();  // never zero buffers a collective may still write
  at::NoGradGuard no_grad;
  found_nonfinite_ = false;
  for (auto& bucket : buckets_) {
    if (ddp_layout_) {
      bucket.staging.zero_();
    } else {
      bucket.accum_has_value = false;
      if (!set_to_none && bucket.accum.defined()) {
        bucket.accum.zero_();
      }
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& grad = params_[i].mutable_grad();
    if (set_to_none) {
      grad = at::Tensor();
    } else if (ddp_layout_ && global_has_grad_[i]) {
      grad = grad_views_[i];
    } else if (grad.defined() && !holds_stand_in(i)) {
      grad.zero_();
    }
  }
  if (set_to_none) {
    std::fill(local_has_grad_.begin(), local_has_grad_.end(), 0);
    std::fill(global_has_grad_.begin(), global_has_grad_.end(), 0);
    for (auto& segment : segments_) {
      segment.mutable_grad() = at::Tensor();
    }
  }
}

void GradBuckets::check_param_shapes() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(params_[i].sizes() == c10::IntArrayRef(shapes_[i]), "zero_ext: parameter '", names_[i],
                "' changed shape after zero_ext.wrap() (from ", c10::IntArrayRef(shapes_[i]), " to ",
                params_[i].sizes(), "); its buckets, shards and optimizer state were laid out for "
                "the old shape. Resize parameters (a grown embedding, say) before calling wrap(), "
                "or wrap the resized model anew.");
  }
}

void GradBuckets::check_before_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  reset_if_stale_locked();
  verify_hooks(false);
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad = params_[i].grad();
    if (!trainable_[i]) {
      continue;
    }
    const bool stray = ddp_layout_ ? grad.defined() && !same_memory(grad, grad_views_[i])
                                   : grad.defined() && !holds_stand_in(i);
    TORCH_CHECK(!stray, "zero_ext: parameter '", names_[i],
                "' holds a gradient in .grad that zero_ext did not reduce: either the last "
                "backward ran under no_sync() (run one backward outside it before step()), or "
                "the gradient bypassed zero_ext's hook (the parameter's .data was replaced "
                "after wrap()).");
    const Bucket& bucket = buckets_[bucket_of_[i]];
    const auto* storage = params_[i].storage().unsafeGetStorageImpl();
    const bool released_here = stage_ == 3 && storage == released_[i].unsafeGetStorageImpl();
    TORCH_CHECK((released_here || storage == bucket.param_flat.storage().unsafeGetStorageImpl()) &&
                    params_[i].storage_offset() ==
                        bucket.param_flat.storage_offset() + offset_[i] &&
                    params_[i].dtype() == bucket.param_flat.dtype(),
                "zero_ext: the storage of parameter '", names_[i],
                "' was replaced after zero_ext.wrap() (param.data = ...), so optimizer "
                "updates can no longer reach it. Change parameters in place "
                "(param.data.copy_(...)) or use zero_ext.load_full_state_dict().");
  }
}

void GradBuckets::after_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  refresh_params(/*every_bucket=*/false);
  // The DDP layout's optimizer updates the parameters themselves (torch bumps).
  if (!ddp_layout_) {
    bump_versions(/*every_param=*/false);
  }
}

void GradBuckets::bump_versions(bool every_param) {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (every_param || (trainable_[i] && global_has_grad_[i])) {
      params_[i].unsafeGetTensorImpl()->bump_version();
    }
  }
}

void GradBuckets::refresh_params(bool every_bucket) {
  if (ddp_layout_) {
    return;
  }
  if (!compute_copy_written_) {
    at::NoGradGuard no_grad;
    for (auto& bucket : buckets_) {
      if (bucket.master.defined()) {
        bucket.param_shard.copy_(bucket.master);  // the compute copy of the updated shard
      }
    }
  }
  compute_copy_written_ = false;
  if (replicated_) {
    return;  // param_shard is the whole bucket
  }
  if (stage_ == 3) {
    for (size_t u = 0; u < units_.size(); ++u) {
      const auto unit = static_cast<int64_t>(u);
      release_unit(unit, /*even_pinned=*/true);  // full buffers are stale now
      if (units_[u].pins > 0) {  // a step inside full_params: gather the new values
        start_gather(unit);
        finish_gather(unit);
      }
    }
    return;
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    bool touched = every_bucket;
    for (int64_t i = bucket.first; i < bucket.first + bucket.count && !touched; ++i) {
      touched = global_has_grad_[i];
    }
    if (!touched) {
      continue;  // the optimizer skipped every parameter in it, on every rank
    }
    works[b] = comm_.all_gather(bucket.param_flat, bucket.param_shard);
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    comm_.wait(works[b], [&] { return "all-gather of updated parameters of " + describe_bucket(b); });
  }
}

bool GradBuckets::reset_if_stale() {
  std::lock_guard<std::mutex> lock(mutex_);
  return reset_if_stale_locked();
}

bool GradBuckets::reset_if_stale_locked() {
  if (!epilogue_.is_stale()) {
    return false;
  }
  // The backward raised before its epilogue: wait out what is in flight so no
  // buffer is freed or zeroed under a collective, then forget the round. A
  // failed wait is raised after the cleanup: the group is unusable then.
  std::exception_ptr failure;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (buckets_[b].work) {
      try {
        comm_.wait(buckets_[b].work, [] { return std::string("reduction abandoned by a failed backward"); });
      } catch (...) {
        failure = failure ? failure : std::current_exception();
      }
    }
    buckets_[b].work.reset();
    buckets_[b].reduce_out.reset();
  }
  in_flight_.clear();
  for (auto& bucket : buckets_) {
    bucket.host_add_pending = false;
    bucket.host_factor = 1.0;
  }
  host_transfers_pending_ = false;
  if (ddp_layout_) {
    publish_grads();
  }
  epilogue_.reset();
  start_round();
  release_after_backward(false);
  if (failure) {
    std::rethrow_exception(failure);
  }
  return true;
}

std::vector<at::Tensor> GradBuckets::full_grads() {
  std::lock_guard<std::mutex> lock(mutex_);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> out(params_.size());
  if (ddp_layout_) {
    for (size_t i = 0; i < params_.size(); ++i) {
      out[i] = grad_views_[i].to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    }
    return out;
  }
  std::vector<at::Tensor> full(buckets_.size());
  std::vector<c10::intrusive_ptr<c10d::Work>> works(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    if (bucket.trainable == 0) {
      full[b] = at::zeros({bucket.padded}, bucket.param_flat.options().dtype(at::kFloat));
      continue;
    }
    at::Tensor shard = bucket.accum_has_value ? bucket.accum : at::zeros_like(bucket.accum);
    if (replicated_) {
      full[b] = shard.clone();  // a snapshot, not the live buffer
      continue;
    }
    shard = shard.to(bucket.param_flat.device());  // offloaded: collectives run on the device
    full[b] = at::empty({bucket.padded}, shard.options());
    works[b] = comm_.all_gather(full[b], shard);
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    comm_.wait(works[b], [&] { return "all-gather of gradients for full_grads() of " + describe_bucket(b); });
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    out[i] = full[bucket_of_[i]].narrow(0, offset_[i], params_[i].numel()).view(params_[i].sizes());
  }
  return out;
}

std::vector<at::Tensor> GradBuckets::full_masters() {
  std::lock_guard<std::mutex> lock(mutex_);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> full(buckets_.size());
  std::vector<c10::intrusive_ptr<c10d::Work>> works(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    at::Tensor shard = bucket.master.defined() ? bucket.master : bucket.param_shard.to(at::kFloat);
    if (replicated_) {
      full[b] = shard.clone();  // a snapshot, not the live buffer
      continue;
    }
    shard = shard.to(bucket.param_shard.device());
    full[b] = at::empty({bucket.padded}, shard.options());
    works[b] = comm_.all_gather(full[b], shard);
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    comm_.wait(works[b], [&] { return "all-gather of master weights of " + describe_bucket(b); });
  }
  std::vector<at::Tensor> out(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    out[i] = full[bucket_of_[i]].narrow(0, offset_[i], params_[i].numel()).view(params_[i].sizes());
  }
  return out;
}

void GradBuckets::load_masters(std::vector<at::Tensor> full_params) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(full_params.size() == params_.size(), "zero_ext internal: one tensor per parameter");
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    if (!bucket.master.defined()) {
      continue;
    }
    const int64_t lo = shard_start(bucket);
    for (int64_t i = bucket.first; i < bucket.first + bucket.count; ++i) {
      const int64_t start = std::max(lo, offset_[i]);
      const int64_t end = std::min(lo + bucket.shard, offset_[i] + params_[i].numel());
      if (start < end) {
        bucket.master.narrow(0, start - lo, end - start)
            .copy_(full_params[i].reshape(-1).narrow(0, start - offset_[i], end - start));
      }
    }
    bucket.param_shard.copy_(bucket.master);
  }
}

std::vector<bool> GradBuckets::has_grad() const {
  return std::vector<bool>(global_has_grad_.begin(), global_has_grad_.end());
}

std::vector<int64_t> GradBuckets::bucket_layout() const {
  std::vector<int64_t> out;
  for (const auto& bucket : buckets_) {
    out.push_back(bucket.first);
    out.push_back(bucket.count);
    out.push_back(bucket.padded);
  }
  return out;
}

c10::Dict<std::string, int64_t> GradBuckets::stats() const {
  c10::Dict<std::string, int64_t> out;
  out.insert("epilogues", epilogues_run_);
  out.insert("synced_epilogues", synced_epilogues_);
  out.insert("late_rounds", late_rounds_);
  out.insert("last_graph_task", last_graph_task_);
  out.insert("last_keep_graph", last_keep_graph_ ? 1 : 0);
  out.insert("collectives", comm_.collectives_issued());
  out.insert("all_gathers", comm_.all_gathers_issued());
  out.insert("param_gathers", param_gathers_);
  out.insert("buckets", static_cast<int64_t>(buckets_.size()));
  int64_t param_bytes = 0, grad_bytes = 0;
  for (const auto& bucket : buckets_) {
    param_bytes += bucket.param_flat.storage().nbytes();
    if (stage_ == 3) param_bytes += bucket.param_shard.nbytes();
    if (bucket.staging.defined()) grad_bytes += bucket.staging.nbytes();
    if (bucket.accum.defined()) grad_bytes += bucket.accum.nbytes();
  }
  int64_t master_bytes = 0, host_bytes = 0;
  for (const auto& bucket : buckets_) {
    if (bucket.master.defined()) master_bytes += bucket.master.nbytes();
    if (offload_ && bucket.master.defined()) host_bytes += bucket.master.nbytes();
    if (offload_ && bucket.accum.defined()) host_bytes += bucket.accum.nbytes();
    if (bucket.host_landing.defined()) host_bytes += bucket.host_landing.nbytes();
  }
  out.insert("host_bytes", host_bytes);  // offload: of the above, in host memory
  out.insert("host_landing_buffers", [this] {
    int64_t n = 0;
    for (const auto& bucket : buckets_) n += bucket.host_landing.defined() ? 1 : 0;
    return n;
  }());
  out.insert("nonfinite_backwards", nonfinite_backwards_);
  out.insert("skipped_steps", scaler_.skipped_steps() + nonfinite_skips_);
  out.insert("step_index", step_index_);
  out.insert("param_bytes", param_bytes);
  out.insert("master_bytes", master_bytes);
  out.insert("grad_bytes", grad_bytes);
  out.insert("units", static_cast<int64_t>(units_.size()));
  out.insert("gathered_units", gathered_units());
  out.insert("peak_gathered_units_forward", peak_gathered_forward_);
  out.insert("peak_gathered_units_backward", peak_gathered_backward_);
  return out;
}

} // namespace zero_ext

namespace zero_ext {

void GradBuckets::enable_loss_scaling(double initial_scale, double growth_factor,
                                      double backoff_factor, int64_t growth_interval,
                                      double min_scale, int64_t hysteresis, bool dynamic) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!ddp_layout_, "zero_ext internal: loss scaling needs fp32 masters");
  TORCH_CHECK(initial_scale > 0 && growth_factor >= 1 && backoff_factor > 0 && backoff_factor < 1 &&
                  growth_interval > 0 && min_scale > 0 && hysteresis > 0,
              "zero_ext: loss scaling needs initial_scale > 0, growth_factor >= 1, "
              "0 < backoff_factor < 1, growth_interval > 0, min_scale > 0 and hysteresis > 0");
  LossScalerOptions options;
  options.initial_scale = initial_scale;
  options.growth_factor = growth_factor;
  options.backoff_factor = backoff_factor;
  options.growth_interval = growth_interval;
  options.min_scale = min_scale;
  options.hysteresis = hysteresis;
  options.dynamic = dynamic;
  scaler_.enable(options);
}

void GradBuckets::disable_loss_scaling() {
  std::lock_guard<std::mutex> lock(mutex_);
  scaler_.disable();
}

bool GradBuckets::begin_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable();
  const bool skip = (scaler_.enabled() || skip_nonfinite_) && found_nonfinite_;
  if (skip && !scaler_.enabled()) {
    ++nonfinite_skips_;
  }
  scaler_.update(found_nonfinite_);
  ++step_index_;
  synced_in_step_ = 0;
  return skip;
}

std::vector<at::Tensor> GradBuckets::segment_compute_copies() const {
  std::vector<at::Tensor> out(segments_.size());
  for (size_t s = 0; s < segments_.size(); ++s) {
    const Bucket& bucket = buckets_[bucket_of_[segment_param_[s]]];
    const auto dtype = bucket.param_shard.scalar_type();
    if (!bucket.master.defined() || !bucket.param_shard.device().is_cpu() ||
        (dtype != at::kBFloat16 && dtype != at::kHalf)) {
      continue;
    }
    out[s] = bucket.param_shard.narrow(0, segment_offset_[s], segments_[s].numel())
                 .view(segments_[s].sizes());
  }
  return out;
}

} // namespace zero_ext

namespace zero_ext {

std::vector<at::Tensor> GradBuckets::local_value_shards() const {
  std::vector<at::Tensor> out;
  for (const auto& bucket : buckets_) {
    out.push_back(bucket.master.defined() ? bucket.master : bucket.param_shard);
  }
  return out;
}

std::vector<int64_t> GradBuckets::local_value_starts() const {
  std::vector<int64_t> out;
  for (const auto& bucket : buckets_) {
    out.push_back(shard_start(bucket));
  }
  return out;
}

std::vector<int64_t> GradBuckets::segment_param_starts() const {
  std::vector<int64_t> out;
  for (size_t s = 0; s < segments_.size(); ++s) {
    const int64_t i = segment_param_[s];
    out.push_back(shard_start(buckets_[bucket_of_[i]]) + segment_offset_[s] - offset_[i]);
  }
  return out;
}

std::vector<double> GradBuckets::loss_scaler_state() const {
  return {scaler_.scale(), static_cast<double>(scaler_.clean_steps()),
          static_cast<double>(scaler_.skipped_steps())};
}

void GradBuckets::restore_loss_scaler(double scale, int64_t clean_steps, int64_t skipped_steps) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (scaler_.enabled()) {
    scaler_.restore(scale, clean_steps, skipped_steps);
  }
}

void GradBuckets::refresh_params_from_shards() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& bucket : buckets_) {
    bucket.accum_has_value = false;  // a loaded model starts with no gradient
  }
  compute_copy_written_ = false;
  refresh_params(/*every_bucket=*/true);
  bump_versions(/*every_param=*/true);
}

} // namespace zero_ext
