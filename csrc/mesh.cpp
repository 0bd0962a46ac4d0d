#include "mesh.h"

#include <vector>

namespace zero_ext {

void Mesh::broadcast_from_rank0(std::vector<at::Tensor> tensors, Purpose purpose,
                                const std::vector<int64_t>& subjects,
                                const std::function<std::string(size_t)>& what, const std::string& label) const {
  // Row first (each row's shard rank 0 to its row), then column 0's values
  // down every column: shard rank s of row 0 got them in the first level.
  const int64_t label_subject = label.empty() ? 0 : static_cast<int64_t>(hash_text(label));
  for (Communicator* comm : {&shard_, &replica_}) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (size_t k = 0; k < tensors.size(); ++k) {
      const int64_t subject = k < subjects.size() ? subjects[k] : static_cast<int64_t>(k) + label_subject;
      works.push_back(comm->broadcast_from_rank0(tensors[k], purpose, subject, label));
    }
    for (size_t k = 0; k < works.size(); ++k) {
      comm->wait(works[k], [&] { return what(k); });
    }
  }
}

void Mesh::all_reduce(at::Tensor& tensor, bool max, Purpose purpose, const std::string& label,
                      const std::function<std::string()>& what) const {
  const int64_t subject = label.empty() ? 0 : static_cast<int64_t>(hash_text(label));
  for (Communicator* comm : {&shard_, &replica_}) {
    comm->wait(max ? comm->all_reduce_max(tensor, purpose, subject, label)
                   : comm->all_reduce_sum(tensor, purpose, subject, label),
               what);
  }
}

void Mesh::all_gather(at::Tensor& out, at::Tensor& in, Purpose purpose, const std::string& label,
                      const std::function<std::string()>& what) const {
  const int64_t subject = label.empty() ? 0 : static_cast<int64_t>(hash_text(label));
  if (!hybrid()) {
    shard_.wait(shard_.all_gather(out, in, purpose, subject, label), what);
    return;
  }
  // This row's blocks, then every row's: row r's blocks land at r*S, so the
  // order is the mesh rank's.
  at::Tensor row = at::empty({in.numel() * shard_.size()}, in.options());
  shard_.wait(shard_.all_gather(row, in, purpose, subject, label), what);
  replica_.wait(replica_.all_gather(out, row, purpose, subject, label), what);
}

} // namespace zero_ext
