#include "layout.h"

#include <algorithm>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

namespace zero_ext {

GradLayout grad_layout_for(int64_t stage, bool masters_or_low_precision_reduce) {
  switch (stage) {
    case 0:
      return masters_or_low_precision_reduce ? GradLayout::kReplicated : GradLayout::kDdpInPlace;
    case 1:
      return GradLayout::kShardedPersistent;
    default:
      return GradLayout::kShardedTransient;
  }
}

const char* grad_layout_name(GradLayout layout) {
  switch (layout) {
    case GradLayout::kDdpInPlace: return "ddp_in_place";
    case GradLayout::kReplicated: return "replicated";
    case GradLayout::kShardedPersistent: return "sharded_persistent";
    case GradLayout::kShardedTransient: return "sharded_transient";
  }
  return "?";
}

Layout::Layout(std::vector<std::vector<int64_t>> shapes, std::vector<std::string> names,
               std::vector<int64_t> trainable, const std::vector<int64_t>& params_per_bucket,
               const std::vector<int64_t>& unit_of_bucket, int64_t stage, GradLayout grad_layout,
               int64_t rank, int64_t world, const std::vector<int64_t>& owner_of_param, ExpertGroup experts)
    : stage_(stage), grad_layout_(grad_layout), rank_(rank), world_(world), experts_(std::move(experts)),
      shapes_(std::move(shapes)), names_(std::move(names)),
      trainable_(trainable.begin(), trainable.end()), owner_(owner_of_param) {
  check_plan(params_per_bucket, unit_of_bucket);
  for (const auto& shape : shapes_) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    numel_.push_back(numel);
  }
  const int64_t n = static_cast<int64_t>(shapes_.size());
  bucket_of_.assign(n, -1);
  offset_.assign(n, 0);
  int64_t next = 0;
  for (int64_t count : params_per_bucket) {
    TORCH_CHECK(count > 0 && next + count <= n, "zero_ext internal: bad bucket plan");
    const int64_t index = static_cast<int64_t>(buckets_.size());
    const bool expert = std::binary_search(experts_.buckets.begin(), experts_.buckets.end(), index);
    const BucketShape bucket = place_bucket(next, count, stage_ == 3 ? unit_of_bucket.at(index) : -1, expert);
    if (bucket.unit >= 0) {
      if (static_cast<int64_t>(unit_buckets_.size()) <= bucket.unit) {
        unit_buckets_.resize(bucket.unit + 1);
      }
      unit_buckets_[bucket.unit].push_back(static_cast<int64_t>(buckets_.size()));
    }
    buckets_.push_back(bucket);
    next += count;
  }
  TORCH_CHECK(next == n, "zero_ext internal: bucket plan does not cover every parameter");
  if (!ddp_in_place()) {
    for (const auto& piece : pieces_of(rank_, -1, /*trainable_only=*/true)) {
      segments_.push_back(piece);
    }
  }
}

void Layout::check_plan(const std::vector<int64_t>& params_per_bucket,
                        const std::vector<int64_t>& unit_of_bucket) {
  TORCH_CHECK(stage_ >= 0 && stage_ <= 3, "zero_ext: stage must be 0, 1, 2 or 3");
  TORCH_CHECK(world_ >= 1 && rank_ >= 0 && rank_ < world_, "zero_ext internal: bad rank or world size");
  const int64_t n = static_cast<int64_t>(shapes_.size());
  TORCH_CHECK(static_cast<int64_t>(names_.size()) == n && static_cast<int64_t>(trainable_.size()) == n,
              "zero_ext internal: one name and trainable flag per parameter");
  TORCH_CHECK(stage_ == 3 || unit_of_bucket.empty() || unit_of_bucket.size() == params_per_bucket.size(),
              "zero_ext internal: one unit per bucket");
  TORCH_CHECK(owner_.empty() || static_cast<int64_t>(owner_.size()) == n,
              "zero_ext internal: one owner per parameter");
  for (int64_t owner : owner_) {
    TORCH_CHECK(owner >= -1 && owner < world_, "zero_ext internal: a parameter's owner is out of range");
    any_whole_ = any_whole_ || owner >= 0;
  }
  TORCH_CHECK(!any_whole_ || (stage_ >= 1 && !replicated() && !ddp_in_place()),
              "zero_ext internal: whole-parameter layouts are for stages 1-3");
  TORCH_CHECK(std::is_sorted(experts_.buckets.begin(), experts_.buckets.end()) &&
                  (experts_.buckets.empty() || (experts_.buckets.front() >= 0 &&
                                                experts_.buckets.back() < static_cast<int64_t>(params_per_bucket.size()))),
              "zero_ext internal: the expert buckets must be ascending bucket indices");
  TORCH_CHECK(experts_.world >= 1 && experts_.rank >= 0 && experts_.rank < experts_.world &&
                  world_ % experts_.world == 0,
              "zero_ext internal: the expert group must divide the data-parallel group");
}

