#include "mesh.h"

#include <vector>

namespace zero_ext {

void Mesh::broadcast_from_rank0(std::vector<at::Tensor> tensors,
                                const std::function<std::string(size_t)>& what) const {
  // Row first (each row's shard rank 0 to its row), then column 0's values
  // down every column: shard rank s of row 0 got them in the first level.
  for (Communicator* comm : {&shard_, &replica_}) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (auto& tensor : tensors) works.push_back(comm->broadcast_from_rank0(tensor));
    for (size_t k = 0; k < works.size(); ++k) {
      comm->wait(works[k], [&] { return what(k); });
    }
  }
}

void Mesh::all_reduce(at::Tensor& tensor, bool max, const std::function<std::string()>& what) const {
  for (Communicator* comm : {&shard_, &replica_}) {
    comm->wait(max ? comm->all_reduce_max(tensor) : comm->all_reduce_sum(tensor), what);
  }
}

void Mesh::all_gather(at::Tensor& out, at::Tensor& in, const std::function<std::string()>& what) const {
  if (!hybrid()) {
    shard_.wait(shard_.all_gather(out, in), what);
    return;
  }
  // This row's blocks, then every row's: row r's blocks land at r*S, so the
  // order is the mesh rank's.
  at::Tensor row = at::empty({in.numel() * shard_.size()}, in.options());
  shard_.wait(shard_.all_gather(row, in), what);
  replica_.wait(replica_.all_gather(out, row), what);
}

} // namespace zero_ext
