// The bound classes of core_views.h: which of the model's entry points each
// concern offers. A method a concern does not list is not reachable from it.
#include "core_views.h"

#include <string>
#include <utility>
#include <vector>

#include "autograd_boundaries.h"
#include "core_ops.h"

namespace zero_ext {
namespace {

// View::method(args) calls model->method(args): the signature is the member
// function's, so the schema torch infers is the model's own.
template <class View, auto Method, class Signature = decltype(Method)>
struct OnModel;

template <class View, auto Method, class R, class... Args>
struct OnModel<View, Method, R (ShardedModel::*)(Args...)> {
  static R call(const c10::intrusive_ptr<View>& view, Args... args) {
    return ((*view->model).*Method)(std::forward<Args>(args)...);
  }
};

template <class View, auto Method, class R, class... Args>
struct OnModel<View, Method, R (ShardedModel::*)(Args...) const> {
  static R call(const c10::intrusive_ptr<View>& view, Args... args) {
    return ((*view->model).*Method)(std::forward<Args>(args)...);
  }
};

template <class View>
torch::class_<View> view_class(torch::Library& m, const std::string& name) {
  return m.class_<View>(name).def(torch::init<c10::intrusive_ptr<ShardedModel>>());
}

} // namespace

#define ON_MODEL(View, name) .def(#name, &OnModel<View, &ShardedModel::name>::call)

void define_core_views(torch::Library& m) {
  using Units = c10::intrusive_ptr<UnitsView>;
  view_class<UnitsView>(m, "Units")
      // The unit actions go through their registered ops (core_ops.h).
      ON_MODEL(UnitsView, begin_forward)
      ON_MODEL(UnitsView, end_forward)
      ON_MODEL(UnitsView, forward_raised)
      .def("pre_forward", [](const Units& self, int64_t unit) { dispatch::gather_unit(self->model, unit, false); })
      // The int the compiled-graph ops take ([Note: the model's forward in a
      // compiled graph] in core_ops.cpp).
      .def("handle", [](const Units& self) { return model_handle(self->model); })
      // A stage 3 unit's forward begins: gather it, and pass its inputs that
      // require grad through a boundary node that reports the end of this use.
      .def("enter_unit",
           [](const Units& self, int64_t unit, std::vector<at::Tensor> inputs) {
             dispatch::gather_unit(self->model, unit, /*backward=*/false);
             return track_unit_inputs(self->model, unit, inputs);
           })
      // The same without the gather (a later member of a merged unit).
      .def("track_unit_inputs",
           [](const Units& self, int64_t unit, std::vector<at::Tensor> inputs) {
             return track_unit_inputs(self->model, unit, inputs);
           })
      ON_MODEL(UnitsView, hook_regather)
      .def("scale_outputs",
           [](const Units& self, std::vector<at::Tensor> outputs) { return scale_at_outputs(self->model, outputs); })
      .def("post_forward",
           [](const Units& self, int64_t unit, std::vector<at::Tensor> outputs) {
             dispatch::release_unit(self->model, unit, outputs);
           })
      ON_MODEL(UnitsView, add_pending_use)
      ON_MODEL(UnitsView, post_backward_use)
      ON_MODEL(UnitsView, note_untracked_use)
      ON_MODEL(UnitsView, gather_all)
      ON_MODEL(UnitsView, gather_units_of)
      ON_MODEL(UnitsView, unpin_units_of)
      ON_MODEL(UnitsView, release_all)
      ON_MODEL(UnitsView, set_prefetch)
      ON_MODEL(UnitsView, unshard)
      ON_MODEL(UnitsView, wait_unshard)
      ON_MODEL(UnitsView, write_back_shards)
      ON_MODEL(UnitsView, params_sharded)
      // The model itself, for the registered ops (torch.ops.zero_ext.*) that take it.
      .def("model", [](const Units& self) { return self->model; });
  view_class<ReductionView>(m, "Reduction")
      ON_MODEL(ReductionView, set_sync)
      ON_MODEL(ReductionView, sync)
      ON_MODEL(ReductionView, set_replica_sync)
      ON_MODEL(ReductionView, replica_sync)
      ON_MODEL(ReductionView, set_gradient_divide_factor)
      ON_MODEL(ReductionView, set_max_in_flight_bytes)
      ON_MODEL(ReductionView, zero_grad)
      ON_MODEL(ReductionView, full_grads)
      ON_MODEL(ReductionView, has_grad)
      ON_MODEL(ReductionView, bucket_layout)
      ON_MODEL(ReductionView, replicated)
      ON_MODEL(ReductionView, grad_layout);
  view_class<OptimizerShardsView>(m, "OptimizerShards")
      ON_MODEL(OptimizerShardsView, segments)
      ON_MODEL(OptimizerShardsView, segment_param_indices)
      ON_MODEL(OptimizerShardsView, segment_compute_copies)
      ON_MODEL(OptimizerShardsView, note_compute_copy_written)
      ON_MODEL(OptimizerShardsView, begin_step)
      ON_MODEL(OptimizerShardsView, found_nonfinite)
      ON_MODEL(OptimizerShardsView, note_nonfinite_elsewhere)
      ON_MODEL(OptimizerShardsView, check_before_step)
      ON_MODEL(OptimizerShardsView, after_step)
      ON_MODEL(OptimizerShardsView, settle)
      ON_MODEL(OptimizerShardsView, disable_loss_scaling)
      ON_MODEL(OptimizerShardsView, loss_scale)
      ON_MODEL(OptimizerShardsView, loss_scaling)
      ON_MODEL(OptimizerShardsView, whole_params)
      ON_MODEL(OptimizerShardsView, has_masters)
      ON_MODEL(OptimizerShardsView, full_masters)
      ON_MODEL(OptimizerShardsView, load_masters);
  view_class<CheckpointRangesView>(m, "CheckpointRanges")
      ON_MODEL(CheckpointRangesView, local_pieces)
      ON_MODEL(CheckpointRangesView, owned_ranges)
      ON_MODEL(CheckpointRangesView, local_value_shards)
      ON_MODEL(CheckpointRangesView, segment_param_starts)
      ON_MODEL(CheckpointRangesView, full_masters_of)
      ON_MODEL(CheckpointRangesView, refresh_params_from_shards)
      ON_MODEL(CheckpointRangesView, loss_scaler_state)
      ON_MODEL(CheckpointRangesView, restore_loss_scaler)
      ON_MODEL(CheckpointRangesView, begin_materialize)
      ON_MODEL(CheckpointRangesView, end_materialize);
  view_class<DiagnosticsView>(m, "Diagnostics")
      ON_MODEL(DiagnosticsView, failed)
      ON_MODEL(DiagnosticsView, stats)
      ON_MODEL(DiagnosticsView, stall_queries)
      ON_MODEL(DiagnosticsView, post_whereabouts)
      ON_MODEL(DiagnosticsView, traffic)
      ON_MODEL(DiagnosticsView, residual_bytes)
      ON_MODEL(DiagnosticsView, set_test_fault)
      ON_MODEL(DiagnosticsView, log_issues)
      ON_MODEL(DiagnosticsView, take_issue_log);
  view_class<GroupCollectivesView>(m, "GroupCollectives")
      ON_MODEL(GroupCollectivesView, group_all_reduce)
      ON_MODEL(GroupCollectivesView, group_broadcast_from_rank0)
      ON_MODEL(GroupCollectivesView, group_all_gather)
      ON_MODEL(GroupCollectivesView, mesh_all_reduce)
      ON_MODEL(GroupCollectivesView, mesh_broadcast_from_rank0)
      ON_MODEL(GroupCollectivesView, mesh_all_gather);
  view_class<OffloadFilesView>(m, "OffloadFiles")
      ON_MODEL(OffloadFilesView, swapped)
      ON_MODEL(OffloadFilesView, swap_in)
      ON_MODEL(OffloadFilesView, swap_prefetch)
      ON_MODEL(OffloadFilesView, swap_out)
      ON_MODEL(OffloadFilesView, swap_in_grads)
      ON_MODEL(OffloadFilesView, swap_out_grads)
      ON_MODEL(OffloadFilesView, swap_stats)
      ON_MODEL(OffloadFilesView, swap_drain)
      ON_MODEL(OffloadFilesView, swap_reset_peak)
      ON_MODEL(OffloadFilesView, swap_fail_writes_after);
}

#undef ON_MODEL

} // namespace zero_ext
