#pragma once
// Mesh: every rank a model's state is spread over, as a grid of replicas
// (rows) of one shard group (columns).
//
// [Note: hybrid sharding]
// A flat model shards over one group. A hybrid model (wrap() given a 2-D
// DeviceMesh (replicate, shard)) shards over the shard group, a row of the
// grid (typically the GPUs of one node), and keeps R copies of that
// sharding, one per row. A gradient is reduce-scattered within the row
// (fast links, full volume) and only the resulting shard is all-reduced
// across the rows (the slow links carry 1/S of it); gathers and the
// optimizer never leave the row. So GradReducer divides by R*S and issues a
// replica all-reduce after each bucket's reduction; everything that must
// hold on every rank of the job (the agreement rows, the initial broadcast,
// checkpoint exchanges) runs as two levels here: within the row, then
// across rows. A sum, max, broadcast or gather composes that way because the
// grid is regular: rank (r, s) is shard rank s of row r and replica rank r
// of column s (wrap() checks that the mesh's groups number it so), so the
// mesh rank r*S + s names one rank the same way everywhere.
// A flat model is the 1-row mesh: the replica communicator is none (size 1)
// and every two-level collective is its first level.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "communicator.h"

namespace zero_ext {

class Mesh {
 public:
  Mesh(Communicator& shard, Communicator& replica) : shard_(shard), replica_(replica) {}

  Communicator& shard() const { return shard_; }
  Communicator& replica() const { return replica_; }
  bool hybrid() const { return replica_.size() > 1; }
  int64_t rank() const { return replica_.rank() * shard_.size() + shard_.rank(); }
  int64_t size() const { return replica_.size() * shard_.size(); }
  bool failed() const { return shard_.failed() || replica_.failed(); }

  // Every rank ends with mesh rank 0's values, in place. `what(k)` names
  // tensor k in errors; `subjects[k]` is its subject (empty: k), and
  // `label` the description a sequence check shows (kPython).
  void broadcast_from_rank0(std::vector<at::Tensor> tensors, Purpose purpose, const std::vector<int64_t>& subjects,
                            const std::function<std::string(size_t)>& what, const std::string& label = {}) const;
  // Sum (or max) over every rank, in place.
  void all_reduce(at::Tensor& tensor, bool max, Purpose purpose, const std::string& label,
                  const std::function<std::string()>& what) const;
  // `out` gets size() blocks of `in`'s numel, in mesh-rank order.
  void all_gather(at::Tensor& out, at::Tensor& in, Purpose purpose, const std::string& label,
                  const std::function<std::string()>& what) const;

 private:
  Communicator& shard_;
  Communicator& replica_;
};

} // namespace zero_ext
