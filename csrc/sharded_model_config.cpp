// A ShardedModel's setting, applied once in its constructor from the
// CoreConfig it is built with (core_config.h): loss scaling and the
// non-finite policy, quantized collectives, the stage 3 units' bounds and
// names, the offload file, the collective checks and the stall diagnosis.
// Nothing here runs after construction.
#include "sharded_model.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

namespace zero_ext {

void ShardedModel::apply_config(const CoreConfig& config) {
  if (config.loss_scaling) {
    TORCH_INTERNAL_ASSERT(!layout_.ddp_in_place(), "loss scaling needs fp32 masters");
    // Option values are validated in Python, where the user passes them.
    LossScalerOptions options{config.initial_scale, config.growth_factor, config.backoff_factor,
                              config.growth_interval, config.min_scale, config.hysteresis, config.dynamic_loss_scale};
    TORCH_INTERNAL_ASSERT(options.initial_scale > 0 && options.growth_factor >= 1 && options.backoff_factor > 0 &&
                          options.backoff_factor < 1 && options.growth_interval > 0 && options.min_scale > 0 &&
                          options.hysteresis > 0);
    gate_.scaler().enable(options);
  }
  gate_.set_skip_nonfinite(config.skip_nonfinite);
  round_.set_reduce_at_read(config.reduce_at_read);
  if (config.weight_bits != 0 || config.grad_bits != 0) {
    enable_compression(config.weight_bits, config.grad_bits, config.quant_block);
  }
  if (!config.swap_path.empty()) {  // before anything reads the shards
    try {
      enable_swap(config);
    } catch (const c10::Error& error) {
      std::string reason = error.what_without_backtrace();
      if (reason.rfind("zero_ext: ", 0) == 0) reason = reason.substr(10);
      TORCH_CHECK(false, "zero_ext.wrap: offload_path '", config.swap_directory, "': ", reason);
    }
  }
  TORCH_CHECK(config.max_live_bytes >= 0, "zero_ext internal: a live budget is a number of bytes");
  if (units_) {
    units_->set_max_live_bytes(config.max_live_bytes);
    units_->keep_gathered_after_forward(config.kept_after_forward);
    units_->hold_kept_until_step(config.reduce_at_read);
    units_->reshard_to_subgroup(config.resharded_to_subgroup);
  }
  if (!config.unit_names.empty()) layout_.set_unit_names(config.unit_names);
  if (!config.unit_advice.empty()) set_unit_advice(config.unit_advice);
  if (!config.shard_headers.empty()) enable_collective_checks(config);
  if (config.stall_seconds > 0) enable_stall_diagnosis(config);
}

void ShardedModel::enable_compression(int64_t weight_bits, int64_t grad_bits, int64_t block) {
  TORCH_CHECK(weight_bits == 0 || weight_bits == 8, "zero_ext: compress_weights quantizes to 8 bits, got ",
              weight_bits);
  TORCH_CHECK(grad_bits == 0 || grad_bits == 8 || grad_bits == 4, "zero_ext: compress_grads quantizes to 8 or 4 bits, got ",
              grad_bits);
  TORCH_CHECK(block >= 2 && block % 2 == 0, "zero_ext: the quantization block must be an even number of elements, got ",
              block);
  TORCH_CHECK(weight_bits == 0 || units_, "zero_ext: compress_weights needs stage 3 (stages 0-2 gather no parameters)");
  TORCH_CHECK(grad_bits == 0 || (!layout_.replicated() && !layout_.ddp_in_place()),
              "zero_ext: compress_grads needs stage 2 or 3 (their reductions are reduce-scatters)");
  if (units_) {
    units_->set_compression(QuantFormat{weight_bits, block});
  }
  reducer_.set_compression(QuantFormat{grad_bits, block});
}

void ShardedModel::enable_swap(const CoreConfig& config) {
  const bool params = config.swap_params, optimizer = config.swap_optimizer;
  const int64_t persist_bytes = config.swap_persist_bytes;
  TORCH_CHECK(store_.device().is_cpu(), "zero_ext: offload_*='nvme' for a model on ", store_.device(),
              " is not available in this version; it runs on CPU models (use offload_optimizer='cpu' on an "
              "accelerator)");
  swap_ = std::make_unique<SwapSpace>(config.swap_path, config.swap_threads, config.swap_chunk_bytes,
                                      config.swap_max_writing_bytes);
  // [Note: an offload file that failed] A read or write of this rank's file
  // failed (a full disk, a failing drive) somewhere inside a forward,
  // backward or step: what this rank holds is no longer what the other ranks
  // expect (a step half done, a gradient not kept), so, as for a forward that
  // raised, it refuses every later entry point and posts the report, which
  // the other ranks' stalled waits raise within the stall interval.
  swap_->on_failure([this](const std::string& error) {
    const std::string first_line = error.substr(0, error.find('\n'));
    const std::string report =
        "zero_ext: rank " + std::to_string(mesh_.rank()) + " cannot go on training: its offload file failed (" +
        first_line + "). Its shards, gradients or optimizer state no longer match the other ranks' step, so every "
        "rank stops with this error instead of waiting out the timeout. Free space on offload_path's file system "
        "(or point offload_path at a healthy drive) and restart every rank from the last checkpoint; checkpoints "
        "saved before are untouched.";
    round_.mark_unusable(report);
    if (mesh_.size() > 1) comm_.post_report(report);
  });
  store_.enable_swap(*swap_, params && layout_.params_sharded(), optimizer, persist_bytes);
  if (optimizer && !layout_.ddp_in_place() && !layout_.replicated()) reducer_.enable_swap(*swap_, persist_bytes);
  swap_->open();
}

void ShardedModel::set_unit_advice(const std::vector<std::string>& advice) {
  layout_.set_unit_advice(advice);
  // Read only by a failing wait or sequence check, after wrap() set it.
  auto advise = [this](const std::string& report) { return layout_.advice_for(report); };
  for (Communicator* comm : {&comm_, &gather_comm_, &regather_comm_, &replica_comm_, &expert_comm_}) {
    comm->set_advice(advise);
  }
}

void ShardedModel::enable_collective_checks(const CoreConfig& config) {
  auto describe = [this](const CollectiveId& id, const std::string& label) {
    return describe_collective(id, label);
  };
  auto progress = [this] { return gate_.progress(); };
  auto order = std::make_shared<SequenceOrder>();
  // Across replicas on gloo, a bucket's all-reduce is submitted when a host
  // poll sees its reduction done, a moment that differs between ranks: it
  // keeps its own group's order only (collective_sequence.h).
  const bool replicas_in_order = !comm_.waits_on_host(store_.device().type());
  comm_.enable_sequence_checks(config.shard_headers, order, true, describe, progress);
  gather_comm_.enable_sequence_checks(config.gather_headers, order, true, describe, progress);
  regather_comm_.enable_sequence_checks(config.regather_headers, order, true, describe, progress);
  replica_comm_.enable_sequence_checks(config.replica_headers, order, replicas_in_order, describe, progress);
  expert_comm_.enable_sequence_checks(config.expert_headers, order, true, describe, progress);
}

void ShardedModel::enable_stall_diagnosis(const CoreConfig& config) {
  const double seconds = config.stall_seconds, timeout_seconds = config.timeout_seconds;
  const std::string& key_space = config.key_space;
  const std::vector<int64_t>& shard_mesh_ranks = config.shard_mesh_ranks;
  const std::vector<int64_t>& replica_mesh_ranks = config.replica_mesh_ranks;
  TORCH_CHECK(timeout_seconds > 0, "zero_ext internal: a timeout of ", timeout_seconds, " s");
  // NCCL: the watchdog bounds waits, and a timed wait would block the host;
  // the stores still carry reports, and header waits are host waits.
  const bool timed = comm_.waits_on_host(store_.device().type());
  // How long a rank whose forward raised waits for the others to say where
  // they stopped ([Note: a forward that raised]): with timed waits (gloo) a
  // rank that went on posts its stall, so up to the timeout only matters for a
  // slow rank; without (NCCL) nothing but the others' own raised forwards
  // can answer, and those come within the ranks' skew.
  raised_forward_limit_s_ = timed ? timeout_seconds : std::min(timeout_seconds, std::max(2 * seconds, 10.0));
  const int64_t replicas = replica_comm_.size();
  const int64_t shard_size = comm_.size();
  const int64_t sub = regather_comm_.distributed() ? regather_comm_.size() : 0;
  comm_.enable_stall_diagnosis(seconds, key_space, shard_mesh_ranks, replicas, shard_size, timed, sub);
  gather_comm_.enable_stall_diagnosis(seconds, key_space, shard_mesh_ranks, replicas, shard_size, timed, sub);
  replica_comm_.enable_stall_diagnosis(seconds, key_space, replica_mesh_ranks, replicas, shard_size, timed, sub);
  if (sub > 0) {  // the subgroup: consecutive members of the shard group
    const auto first = shard_mesh_ranks.begin() + comm_.rank() / sub * sub;
    regather_comm_.enable_stall_diagnosis(seconds, key_space, std::vector<int64_t>(first, first + sub), replicas,
                                          shard_size, timed, sub);
  }
  if (expert_comm_.distributed()) {
    expert_comm_.enable_stall_diagnosis(seconds, key_space, config.expert_mesh_ranks, replicas, shard_size, timed, sub);
    for (Communicator* comm : {&comm_, &gather_comm_, &replica_comm_, &regather_comm_, &expert_comm_}) {
      comm->set_expert_partition(config.expert_group_of_mesh_rank);
    }
  }
}

} // namespace zero_ext