BucketShape Layout::place_bucket(int64_t first, int64_t count, int64_t unit, bool expert) {
  BucketShape bucket;
  bucket.first = first;
  bucket.count = count;
  bucket.unit = unit;
  bucket.expert = expert;
  const int64_t world = expert ? experts_.world : world_;
  const bool whole = owner(first) >= 0;  // [Note: whole-parameter layout]
  TORCH_CHECK(!(whole && expert), "zero_ext internal: expert parameters are cut in equal shards");
  std::vector<int64_t> region(whole ? world_ : 0, 0);  // elements each owner has in it so far
  for (int64_t i = first; i < first + count; ++i) {
    bucket_of_[i] = static_cast<int64_t>(buckets_.size());
    TORCH_CHECK((owner(i) >= 0) == whole,
                "zero_ext internal: a bucket mixes whole parameters with ones cut in equal shards");
    if (whole) {
      TORCH_CHECK(i == first || owner_[i] >= owner_[i - 1],
                  "zero_ext internal: a bucket's parameters must come grouped by owner");
      offset_[i] = region[owner_[i]];  // within the owner's region; shifted below
      region[owner_[i]] += numel_[i];
    } else {
      offset_[i] = bucket.numel;
    }
    bucket.numel += numel_[i];
    bucket.trainable += trainable_[i] ? 1 : 0;
  }
  // Stages 0-2 bucket frozen parameters only to compute them in the
  // compute dtype, apart from the trainable ones: a bucket without
  // trainable parameters is never reduced, stepped or gathered after a step.
  TORCH_CHECK(stage_ == 3 || bucket.trainable == 0 || bucket.trainable == count,
              "zero_ext internal: outside stage 3 frozen parameters are bucketed apart from trainable ones");
  if (whole) {
    const int64_t widest = std::max<int64_t>(*std::max_element(region.begin(), region.end()), 1);
    for (int64_t i = first; i < first + count; ++i) {
      offset_[i] += owner_[i] * widest;
    }
    bucket.padded = widest * world_;
    bucket.shard = widest;
  } else {
    const int64_t at_least_one = std::max<int64_t>(bucket.numel, 1);
    bucket.padded = (at_least_one + world - 1) / world * world;
    bucket.shard = replicated() ? bucket.padded : bucket.padded / world;
  }
  return bucket;
}

int64_t Layout::shard_start_of(int64_t b, int64_t rank) const {
  return replicated() ? 0 : rank * buckets_[b].shard;
}

std::vector<std::pair<int64_t, int64_t>> Layout::gaps(int64_t b) const {
  const BucketShape& bucket = buckets_[b];
  std::vector<std::pair<int64_t, int64_t>> covered;
  for (int64_t i = bucket.first; i < bucket.first + bucket.count; ++i) {
    covered.emplace_back(offset_[i], offset_[i] + numel_[i]);
  }
  std::sort(covered.begin(), covered.end());
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t at = 0;
  for (const auto& [start, end] : covered) {
    if (start > at) out.emplace_back(at, start - at);
    at = std::max(at, end);
  }
  if (bucket.padded > at) out.emplace_back(at, bucket.padded - at);
  return out;
}

