#pragma once
// CollectiveId: what one collective of zero_ext is, as every rank must agree
// before it is issued ([Note: collectives that prove what they are] in
// collective_sequence.h).
//
// Purpose and subject say what it carries (the all-gather of bucket 7, the
// gradient reduction of bucket 3, the gradient-mask exchange); op, numel and
// dtype say what the backend will move. Two ranks whose next collectives have
// different ids must never issue them: a size mismatch aborts gloo from a
// thread, and a same-size mismatch returns another unit's bytes.

#include <cstdint>
#include <string>

#include <c10/core/ScalarType.h>

namespace zero_ext {

enum class Purpose : int64_t {
  kUnitGather = 1,       // stage 3: a bucket of a unit's parameters (subject: bucket)
  kGradReduce,           // a bucket's gradient reduction within the shard group (subject: bucket)
  kReplicaReduce,        // hybrid: a bucket's reduced shard across replicas (subject: bucket)
  kDeferredSync,         // hybrid: what deferred backwards kept back (subject: bucket)
  kAgreement,            // the per-backward exchange of gradient masks and progress
  kNonfiniteFlag,        // after a late second round: any rank non-finite
  kStepGather,           // stages 1-2: a bucket's updated shard after the step (subject: bucket)
  kInitBroadcast,        // wrap(): rank 0's values of a bucket (subject: bucket)
  kMaterialize,          // deferred init: rank 0's values of an opened bucket (subject: bucket)
  kMasters,              // full fp32 masters of a bucket (subject: bucket)
  kFullGrads,            // full gradients of a bucket (subject: bucket)
  kPython,               // a collective Python asked for (subject: hash of its description)
  kHeader,               // a sequence check's own header (header groups only, never checked)
};

enum class CollectiveOp : int64_t { kAllReduceSum = 1, kAllReduceMax, kReduceScatter, kAllGather, kBroadcast };

struct CollectiveId {
  Purpose purpose = Purpose::kPython;
  int64_t subject = 0;
  CollectiveOp op = CollectiveOp::kAllReduceSum;
  int64_t numel = 0;  // what this rank sends (all-gather: its part)
  int64_t dtype = 0;  // c10::ScalarType

  uint64_t hash() const;
  bool operator==(const CollectiveId& other) const {
    return purpose == other.purpose && subject == other.subject && op == other.op && numel == other.numel &&
           dtype == other.dtype;
  }
};

// FNV-1a over 64-bit words: the same on every rank and build.
uint64_t hash_words(uint64_t seed, const int64_t* words, size_t n);
uint64_t hash_text(const std::string& text);
const char* op_name(CollectiveOp op);
// What makes ranks take different paths, and the fix, for every error that
// finds them apart.
const char* divergence_causes();

} // namespace zero_ext
