#pragma once
// GradBuckets: the per-model gradient path of ZeRO stages 0-3 (stage 3
// units, gathered and released around their use, are in units.cpp).
//
// Trainable parameters are laid out at wrap time in flat buckets (one dtype,
// one optimizer param group each, `bucket_mb` large, in reverse registration
// order so they fill in the order backward produces gradients). Each bucket is
// padded to a multiple of the world size; rank r owns the r-th equal shard.
// Parameters become views into their bucket's flat buffer, so one collective
// moves a whole bucket.
//
// A post hook on each parameter's AccumulateGrad node (C++, no Python per
// gradient) moves the gradient into the bucket's staging buffer; a bucket's
// reduction starts as soon as all its parameters have arrived, strictly in
// bucket order so every rank issues the same sequence of collectives even when
// ranks use different parameters. The epilogue (see epilogue.h) flushes the
// rest with zeros for missing gradients, waits, and publishes the results.
//
// Where the reduced gradient lives:
//   stage 0  staging *is* the gradient: param.grad views it and it is
//            all-reduced in place (DDP's layout; a previous result A is the
//            same on every rank, so sum((A + g_r) / N) = A + mean(g_r)).
//   stage 1  staging is persistent; each reduction reduce-scatters it and adds
//            the rank's shard into a persistent fp32 shard accumulator.
//   stage 2  as 1, but staging exists only while its bucket is being filled
//            and reduced: no full gradient survives a backward.
//   stage 3  as 2, and parameters are sharded too: each bucket belongs to a
//            unit (a block gathered as one); the rank keeps a persistent
//            shard, and the full buffer is gathered before the unit's forward
//            and backward and released after (see param_storage.h).
// In stages 1-3 the optimizer works on "segments": views of the local shard
// cut at parameter boundaries, whose .grad views the accumulator.
//
// Mixed precision and offload keep an fp32 "master" copy of each shard that
// the optimizer steps instead; parameters compute in the low-precision copy,
// refreshed after each step. Stage 0 with masters is "replicated": the shard
// is the whole bucket, reduced by all-reduce, and the gradient path is that of
// stage 1 (staging in the reduction dtype, fp32 accumulator). With
// offload_optimizer the masters and accumulators live in host memory (pinned
// when the parameters are on an accelerator): each backward's reduced shard is
// added into the host accumulator, never copied over it.

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <c10/core/Storage.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/custom_class.h>

#include "communicator.h"
#include "epilogue.h"
#include "loss_scaler.h"

namespace zero_ext {

class GradBuckets : public torch::CustomClassHolder {
 public:
  // params: in bucket order; trainable: which get gradients (stage 3 also
  // shards frozen ones); unit_of_bucket: stage 3 unit of each bucket (the
  // root unit is 0), ignored otherwise; gather_group_name: the group stage 3
  // gathers parameters on ("" = group_name); prefetch: units gathered ahead;
  // compute_dtype: mixed precision (stages 1-3): fp32 parameters are cast to
  // this c10::ScalarType for compute, and the optimizer steps fp32 master
  // shards instead (-1: none). reduce_dtype: the dtype gradients are reduced
  // in (-1: fp32). offload: masters and accumulators in host memory.
  GradBuckets(std::vector<at::Tensor> params,
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
              bool offload);
  ~GradBuckets() override;

  // --- autograd entry points --------------------------------------------
  void on_grad_ready(int64_t param_index);
  // A gradient reached a forward output: arms the epilogue and returns the
  // factor the gradient entering the model takes (the loss scale, or 1 for
  // backward passes that accumulate nothing, like torch.autograd.grad).
  double on_output_grad();
  void attach_output_hook(const at::Tensor& output);
  void run_epilogue();

  // --- stage 3 units (called from module hooks) ---------------------------
  void pre_forward(int64_t unit);
  void post_forward(int64_t unit, std::vector<at::Tensor> outputs);
  void pre_backward(int64_t unit);
  // Use tracking for releasing a unit inside backward (see the note at
  // unit_backward_done): a use whose inputs require grad, its completion,
  // and a use whose inputs do not.
  void add_pending_use(int64_t unit);
  void post_backward_use(int64_t unit);
  void note_untracked_use(int64_t unit);
  void gather_all();
  // Gathers the units holding these parameters (indices into the bucketed
  // parameters), for zero_ext.full_params on a submodule.
  // They stay gathered (pinned) until unpin_units_of() with the same indices.
  void gather_units_of(std::vector<int64_t> param_indices);
  void unpin_units_of(std::vector<int64_t> param_indices);
  void release_all();
  // After full parameters were written (load_full_state_dict): keep the shards.
  void write_back_shards();

