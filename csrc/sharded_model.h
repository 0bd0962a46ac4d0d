#pragma once
// ShardedModel: the C++ core of one wrapped model, registered as
// torch.classes.zero_ext.ShardedModel, built whole from its CoreConfig. A
// thin facade: it owns the components below, takes the lock, and routes each
// entry point (autograd hooks, module hooks, the optimizer wrapper,
// checkpoints) to the component that does the work. Python calls it only
// through its views by concern (core_views.h), which bind these member
// functions. See csrc/README.md for the path of one gradient and of one unit.
//
//   Layout         immutable geometry: buckets, shards, segments   layout.h
//   ParamStore     flat, shard, master and compute-copy buffers     param_store.h
//   GradReducer    gradient arrival, bucket reduction, accumulation grad_reducer.h
//   UnitScheduler  stage 3 gather / prefetch / release              units.h
//   RankAgreement  the per-backward mask exchange, divergence check rank_agreement.h
//   StepGate       loss scaling, skip decisions, progress           step_gate.h
//   GradHooks      hooks on the parameters' AccumulateGrad nodes    autograd_hooks.h
//   BackwardRound  the epilogue, broken and stale rounds            backward_round.h

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <c10/core/ScalarType.h>
#include <torch/custom_class.h>

#include "autograd_hooks.h"
#include "backward_round.h"
#include "collective_sequence.h"
#include "communicator.h"
#include "core_config.h"
#include "fault_injection.h"
#include "grad_reducer.h"
#include "layout.h"
#include "mesh.h"
#include "param_store.h"
#include "rank_agreement.h"
#include "step_gate.h"
#include "swap_space.h"
#include "units.h"

namespace zero_ext {

class ShardedModel : public torch::CustomClassHolder {
 public:
  // params: in bucket order; trainable: which get gradients (stage 3 also
  // shards frozen ones); unit_of_bucket: stage 3 unit of each bucket (root: 0);
  // owner_of_param: the rank stepping each parameter whole ([Note:
  // whole-parameter layout]; empty: elementwise). Everything else is in
  // `config` (core_config.h), applied here once: nothing configures the
  // model after it is built.
  ShardedModel(std::vector<at::Tensor> params, std::vector<std::string> names, std::vector<int64_t> trainable,
               std::vector<int64_t> params_per_bucket, std::vector<int64_t> unit_of_bucket,
               std::vector<int64_t> owner_of_param, c10::intrusive_ptr<CoreConfig> config);

  // --- the model's forward (one call each from its pre and post hooks) -------
  // Drops a stale backward round, checks parameter shapes, gathers the root unit.
  void begin_forward();
  // The same from a graph torch.compile traced ([Note: the model's forward
  // in a compiled graph] in core_ops.cpp): stage 3 gathers no unit here; the
  // graph reads each parameter through gathered_param. `grad`: whether the
  // forward records a graph (a compiled forward runs under no_grad);
  // `detached_reads`: traced with compiled autograd on ([Note: compiled
  // autograd] in sharded_model_graph.cpp).
  void begin_graph_forward(bool grad, bool detached_reads);
  void end_graph_forward();
  // torch.ops.zero_ext.gathered_param: parameter `param_index`'s full value,
  // a fresh tensor ([Note: stage 3 in a compiled graph] in units_graph.cpp).
  at::Tensor gathered_param(int64_t param_index);
  // torch.ops.zero_ext.grad_arrived: a gradient of parameter `param_index`
  // inside a compiled backward graph ([Note: gradients handed over in the
  // graph] in sharded_model_graph.cpp). Returns what autograd passes on.
  at::Tensor grad_arrived(int64_t param_index, const at::Tensor& grad);
  // Under compiled autograd ([Note: compiled autograd] in
  // sharded_model_graph.cpp): torch.ops.zero_ext.hand_over_grad takes a read's
  // gradient as grad_arrived does, returning a token for the model's anchor;
  // torch.ops.zero_ext.backward_over runs the epilogue the backward armed.
  void hand_over_grad(int64_t param_index, const at::Tensor& grad);
  void backward_over();
  // Hooks the outputs (the epilogue's owner, the fp16 loss scale) and ends
  // the root unit's forward.
  void end_forward(std::vector<at::Tensor> outputs);
  // The model's forward raised after begin_forward (`error`: what it
  // raised, for the message): this rank breaks if that forward's collectives
  // had begun ([Note: a forward that raised] in forward_raised_agreement.cpp).
  void forward_raised(std::string error);