std::vector<ShardPiece> Layout::pieces_of(int64_t rank, int64_t per_rank, bool trainable_only) const {
  std::vector<ShardPiece> out;
  for (int64_t b = 0; b < num_buckets(); ++b) {
    const BucketShape& bucket = buckets_[b];
    const int64_t in_group = bucket.expert ? experts_.rank : rank;
    const int64_t width = per_rank >= 0 ? bucket.padded / bucket_world(b) : bucket.shard;
    const int64_t lo = per_rank >= 0 ? in_group * width : shard_start_of(b, in_group);
    const int64_t hi = lo + width;
    for (int64_t i = bucket.first; i < bucket.first + bucket.count; ++i) {
      const int64_t start = std::max(lo, offset_[i]);
      const int64_t end = std::min(hi, offset_[i] + numel_[i]);
      if (start >= end || (trainable_only && !trainable_[i])) {
        continue;
      }
      out.push_back(ShardPiece{i, b, start - offset_[i], start - lo, end - start});
    }
  }
  return out;
}

std::vector<ShardPiece> Layout::local_pieces() const {
  return pieces_of(rank_, -1, /*trainable_only=*/false);
}

std::vector<std::tuple<int64_t, int64_t, int64_t>> Layout::owned_ranges(int64_t rank) const {
  TORCH_CHECK(rank >= 0 && rank < world_, "zero_ext internal: rank out of range");
  TORCH_CHECK(!has_experts() || rank == rank_, "zero_ext internal: with expert buckets, a rank's own ranges only");
  std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
  for (const auto& piece : pieces_of(rank, /*per_rank=*/1, /*trainable_only=*/false)) {
    out.emplace_back(piece.param, piece.param_start, piece.param_start + piece.length);
  }
  std::sort(out.begin(), out.end());  // by parameter, as checkpoints list them
  return out;
}

std::string Layout::describe_bucket(int64_t b, const std::string& where) const {
  const BucketShape& bucket = buckets_[b];
  std::ostringstream out;
  out << "bucket " << b << " of " << buckets_.size() << " (stage " << stage_ << ", " << bucket.count
      << " parameters from '" << names_[bucket.first] << "', " << bucket.padded << " elements"
      << (bucket.expert ? ", sharded over the expert group" : "")
      << (where.empty() ? "" : "; ") << where << ")";
  return out.str();
}

std::string Layout::advice_for(const std::string& report) const {
  std::vector<std::string> named;
  std::vector<std::string> advice;
  const size_t units = std::min(unit_advice_.size(), unit_names_.size());
  for (size_t u = 0; u < units; ++u) {
    // describe_unit's rendering: "unit 1 '" never matches inside "unit 11 '"
    if (unit_advice_[u].empty() || report.find("unit " + std::to_string(u) + " '" + unit_names_[u] + "'") ==
                                       std::string::npos) {
      continue;
    }
    named.push_back("'" + unit_names_[u] + "'");
    if (std::find(advice.begin(), advice.end(), unit_advice_[u]) == advice.end()) {
      advice.push_back(unit_advice_[u]);
    }
  }
  if (named.empty()) {
    return {};
  }
  std::ostringstream out;
  out << "\nAbout unit" << (named.size() > 1 ? "s " : " ");
  for (size_t i = 0; i < named.size(); ++i) {
    out << (i == 0 ? "" : i + 1 == named.size() ? " and " : ", ") << named[i];
  }
  out << ":";
  for (const std::string& text : advice) {
    out << " " << text;
  }
  return out.str();
}

std::string Layout::describe_unit(int64_t u) const {
  std::ostringstream out;
  out << "unit " << u;
  if (u < static_cast<int64_t>(unit_names_.size())) {
    out << " '" << (unit_names_[u].empty() ? std::string("(the root)") : unit_names_[u]) << "'";
  } else if (u < num_units() && !unit_buckets_[u].empty()) {
    out << " (parameters from '" << names_[buckets_[unit_buckets_[u].front()].first] << "')";
  }
  return out.str();
}

} // namespace zero_ext