  // --- loss scaling and non-finite gradients ---------------------------
  // fp16: scale the gradient entering the model at its outputs (see loss_scaler.h).
  void enable_loss_scaling(double initial_scale, double growth_factor, double backoff_factor,
                           int64_t growth_interval, double min_scale, int64_t hysteresis,
                           bool dynamic);
  void disable_loss_scaling();
  double loss_scale() const { return scaler_.scale(); }
  bool loss_scaling() const { return scaler_.enabled(); }
  // Whether any rank's reduced gradient held inf/nan since the last zero_grad().
  bool found_nonfinite() const { return found_nonfinite_; }
  // Once per optimizer.step(): returns whether to skip it (a gradient was
  // non-finite on some rank, and fp16 loss scaling or skip_nonfinite is on),
  // and updates the scale.
  bool begin_step();
  // Every forward: a parameter resized after wrap() is refused by name.
  void check_param_shapes() const;
  void set_skip_nonfinite(bool skip) { skip_nonfinite_ = skip; }
  // See [Note: stall diagnosis] in communicator.h.
  void enable_stall_diagnosis(double seconds, const std::string& key_space) {
    if (!params_[0].device().is_cpu()) {
      return;  // NCCL: the watchdog bounds waits; a timed wait would block the host
    }
    comm_.enable_stall_diagnosis(seconds, key_space);
    gather_comm_.enable_stall_diagnosis(seconds, key_space);
  }

  // --- training-loop controls ------------------------------------------
  void set_sync(bool sync);
  bool sync() const { return sync_; }
  void zero_grad(bool set_to_none);
  // After optimizer.step(): stages 1-2 all-gather every bucket whose shard
  // changed; stage 3 drops full buffers, now stale (the next forward gathers).
  void after_step();
  // Offload: the optimizer wrote the compute copy itself (the fused CPU Adam),
  // so the next after_step() skips copying masters into parameters.
  void note_compute_copy_written() { compute_copy_written_ = true; }
  // Per segment: where a fused optimizer may write the updated parameter in
  // the compute dtype (undefined where it cannot: another device or fp32).
  std::vector<at::Tensor> segment_compute_copies() const;
  // Before a step: raises if a gradient bypassed zero_ext's hook, or a
  // parameter's storage is no longer the bucket's.
  void check_before_step();
  // Drops state left by a backward that raised before its epilogue ran.
  bool reset_if_stale();

  // --- inspection ---------------------------------------------------------
  std::vector<at::Tensor> segments() const { return segments_; }
  std::vector<int64_t> segment_param_indices() const { return segment_param_; }
  // Full averaged gradient of each parameter (flat, fp32); has_grad() tells
  // which are real. Collective in stages 1-2: every rank must call it.
  std::vector<at::Tensor> full_grads();
  // Mixed precision: the fp32 master value of each parameter (collective), and
  // loading them back from full fp32 tensors (one per parameter).
  bool has_masters() const { return has_masters_; }
  std::vector<at::Tensor> full_masters();
  void load_masters(std::vector<at::Tensor> full_params);
  std::vector<bool> has_grad() const;
  bool offloaded() const { return offload_; }
  // Checkpoints: per bucket, the tensor holding this rank's values (the fp32
  // master where there is one, else the parameters' own shard) and the
  // element of the bucket it starts at; each segment's first element within
  // its parameter; the loss scaler's (scale, clean steps, skipped steps).
  std::vector<at::Tensor> local_value_shards() const;
  std::vector<int64_t> local_value_starts() const;
  std::vector<int64_t> segment_param_starts() const;
  std::vector<double> loss_scaler_state() const;
  void restore_loss_scaler(double scale, int64_t clean_steps, int64_t skipped_steps);
  // After shards were written (checkpoint load): refresh the compute copies
  // and the full parameters everywhere (stages 1-2 all-gather, stage 3 drops
  // gathered units). Collective.
  void refresh_params_from_shards();
  bool replicated() const { return replicated_; }
  std::vector<int64_t> bucket_layout() const;  // (first param, count, padded numel) triples
  c10::Dict<std::string, int64_t> stats() const;
  int64_t rank() const { return comm_.rank(); }
  int64_t world_size() const { return comm_.size(); }

