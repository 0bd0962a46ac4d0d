#pragma once
// The core seen by concern: one bound class per concern over one
// ShardedModel (torch.classes.zero_ext.Units, Reduction, OptimizerShards,
// CheckpointRanges, Diagnostics, GroupCollectives, OffloadFiles), so that
// Python holds only the concerns it needs and no bound class is wider than
// its concern (zero_ext/tools/core_handles.py types them). Each method is
// bound straight to the model's member function: no call in between.

#include <utility>

#include <c10/util/intrusive_ptr.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "sharded_model.h"

namespace zero_ext {

// A concern's view: the model it shows, shared with the other views.
struct CoreView : torch::CustomClassHolder {
  explicit CoreView(c10::intrusive_ptr<ShardedModel> model) : model(std::move(model)) {}
  c10::intrusive_ptr<ShardedModel> model;
};

struct UnitsView : CoreView { using CoreView::CoreView; };
struct ReductionView : CoreView { using CoreView::CoreView; };
struct OptimizerShardsView : CoreView { using CoreView::CoreView; };
struct CheckpointRangesView : CoreView { using CoreView::CoreView; };
struct DiagnosticsView : CoreView { using CoreView::CoreView; };
struct GroupCollectivesView : CoreView { using CoreView::CoreView; };
struct OffloadFilesView : CoreView { using CoreView::CoreView; };

// Registers the views (after torch.classes.zero_ext.ShardedModel).
void define_core_views(torch::Library& m);

} // namespace zero_ext
