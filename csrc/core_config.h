#pragma once
// CoreConfig: everything a ShardedModel is built with besides its parameters'
// geometry, given whole at construction (torch.classes.zero_ext.CoreConfig,
// filled from zero_ext/tools/core_config.py's typed dataclass). Nothing is
// configured after the model is built: a compiler or a reader sees the
// model's whole setting in one place.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/custom_class.h>

namespace zero_ext {

struct CoreConfig : torch::CustomClassHolder {
  // The layout and its groups ("": none; see ShardedModel's constructor).
  int64_t stage = 2;
  std::string shard_group;
  std::string gather_group;    // stage 3 gathers on it ("": the shard group)
  std::string replica_group;   // hybrid sharding ([Note: hybrid sharding] in mesh.h)
  std::string regather_group;  // units resharded to a subgroup gather again in it
  // Experts on their own mesh dimension (wrap(expert_process_group=)): the
  // expert buckets are sharded over this group ([Note: expert buckets] in
  // layout.h); "" and no buckets: none.
  std::string expert_group;
  std::vector<int64_t> expert_buckets;
  int64_t prefetch = 1;
  std::string compute_dtype;  // mixed precision ("float16", "bfloat16"; "": none)
  std::string reduce_dtype;   // gradients reduced in it ("": fp32)
  bool offload = false;       // masters and accumulators in host memory
  bool deferred = false;      // parameters hold no values yet ([Note: deferred initialization])

  // Loss scaling (fp16) and the non-finite policy (step_gate.h).
  bool loss_scaling = false;
  bool dynamic_loss_scale = false;
  double initial_scale = 1.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 1;
  double min_scale = 1.0;
  int64_t hysteresis = 1;
  bool skip_nonfinite = false;

  // Pipeline stages (wrap(pipeline_group=)): every backward accumulates
  // locally and the step's first read of the gradients reduces them, once
  // per step whatever the number of microbatches ([Note: reductions at read]
  // in backward_round.h).
  bool reduce_at_read = false;

  // [Note: quantized collectives]: bits of stage 3 gathers and of gradient
  // reductions (0: off), `quant_block` elements per scale.
  int64_t weight_bits = 0;
  int64_t grad_bits = 0;
  int64_t quant_block = 2048;

  // Stage 3 units: the most bytes gathered at once that prefetch may reach
  // (0: no bound beyond the prefetch count), each unit's module path and
  // advice for messages, the units kept gathered after forward, and those
  // resharded to the regather group.
  int64_t max_live_bytes = 0;
  std::vector<std::string> unit_names;
  std::vector<std::string> unit_advice;
  std::vector<int64_t> kept_after_forward;
  std::vector<int64_t> resharded_to_subgroup;

  // offload_*="nvme" ([Note: swapped buffers] in swap_space.h): this rank's
  // file ("": none), what lives there, its I/O threads and buffers.
  std::string swap_path;
  std::string swap_directory;  // offload_path as the user gave it, for messages
  bool swap_params = false;
  bool swap_optimizer = false;
  int64_t swap_threads = 1;
  int64_t swap_chunk_bytes = 0;
  int64_t swap_max_writing_bytes = 0;
  int64_t swap_persist_bytes = 0;

  // [Note: collectives that prove what they are]: the header groups of the
  // shard, gather, replica and regather groups ("": no checks on that group).
  std::string shard_headers;
  std::string gather_headers;
  std::string replica_headers;
  std::string regather_headers;
  std::string expert_headers;

  // Stall diagnosis (communicator.h; stall_seconds 0: off): a wait stalled
  // this long compares notes through the store under `key_space` (the same
  // on every rank of the mesh, new for each wrap()); the mesh rank of each
  // member of the shard and replica groups, by group rank.
  double stall_seconds = 0.0;
  double timeout_seconds = 1800.0;
  std::string key_space;
  std::vector<int64_t> shard_mesh_ranks;
  std::vector<int64_t> replica_mesh_ranks;
  // The expert group's members' mesh ranks (by group rank), and the expert
  // group (an index) of every mesh rank.
  std::vector<int64_t> expert_mesh_ranks;
  std::vector<int64_t> expert_group_of_mesh_rank;
};

// "float16" / "bfloat16" / "float32" to the ScalarType; "" to none.
std::optional<c10::ScalarType> parse_config_dtype(const std::string& name);

// Registers torch.classes.zero_ext.CoreConfig with a read-write property per field.
void define_core_config(torch::Library& m);

} // namespace zero_ext