 private:
  struct Bucket {
    int64_t first = 0;        // index of its first parameter in params_
    int64_t count = 0;        // parameters in it
    int64_t numel = 0;        // their elements
    int64_t padded = 0;       // numel rounded up to a multiple of world size
    int64_t shard = 0;        // padded / world size
    int64_t trainable = 0;    // parameters in it that get gradients
    int64_t unit = -1;        // stage 3
    at::Tensor param_flat;    // the parameters' storage (stage 3: released between uses)
    at::Tensor param_shard;   // this rank's shard of param_flat (stage 3: its own memory)
    at::Tensor master;        // mixed precision: fp32 shard the optimizer steps
    c10::intrusive_ptr<c10d::Work> gather_work;
    at::Tensor staging;       // gradients being reduced (see header comment)
    at::Tensor accum;         // stages 1-2: fp32 shard of the reduced gradient
    bool accum_has_value = false;
    at::Tensor reduce_out;    // temporary output when accum already holds a sum
    at::Tensor host_landing;  // offload from an accelerator: pinned copy of reduce_out
    bool host_add_pending = false;
    double host_factor = 1.0;  // applied once the landed result is on the host
    int64_t waiting = 0;      // parameters not yet arrived in this round
    bool launched = false;
    c10::intrusive_ptr<c10d::Work> work;
  };

  struct Unit {
    std::vector<int64_t> buckets;
    enum class State { kReleased, kGathering, kGathered } state = State::kReleased;
    int64_t pending_uses = 0;    // uses whose input gradients are not complete yet
    bool tracked_use = false;    // some use since the last epilogue had such inputs
    bool untracked_use = false;  // some use had no input requiring grad
    int64_t pins = 0;            // open zero_ext.full_params contexts holding it gathered
  };

  at::Tensor staging_region(Bucket& bucket, int64_t param_index);
  void start_gather(int64_t unit);
  void finish_gather(int64_t unit);
  // A pinned unit stays gathered (full_params) unless `even_pinned`.
  void release_unit(int64_t unit, bool even_pinned = false);
  // Stage 3: the bucket's parameters point at its buffer (gathered) or at
  // their unreadable stand-ins (released).
  void point_params(const Bucket& bucket, bool gathered);
  // Parameters whose values were just rewritten (step, load) bump their
  // autograd version, as an in-place update in plain PyTorch would, so a
  // graph saved before raises "modified by an inplace operation".
  void bump_versions(bool every_param);
  void prefetch_around(int64_t unit, bool forward);
  void finish_forward_order();
  Unit& unit_at(int64_t unit);
  bool unit_backward_done(int64_t unit) const;
  int64_t gathered_units() const;
  void ensure_staging(Bucket& bucket);
  std::vector<int64_t> units_of(const std::vector<int64_t>& param_indices) const;
  void arm_epilogue();
  void launch_ready_buckets();
  void launch(int64_t bucket_index);
  void wait_all();
  void retire(int64_t bucket_index);  // waits one reduction and folds it in
  void retire_completed();            // retires finished reductions, oldest first
  bool reset_if_stale_locked();
  void maybe_release_after_unit_backward(int64_t unit);
  bool unit_has_trainable(int64_t unit) const;
  void start_round();
  // Masters -> compute copies, then full parameters where the stage keeps
  // them: every bucket, or only those with a gradient on some rank.
  void refresh_params(bool every_bucket);
  int64_t shard_start(const Bucket& bucket) const;  // first element of this rank's shard
  void fold_into_accum(Bucket& bucket, const at::Tensor& reduced, double factor);
  void finish_host_adds();
  at::Tensor local_nonfinite() const;  // 0-dim float flag on the accumulators' device
  void mark_nonfinite_everywhere();
  // Returns whether any rank's reduced shard is non-finite.
  bool exchange_grad_mask_and_flags(const at::Tensor& nonfinite);
  void publish_grads();
  void verify_hooks(bool after_sync) const;
  void release_after_backward(bool keep_graph);
  std::string describe_bucket(int64_t bucket_index) const;
  std::string describe_unit(int64_t unit) const;
  std::string where() const;  // "step N, backward K"
  void check_ranks_agree(const float* rows, int64_t width) const;
  void maybe_inject_fault(const char* point);
  void on_grad_ready_locked(int64_t param_index);
  // Called inside a catch block: remembers the error that left this rank's
  // collectives out of step; check_usable() then refuses to go on.
  void mark_broken();
  void check_usable() const;

