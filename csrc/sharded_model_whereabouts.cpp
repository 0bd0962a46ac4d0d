// What the model tells about its collectives when a wait stalls ([Note:
// stall diagnosis] and [Note: whereabouts] in communicator.h): each
// collective described in the model's terms (unit, bucket, purpose), and the
// stall queries and whereabouts its groups share.
#include "sharded_model.h"

#include <algorithm>
#include <string>

namespace zero_ext {

std::string ShardedModel::describe_collective(const CollectiveId& id, const std::string& label) const {
  const std::string op = op_name(id.op);
  const bool bucket = id.subject >= 0 && id.subject < layout_.num_buckets();
  auto bucket_text = [&] {
    return bucket ? layout_.describe_bucket(id.subject, "") : "bucket " + std::to_string(id.subject);
  };
  switch (id.purpose) {
    case Purpose::kUnitGather:
      return "the " + op + " of the parameters of " +
             (bucket ? layout_.describe_unit(layout_.bucket(id.subject).unit) : std::string("a unit")) +
             " (bucket " + std::to_string(id.subject) + ")";
    case Purpose::kGradReduce: return "the gradient " + op + " of " + bucket_text();
    case Purpose::kReplicaReduce: return "the " + op + " across replicas of the gradient of " + bucket_text();
    case Purpose::kDeferredSync: return "the " + op + " across replicas of deferred gradients of " + bucket_text();
    case Purpose::kAgreement: return "the exchange of which parameters got gradients";
    case Purpose::kNonfiniteFlag: return "the exchange of the non-finite gradient flag";
    case Purpose::kStepGather: return "the " + op + " of updated parameters of " + bucket_text();
    case Purpose::kInitBroadcast: return "wrap()'s " + op + " of " + bucket_text();
    case Purpose::kMaterialize: return "the " + op + " of initialized parameters of " + bucket_text();
    case Purpose::kMasters: return "the " + op + " of master weights of " + bucket_text();
    case Purpose::kFullGrads: return "the " + op + " of gradients for full_grads() of " + bucket_text();
    case Purpose::kPython: return "the " + op + " for " + (label.empty() ? std::string("a Python call") : label);
    case Purpose::kHeader: break;
  }
  return op + " (" + std::to_string(id.numel) + " elements)";
}

int64_t ShardedModel::stall_queries() const {
  // The groups share one key space; a group of one (a flat world of 1, the
  // rows of an Nx1 mesh) has no store and reads 0.
  return std::max(comm_.stall_queries(), replica_comm_.stall_queries());
}

void ShardedModel::post_whereabouts(int64_t query, bool blocked, std::string where) const {
  comm_.post_whereabouts(query, blocked, where);  // keyed by mesh rank: the same key for both groups
  replica_comm_.post_whereabouts(query, blocked, where);
}

} // namespace zero_ext
