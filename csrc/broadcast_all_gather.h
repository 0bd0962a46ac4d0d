#pragma once
// An all-gather over gloo made of one broadcast per rank, in place.
//
// [Note: gloo's all-gather as broadcasts]
// ProcessGroupGloo's all-gather receives into a flat temporary of the whole
// output, allocated on its worker thread, and copies it out chunk by chunk;
// torch adds a second full-size temporary where the call is made. Stage 3
// gathers every unit twice a step, so each gather cost two extra buffers of
// the unit's size and a copy of it, and the worker thread's buffers live in
// glibc arenas of their own that keep their memory once freed (57 MiB each
// for a 14M GPT's 27 MiB units). A broadcast from each rank of its own chunk,
// straight into the output, moves the same bytes ((n-1)/n of the output
// in and the shard out to each peer) with neither temporary nor copy.

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace zero_ext {

// Starts the gather of every rank's `shard_in` into `full_out` (the group's
// size chunks, in rank order) on `group`; complete once the returned work is.
c10::intrusive_ptr<c10d::Work> start_broadcast_all_gather(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                          const at::Tensor& full_out, const at::Tensor& shard_in);

} // namespace zero_ext
