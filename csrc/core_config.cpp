// torch.classes.zero_ext.CoreConfig: the fields of core_config.h, each a
// read-write property, so Python fills one typed object before the model is built.
#include "core_config.h"

#include <torch/library.h>

namespace zero_ext {

std::optional<c10::ScalarType> parse_config_dtype(const std::string& name) {
  if (name.empty()) return std::nullopt;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float32") return at::kFloat;
  TORCH_CHECK(false, "zero_ext internal: no dtype '", name, "' in a core configuration (float16, bfloat16, float32)");
}

#define ZERO_EXT_CONFIG_FIELD(name) .def_readwrite(#name, &CoreConfig::name)

void define_core_config(torch::Library& m) {
  m.class_<CoreConfig>("CoreConfig")
      .def(torch::init<>())
      ZERO_EXT_CONFIG_FIELD(stage)
      ZERO_EXT_CONFIG_FIELD(shard_group)
      ZERO_EXT_CONFIG_FIELD(gather_group)
      ZERO_EXT_CONFIG_FIELD(replica_group)
      ZERO_EXT_CONFIG_FIELD(regather_group)
      ZERO_EXT_CONFIG_FIELD(expert_group)
      ZERO_EXT_CONFIG_FIELD(expert_buckets)
      ZERO_EXT_CONFIG_FIELD(prefetch)
      ZERO_EXT_CONFIG_FIELD(compute_dtype)
      ZERO_EXT_CONFIG_FIELD(reduce_dtype)
      ZERO_EXT_CONFIG_FIELD(offload)
      ZERO_EXT_CONFIG_FIELD(deferred)
      ZERO_EXT_CONFIG_FIELD(loss_scaling)
      ZERO_EXT_CONFIG_FIELD(dynamic_loss_scale)
      ZERO_EXT_CONFIG_FIELD(initial_scale)
      ZERO_EXT_CONFIG_FIELD(growth_factor)
      ZERO_EXT_CONFIG_FIELD(backoff_factor)
      ZERO_EXT_CONFIG_FIELD(growth_interval)
      ZERO_EXT_CONFIG_FIELD(min_scale)
      ZERO_EXT_CONFIG_FIELD(hysteresis)
      ZERO_EXT_CONFIG_FIELD(skip_nonfinite)
      ZERO_EXT_CONFIG_FIELD(reduce_at_read)
      ZERO_EXT_CONFIG_FIELD(weight_bits)
      ZERO_EXT_CONFIG_FIELD(grad_bits)
      ZERO_EXT_CONFIG_FIELD(quant_block)
      ZERO_EXT_CONFIG_FIELD(max_live_bytes)
      ZERO_EXT_CONFIG_FIELD(unit_names)
      ZERO_EXT_CONFIG_FIELD(unit_advice)
      ZERO_EXT_CONFIG_FIELD(kept_after_forward)
      ZERO_EXT_CONFIG_FIELD(resharded_to_subgroup)
      ZERO_EXT_CONFIG_FIELD(swap_path)
      ZERO_EXT_CONFIG_FIELD(swap_directory)
      ZERO_EXT_CONFIG_FIELD(swap_params)
      ZERO_EXT_CONFIG_FIELD(swap_optimizer)
      ZERO_EXT_CONFIG_FIELD(swap_threads)
      ZERO_EXT_CONFIG_FIELD(swap_chunk_bytes)
      ZERO_EXT_CONFIG_FIELD(swap_max_writing_bytes)
      ZERO_EXT_CONFIG_FIELD(swap_persist_bytes)
      ZERO_EXT_CONFIG_FIELD(shard_headers)
      ZERO_EXT_CONFIG_FIELD(gather_headers)
      ZERO_EXT_CONFIG_FIELD(replica_headers)
      ZERO_EXT_CONFIG_FIELD(regather_headers)
      ZERO_EXT_CONFIG_FIELD(expert_headers)
      ZERO_EXT_CONFIG_FIELD(stall_seconds)
      ZERO_EXT_CONFIG_FIELD(timeout_seconds)
      ZERO_EXT_CONFIG_FIELD(key_space)
      ZERO_EXT_CONFIG_FIELD(shard_mesh_ranks)
      ZERO_EXT_CONFIG_FIELD(replica_mesh_ranks)
      ZERO_EXT_CONFIG_FIELD(expert_mesh_ranks)
      ZERO_EXT_CONFIG_FIELD(expert_group_of_mesh_rank);
}

#undef ZERO_EXT_CONFIG_FIELD

} // namespace zero_ext