  // --- autograd ------------------------------------------------------------
  // `launch_complete`: stage 3 in a compiled graph, a bucket this completes
  // goes out at once (no unit events there; [Note: gradients handed over in the graph]).
  void on_grad_ready(int64_t param_index, bool launch_complete = false);
  // torch.ops.zero_ext.accumulate_grad: one arrival of parameter
  // `param_index`'s gradient. The hook passes .grad itself; another tensor is
  // accumulated into .grad first, as AccumulateGrad would.
  void accumulate_grad(int64_t param_index, const at::Tensor& grad, bool launch_complete = false);
  void check_grad_shape(int64_t param_index, const at::Tensor& grad);
  // The post-backward work (torch.ops.zero_ext.run_epilogue), queued on the
  // engine by the first hook of a backward.
  void run_epilogue();
  // A gradient reached a forward output: arms the epilogue and returns the
  // factor the gradient entering the model takes (the loss scale, or 1 for
  // backward passes that accumulate nothing, like torch.autograd.grad).
  double on_output_grad();
  void attach_output_hook(const at::Tensor& output);

  // --- stage 3 units (module hooks) -----------------------------------------
  void pre_forward(int64_t unit);
  void post_forward(int64_t unit, std::vector<at::Tensor> outputs);
  void pre_backward(int64_t unit);
  // A merged unit's inner members: before these outputs' gradients flow on,
  // make sure the unit is gathered.
  void hook_regather(std::vector<at::Tensor> outputs, int64_t unit);
  // Use tracking: Python's fallback for inputs it cannot pass through a
  // boundary node reports with these; autograd_boundaries.h with use_done.
  int64_t add_pending_use(int64_t unit);
  void post_backward_use(int64_t unit);
  void note_untracked_use(int64_t unit);
  void use_done(int64_t unit, int64_t round);
  // A use's graph died without a backward; may run anywhere (a destructor),
  // so it is queued and handled at the next entry point.
  void defer_use_done(int64_t unit, int64_t round);
  void gather_all();
  // set_modules_to_forward/backward_prefetch (see UnitScheduler::set_prefetch).
  void set_prefetch(int64_t unit, bool forward, std::vector<int64_t> units);
  // model.unshard(async_op) / the handle's wait(): every unit gathered
  // ahead of use; model.reshard() is release_all().
  void unshard(bool async_op);
  void wait_unshard();
  void gather_units_of(std::vector<int64_t> param_indices);
  void unpin_units_of(std::vector<int64_t> param_indices);
  void release_all();
  void write_back_shards();
  // Deferred initialization: open buckets (their parameters view zeroed full
  // buffers), then close them (collective: rank 0's values broadcast, this
  // rank's shards kept).
  void begin_materialize(std::vector<int64_t> buckets);
  void end_materialize(std::vector<int64_t> buckets);

  // --- loss scaling, non-finite gradients, the step ---------------------------
  void disable_loss_scaling();
  double loss_scale();
  bool loss_scaling();
  // Collective (settles first): whether a gradient since zero_grad was
  // non-finite on some rank.
  bool found_nonfinite();
  // Before begin_step: another group of ranks (a tensor-parallel model's
  // other tp ranks) found a non-finite gradient; this step decides as they do.
  void note_nonfinite_elsewhere();
  // Once per optimizer.step(): whether to skip it (StepDecision, as an int).
  int64_t begin_step();
  // Before a step: raises if a gradient bypassed zero_ext's hook, or a
  // parameter's storage is no longer the bucket's.
  void check_before_step();
  // After optimizer.step(): stages 1-2 all-gather every bucket whose shard
  // changed; stage 3 drops full buffers, now stale (the next forward gathers).
  // After an optimizer's step: the updated shards reach the parameters. `params`:
  // the parameters that optimizer steps (empty: every one; a model with several).
  void after_step(std::vector<int64_t> params);
  void note_compute_copy_written();
  std::vector<at::Tensor> segment_compute_copies();
  void check_param_shapes();
  // [Note: whereabouts] in communicator.h: called from the answering thread,
  // touch only the store (never the model's state), so they need no lock.
  int64_t stall_queries() const;
  void post_whereabouts(int64_t query, bool blocked, std::string where) const;

