#pragma once
// Layout: the immutable geometry of one wrapped model, fixed at wrap().
//
// Trainable parameters are laid out in flat buckets: one dtype each, in
// reverse registration order so they fill in the order backward produces
// gradients. Frozen parameters are bucketed too in stage 3 (with their
// unit's trainable ones) and, under mixed precision, in stages 0-2 (in
// buckets of their own: trainable == 0), so they compute in the compute
// dtype from an fp32 master.
// Each bucket is padded to a multiple of the world size; rank r owns the r-th
// equal shard (replicated layouts: the whole bucket). A "segment" is this
// rank's shard of a bucket cut at parameter boundaries: what the optimizer
// steps in stages 1-3. See [Note: whole-parameter layout] for optimizers that
// must see whole tensors. Everything here is arithmetic on sizes: no tensors, no
// communication, so it can be tested alone (torch.classes.zero_ext.Layout)
// and checkpoints ask it instead of recomputing it.

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace zero_ext {

// Where a reduced gradient lives (see [Note: gradient layouts]).
enum class GradLayout : int8_t {
  kDdpInPlace,         // stage 0, fp32: param.grad views the all-reduced bucket (DDP)
  kReplicated,         // stage 0 with masters: the shard is the whole bucket
  kShardedPersistent,  // stage 1: full staging kept, reduce-scattered into a shard
  kShardedTransient,   // stages 2-3: staging exists only while a bucket is reduced
};

// [Note: gradient layouts]
//   kDdpInPlace        staging *is* the gradient: param.grad views it and it is
//                      all-reduced in place (a previous result A is the same on
//                      every rank, so sum((A + g_r) / N) = A + mean(g_r)).
//   kShardedPersistent each reduction reduce-scatters the staging and adds the
//                      rank's shard into a persistent fp32 accumulator.
//   kShardedTransient  as persistent, but no full gradient survives a backward.
//   kReplicated        as persistent with all-reduce: stage 0 with fp32 masters
//                      (mixed precision or offload), whose gradient path is
//                      stage 1's with a whole-bucket "shard".
GradLayout grad_layout_for(int64_t stage, bool masters_or_low_precision_reduce);
const char* grad_layout_name(GradLayout layout);

// [Note: whole-parameter layout]
// An optimizer that is not elementwise (Muon, Adafactor, LAMB, ...) must step
// each parameter whole. Given an owner rank per parameter (-1 for every
// parameter of a bucket cut in equal shards: an elementwise optimizer's,
// beside Muon's in `wrap(model, [muon, adamw])`), a whole bucket lists its
// parameters grouped by owner, ascending, and rank r's region of the bucket
// holds exactly r's parameters, padded to the largest region: shard =
// max over ranks of the elements they own in the bucket. The equal-shard
// machinery (reduce-scatter, all-gather, stage 3 gathers, checkpoints' owned
// ranges) is then unchanged, and each segment is one whole parameter, viewed
// with its shape. The gaps (padding inside and after regions) hold zeros.
// [Note: expert buckets]
// Experts on their own mesh dimension (wrap(expert_process_group=), torchtitan's
// dp_shard_mod_ep): each rank holds its expert-parallel part of the experts
// (its local experts), and the ranks holding the same experts form the expert
// group, a subgroup of the data-parallel group. The experts' parameters fill
// buckets of their own, padded and sharded over the expert group (its size
// and this rank's place in it), and every collective of such a bucket (its
// gradient reduction, its stage 3 gather, its all-gather after a step, the
// first broadcast) runs on the expert group. The reduction still divides by
// the whole data-parallel size: each expert's gradient already sums, through
// the token dispatch, the tokens of every expert-parallel rank, so the sum
// over the expert group divided by dp is the mean over the global batch
// (torchtitan's gradient divide factor). What sums over the whole mesh (the
// gradient mask, a norm) is unchanged: each piece of an expert is held by
// exactly one rank of the mesh.
struct ExpertGroup {
  std::vector<int64_t> buckets;  // the expert buckets, ascending
  int64_t rank = 0;              // this rank in the expert group
  int64_t world = 1;
};

struct BucketShape {
  int64_t first = 0;      // index of its first parameter
  int64_t count = 0;      // parameters in it
  int64_t numel = 0;      // their elements
  int64_t padded = 0;     // numel rounded up to a multiple of the world size
  int64_t shard = 0;      // elements this rank holds: padded / world (replicated: padded)
  int64_t trainable = 0;  // parameters in it that get gradients
  int64_t unit = -1;      // stage 3: the unit it is gathered with (root: 0)
  bool expert = false;    // sharded over the expert group ([Note: expert buckets])
};

// A piece of one parameter held in this rank's shard of its bucket.
struct ShardPiece {
  int64_t param = 0;         // parameter index
  int64_t bucket = 0;
  int64_t param_start = 0;   // first element within the parameter
  int64_t shard_offset = 0;  // first element within the bucket's local shard
  int64_t length = 0;
};

class Layout {
 public:
  Layout(std::vector<std::vector<int64_t>> shapes, std::vector<std::string> names,
         std::vector<int64_t> trainable, const std::vector<int64_t>& params_per_bucket,
         const std::vector<int64_t>& unit_of_bucket, int64_t stage, GradLayout grad_layout,
         int64_t rank, int64_t world, const std::vector<int64_t>& owner_of_param = {},
         ExpertGroup experts = {});

  int64_t stage() const { return stage_; }
  GradLayout grad_layout() const { return grad_layout_; }
  bool ddp_in_place() const { return grad_layout_ == GradLayout::kDdpInPlace; }
  bool replicated() const { return grad_layout_ == GradLayout::kReplicated; }
  // Staging freed after each reduction (stages 2-3).
  bool transient_staging() const { return grad_layout_ == GradLayout::kShardedTransient; }
  bool params_sharded() const { return stage_ == 3; }
  // Some parameters lie whole in their owner's shard ([Note: whole-parameter layout]).
  bool whole_params() const { return any_whole_; }
  // Parameter i has an owner (-1: its bucket is cut in equal shards).
  int64_t owner(int64_t i) const { return owner_.empty() ? -1 : owner_[i]; }
  // Its segments keep its shape: replicated layouts, or whole parameters.
  bool segment_is_whole(int64_t i) const { return replicated() || owner(i) >= 0; }
  int64_t rank() const { return rank_; }
  int64_t world() const { return world_; }
  // Bucket b is sharded over the expert group ([Note: expert buckets]).
  bool expert(int64_t b) const { return buckets_[b].expert; }
  bool has_experts() const { return !experts_.buckets.empty(); }
  // The ranks bucket b is sharded over, and this rank's place among them.
  int64_t bucket_world(int64_t b) const { return expert(b) ? experts_.world : world_; }
  int64_t bucket_rank(int64_t b) const { return expert(b) ? experts_.rank : rank_; }

  int64_t num_params() const { return static_cast<int64_t>(names_.size()); }
  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  const BucketShape& bucket(int64_t b) const { return buckets_[b]; }
  const std::vector<BucketShape>& buckets() const { return buckets_; }
  int64_t bucket_of(int64_t i) const { return bucket_of_[i]; }
  int64_t offset(int64_t i) const { return offset_[i]; }  // element offset in its bucket
  int64_t numel(int64_t i) const { return numel_[i]; }
  const std::vector<int64_t>& shape(int64_t i) const { return shapes_[i]; }
  const std::string& name(int64_t i) const { return names_[i]; }
  bool trainable(int64_t i) const { return trainable_[i] != 0; }

  // First element of `rank`'s shard of bucket b (replicated: 0); `rank` in
  // the bucket's group.
  int64_t shard_start(int64_t b) const { return shard_start_of(b, bucket_rank(b)); }
  int64_t shard_start_of(int64_t b, int64_t rank) const;
  // (start, length) of the elements of bucket b that belong to no parameter:
  // the tail padding, and in whole-parameter layouts the end of each region.
  std::vector<std::pair<int64_t, int64_t>> gaps(int64_t b) const;
  // This rank's pieces of every parameter (trainable and frozen).
  std::vector<ShardPiece> local_pieces() const;
  // The optimizer's segments: local pieces of trainable parameters.
  const std::vector<ShardPiece>& segments() const { return segments_; }
  // (param, start, end) of `rank`'s equal slice of each bucket (padded / world
  // elements, also for replicated layouts): what that rank writes in a
  // checkpoint. With expert buckets only this rank's own (their slice is
  // this rank's in the expert group).
  std::vector<std::tuple<int64_t, int64_t, int64_t>> owned_ranges(int64_t rank) const;

  // Stage 3: the buckets of each unit that has parameters.
  int64_t num_units() const { return static_cast<int64_t>(unit_buckets_.size()); }
  const std::vector<int64_t>& unit_buckets(int64_t u) const { return unit_buckets_[u]; }

  std::string describe_bucket(int64_t b, const std::string& where) const;
  std::string describe_unit(int64_t u) const;
  // Stage 3: each unit's module path (root ""), for messages only.
  void set_unit_names(std::vector<std::string> names) { unit_names_ = std::move(names); }
  // Stage 3: per unit, what to do if it runs on some ranks only ("": nothing
  // to add), from zero_ext/wrapping/unit_advice.py; for messages only.
  void set_unit_advice(std::vector<std::string> advice) { unit_advice_ = std::move(advice); }
  // For an error that names units as describe_unit renders them: those units
  // with advice, and their advice (each text once); "" if none.
  std::string advice_for(const std::string& report) const;

 private:
  // `rank` in the main group; expert buckets take this rank's expert rank.
  std::vector<ShardPiece> pieces_of(int64_t rank, int64_t shard_elements_per_rank, bool trainable_only) const;
  // The constructor's steps: the arguments checked (and any_whole_ set); the
  // bucket of parameters [first, first + count), their offsets placed in it.
  void check_plan(const std::vector<int64_t>& params_per_bucket, const std::vector<int64_t>& unit_of_bucket);
  BucketShape place_bucket(int64_t first, int64_t count, int64_t unit, bool expert);

  int64_t stage_;
  GradLayout grad_layout_;
  int64_t rank_;
  int64_t world_;
  ExpertGroup experts_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<std::string> names_;
  std::vector<uint8_t> trainable_;
  std::vector<int64_t> numel_;
  std::vector<int64_t> bucket_of_;
  std::vector<int64_t> offset_;
  std::vector<int64_t> owner_;  // empty, or -1 per parameter of a bucket cut in equal shards
  bool any_whole_ = false;
  std::vector<BucketShape> buckets_;
  std::vector<ShardPiece> segments_;
  std::vector<std::vector<int64_t>> unit_buckets_;
  std::vector<std::string> unit_names_;
  std::vector<std::string> unit_advice_;
};

} // namespace zero_ext
