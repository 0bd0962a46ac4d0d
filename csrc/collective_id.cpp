#include "collective_id.h"

namespace zero_ext {

uint64_t hash_words(uint64_t seed, const int64_t* words, size_t n) {
  uint64_t h = seed ^ 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; ++i) {
    uint64_t w = static_cast<uint64_t>(words[i]);
    for (int byte = 0; byte < 8; ++byte) {
      h ^= (w >> (8 * byte)) & 0xff;
      h *= 0x100000001b3ULL;
    }
  }
  return h;
}

uint64_t hash_text(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

uint64_t CollectiveId::hash() const {
  const int64_t words[] = {static_cast<int64_t>(purpose), subject, static_cast<int64_t>(op), numel, dtype};
  return hash_words(0, words, 5);
}

const char* divergence_causes() {
  return "Every rank must make the same calls on a wrapped model, in the same order: the same forwards (with "
         "the same modules run), backwards and steps. Typical causes: a module skipped by data on some ranks "
         "that is a stage 3 unit of its own (an MoE expert that got no token: keep the experts in the unit of "
         "the module that routes to them, with a units= policy that selects that module and none of the "
         "experts, or run every expert on every rank); a forward, "
         "generate() or state_dict() on one rank only (`if rank == 0:`; run it on every rank and write on rank "
         "0, or read weights with zero_ext.full_params(model) on every rank); evaluation or training loops of "
         "different lengths on different ranks (give every rank the same number of batches); no_sync() or "
         "optimizer.step() on some ranks only; requires_grad_() changed on some ranks only (a layer frozen "
         "there: its gradient buckets are then reduced on the other ranks only; freeze on every rank).";
}

const char* op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllReduceSum: return "all-reduce";
    case CollectiveOp::kAllReduceMax: return "all-reduce (max)";
    case CollectiveOp::kReduceScatter: return "reduce-scatter";
    case CollectiveOp::kAllGather: return "all-gather";
    case CollectiveOp::kBroadcast: return "broadcast";
  }
  return "collective";
}

} // namespace zero_ext