  // --- training-loop controls ---------------------------------------------
  void set_sync(bool sync);
  bool sync();
  // Hybrid: whether backwards all-reduce across replicas (FSDP2's
  // set_requires_all_reduce; [Note: deferred replica all-reduce]).
  void set_replica_sync(bool sync);
  // Gradients reduce to the sum over ranks divided by `factor` (0: the mean).
  void set_gradient_divide_factor(double factor);
  // [Note: traffic] Bytes this rank sent since wrap, by TrafficKind.
  std::vector<int64_t> traffic() const;
  // Bytes of the error-feedback residuals compress_grads holds.
  int64_t residual_bytes();
  bool replica_sync();
  void zero_grad(bool set_to_none);
  bool reset_if_stale();

  // --- inspection and checkpoints --------------------------------------------
  std::vector<at::Tensor> segments();
  std::vector<int64_t> segment_param_indices();
  std::vector<int64_t> segment_param_starts();
  std::vector<at::Tensor> full_grads();
  std::vector<bool> has_grad();
  bool has_masters();
  bool replicated();
  bool params_sharded();  // stage 3: parameters hold no memory between uses
  bool whole_params();    // the optimizer steps whole parameters ([Note: whole-parameter layout])
  // Whether a collective of this model failed or its ranks were found apart:
  // its groups are out of step for good (never to be reused).
  bool failed();
  std::vector<at::Tensor> full_masters();
  std::vector<at::Tensor> full_masters_of(std::vector<int64_t> buckets);
  void load_masters(std::vector<at::Tensor> full_params);
  std::vector<at::Tensor> local_value_shards();
  // Flat (param, start in param, bucket, start in that bucket's local shard,
  // length) quintuples: every value this rank holds.
  std::vector<int64_t> local_pieces();
  // Flat (param, start, end) triples that `rank` writes in a checkpoint.
  std::vector<int64_t> owned_ranges(int64_t rank);
  std::vector<int64_t> bucket_layout();  // (first param, count, padded numel) triples
  std::vector<double> loss_scaler_state();
  void restore_loss_scaler(double scale, int64_t clean_steps, int64_t skipped_steps);
  // Collective: reads what the ranks agreed on since the last read and
  // finishes the gradients (see [Note: host syncs] in rank_agreement.h);
  // anything that reads gradients outside the optimizer step calls it first.
  void settle();
  // After shards were written (checkpoint load): refresh compute copies and
  // full parameters everywhere. Collective.
  void refresh_params_from_shards();
  c10::Dict<std::string, int64_t> stats();
  std::string grad_layout();

  // --- Python's collectives on zero_ext's own group -----------------------
  // clip_grad_norm_, wrap()'s buffer broadcast and the checkpoint exchanges go
  // through the communicator like the core's own collectives, so a failure
  // marks the group failed and a stalled wait is diagnosed (communicator.h).
  // `what` names the collective in errors. Collective; in place.
  void group_all_reduce(at::Tensor tensor, bool max, std::string what);
  void group_broadcast_from_rank0(at::Tensor tensor, std::string what);
  void group_all_gather(at::Tensor out, at::Tensor in, std::string what);
  // The same over every rank of the mesh (both levels; the group's when
  // flat): checkpoint exchanges, wrap()'s broadcasts. all_gather's output
  // is in mesh-rank order.
  void mesh_all_reduce(at::Tensor tensor, bool max, std::string what);
  void mesh_broadcast_from_rank0(at::Tensor tensor, std::string what);
  void mesh_all_gather(at::Tensor out, at::Tensor in, std::string what);

  // --- offload_*="nvme" ([Note: swapped buffers] in swap_space.h) ---------
  bool swapped();
  // The optimizer's step, bucket by bucket (zero_ext/optim/streamed_step.py):
  // values and gradients in memory, the segments and their .grad viewing
  // them; read ahead; parked again (values written back when `stepped`,
  // gradients when `grads_dirty`).
  void swap_in(std::vector<int64_t> buckets);
  void swap_prefetch(std::vector<int64_t> buckets);
  void swap_out(std::vector<int64_t> buckets, bool stepped, bool grads_dirty);
  // The gradients alone (a clip, chunk by chunk): in memory, then parked
  // (written back if `dirty`).
  void swap_in_grads(std::vector<int64_t> buckets);
  void swap_out_grads(std::vector<int64_t> buckets, bool dirty);
  // Every write in flight done (the end of a streamed step); raises the first failure.
  void swap_drain();
  c10::Dict<std::string, int64_t> swap_stats();
  void swap_reset_peak();
  // Test-only (zero_ext/tools/faults.py): writes past `bytes` more fail (ENOSPC).
  void swap_fail_writes_after(int64_t bytes);