  const int64_t stage_;
  // Stage 0 without masters: param.grad views the all-reduced staging (DDP).
  bool ddp_layout_ = true;
  bool replicated_ = false;  // stage 0 with masters (see the header comment)
  bool offload_ = false;
  at::ScalarType reduce_dtype_ = at::kFloat;  // staging dtype outside the DDP layout
  LossScaler scaler_;
  bool found_nonfinite_ = false;
  bool compute_copy_written_ = false;
  int64_t nonfinite_backwards_ = 0;
  // skip_nonfinite=True: fp32/bf16 steps with a non-finite gradient on any
  // rank are skipped (fp16 loss scaling skips them regardless).
  bool skip_nonfinite_ = false;
  int64_t nonfinite_skips_ = 0;
  // Where this rank is, for error messages and the divergence check that
  // rides the mask exchange: optimizer steps taken, synced backwards since
  // the last step, and stage 3 gathers of each unit since the last exchange.
  int64_t step_index_ = 0;
  int64_t synced_in_step_ = 0;
  std::vector<int64_t> unit_gathers_;  // one per unit with parameters, fixed at wrap()
  // Test-only fault injection (ZERO_EXT_TEST_FAULT=point:rank[:step]): raise
  // inside the gradient hook or the epilogue on one rank.
  std::string fault_point_;
  std::string broken_;  // non-empty: first line of the error that broke this rank
  int64_t fault_step_ = -1;
  int64_t output_hook_task_ = -1;  // last graph task whose gradient passed an output hook
  Communicator comm_;
  // Stage 3 gathers parameters on a group of their own: gathers are issued
  // from forward/backward hooks, reductions as buckets fill, and the engine
  // may interleave the two differently on ranks whose graphs differ. Two
  // groups keep each sequence identical on every rank.
  Communicator gather_comm_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> shapes_;  // at wrap(): a later change is refused
  std::vector<uint8_t> trainable_;
  std::vector<int64_t> bucket_of_;
  std::vector<int64_t> offset_;  // element offset of each param in its bucket
  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> grad_views_;  // stage 0: param-shaped views of staging
  // [Note: gradient stand-ins]
  // Outside the DDP layout a reduced gradient lives in the optimizer's shards,
  // so param.grad would be None after backward and torch.nn.utils.
  // clip_grad_norm_(model.parameters()) would silently clip nothing. Instead
  // param.grad holds a stand-in of the parameter's shape with no memory, whose
  // data access raises an error naming zero_ext.clip_grad_norm_; a pre hook on
  // the AccumulateGrad node drops it before the next gradient accumulates.
  std::vector<at::Tensor> grad_stand_ins_;
  bool holds_stand_in(size_t i) const;
  // Stage 3: what each parameter points at while its unit is released (see
  // [Note: unreadable released parameters] in param_storage.h).
  std::vector<c10::Storage> released_;

  // Strong references: a tensor holds its AccumulateGrad node only weakly, and
  // a hook on a node that was dropped and re-created would never fire. (The
  // pointer type changed across torch releases: take whatever it returns.)
  using NodeRef = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<NodeRef> accumulators_;
  std::vector<const void*> accumulator_nodes_;  // the same, for exec_info lookups
  std::vector<uintptr_t> hook_keys_;

  std::vector<at::Tensor> segments_;
  std::vector<at::Tensor> segment_grads_;
  std::vector<int64_t> segment_param_;
  std::vector<int64_t> segment_offset_;  // in its bucket's shard
  bool host_transfers_pending_ = false;   // offload: device-to-host copies in flight

  // Round state: one round is one synchronized reduction of every bucket.
  std::vector<uint8_t> arrived_;
  std::vector<uint8_t> detached_;   // stage 0: grad moved into staging for a reduction
  int64_t next_launch_ = 0;
  std::deque<int64_t> in_flight_;   // launched, not yet retired, oldest first
  bool late_ = false;               // a gradient came after its bucket was launched

  // Since the last zero_grad: which parameters got a gradient here / anywhere.
  std::vector<uint8_t> local_has_grad_;
  std::vector<uint8_t> global_has_grad_;

  // Stage 3: units, and the order they ran in the last forward (for prefetch).
  std::vector<Unit> units_;
  std::vector<int64_t> forward_order_;       // being recorded
  std::vector<int64_t> last_forward_order_;  // complete
  int64_t forward_cursor_ = 0;
  int64_t backward_cursor_ = 0;
  int64_t prefetch_ = 1;
  int64_t param_gathers_ = 0;  // bucket all-gathers of stage 3 parameters
  bool replaying_retained_graph_ = false;  // the last backward kept its graph
  int64_t peak_gathered_forward_ = 0;       // most units gathered at once, outside backward
  int64_t peak_gathered_backward_ = 0;      // and inside
  bool gathering_all_ = false;  // gather_all() for inspection: not a peak
  bool has_masters_ = false;

  bool sync_ = true;
  Epilogue epilogue_;
  std::mutex mutex_;

  int64_t epilogues_run_ = 0;
  int64_t synced_epilogues_ = 0;
  int64_t late_rounds_ = 0;
  int64_t last_graph_task_ = -1;
  bool last_keep_graph_ = false;
};

} // namespace zero_ext