  // Bytes of gradient reductions in flight before backward waits for the
  // oldest (stages 2-3; see [Note: reductions in flight] in grad_reducer.h).
  void set_max_in_flight_bytes(int64_t bytes);
  // Test-only (zero_ext/tools/faults.py): raise at `point` on this rank.
  void set_test_fault(std::string point, int64_t step);
  // Test-only: record every collective of both groups in issue order
  // ("reduce ..." / "gather ..."); take_issue_log() returns and clears it.
  void log_issues(bool on);
  std::vector<std::string> take_issue_log();

 private:
  // The constructor's setting (sharded_model_config.cpp), each once.
  void apply_config(const CoreConfig& config);
  void enable_compression(int64_t weight_bits, int64_t grad_bits, int64_t block);
  void enable_swap(const CoreConfig& config);  // this rank's offload file, its space reserved
  void set_unit_advice(const std::vector<std::string>& advice);  // per unit (see Layout::advice_for)
  void enable_collective_checks(const CoreConfig& config);  // collective_sequence.h
  void enable_stall_diagnosis(const CoreConfig& config);    // communicator.h
  void arm_epilogue();
  // The next collective on each group starts a round of this kind.
  // A gradient a compiled backward handed over: accumulated, and a bucket
  // launched once complete; .grad never keeps the graph's own buffer.
  void take_graph_grad(int64_t param_index, const at::Tensor& grad);
  // begin_forward's checks and round, shared with begin_graph_forward.
  void open_forward(bool grad, GradientRoute::Forward kind);
  void begin_round(RoundKind kind, int64_t detail = 0, const std::string& label = {});
  // Inside a backward that reaches the parameters, its first event begins a
  // backward round, whatever that event is (the order of hooks on one
  // tensor differs between ranks whose graphs differ).
  void enter_backward_round();
  void begin_python_round(const std::string& what);
  std::string describe_collective(const CollectiveId& id, const std::string& label) const;
  c10::intrusive_ptr<ShardedModel> self();
  // Before `output`'s gradient flows into the unit, gather it (backward:
  // prefetching in backward order, as a unit's pre-backward does).
  void hook_gather(const at::Tensor& output, int64_t unit, bool backward);
  void refresh_params(bool every_bucket, const std::vector<uint8_t>& only = {});
  // Stage 3: unit u's last use in this backward is over ([Note: issue order]).
  void launch_unit_reductions(int64_t u);
  void drain_deferred_uses();  // under mutex_
  int64_t collectives_submitted() const;  // on all of the model's groups
  void check_buckets(const std::vector<int64_t>& buckets) const;  // indices from Python

  std::shared_ptr<IssueCounts> issue_counts_;  // shared by the communicators below
  std::shared_ptr<Traffic> traffic_;          // [Note: traffic], counted by the communicators below
  Communicator comm_;
  // Stage 3 gathers on a group of its own (see units.h).
  Communicator gather_comm_;
  Communicator replica_comm_;
  // Stage 3 units resharded to a subgroup after forward gather again in it
  // ([Note: resharding to a subgroup] in units.cpp); none otherwise.
  Communicator regather_comm_;
  // The expert buckets' group ([Note: expert buckets] in layout.h); none otherwise.
  Communicator expert_comm_;
  Mesh mesh_;
  IssueLog issue_log_;
  Layout layout_;
  StepGate gate_;
  ParamStore store_;
  GradReducer reducer_;
  std::unique_ptr<UnitScheduler> units_;  // stage 3
  RankAgreement agreement_;
  GradHooks hooks_;
  FaultInjector faults_;
  BackwardRound round_;
  bool sync_ = true;
  // Whether a backward reduces in its own epilogue: not under no_sync(), nor
  // on a pipeline stage ([Note: reductions at read] in backward_round.h).
  bool reduces_in_backward() const { return sync_ && !round_.reduce_at_read(); }
  bool in_backward_round_ = false;  // a backward round began and its epilogue has not run
  // Per forward of the model in progress (nested ones too): the collectives
  // submitted before it began.
  std::vector<int64_t> forward_marks_;
  int64_t raised_forwards_ = 0;  // forwards that raised after their collectives began, numbered alike on every rank
  double raised_forward_limit_s_ = 1800.0;  // set with the stall diagnosis
  std::mutex mutex_;
  std::mutex deferred_mutex_;  // guards only deferred_uses_
  std::vector<std::pair<int64_t, int64_t>> deferred_uses_;  // (unit, round)
  std::atomic<bool> has_deferred_uses_{false};
  std::unique_ptr<SwapSpace> swap_;  // offload_*="nvme"; store_ and reducer_ hold its slots
};

} // namespace zero_ext
