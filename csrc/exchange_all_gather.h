#pragma once
// An all-gather over gloo made of one all-to-all.
//
// [Note: gloo's all-gather as an exchange]
// ProcessGroupGloo's all-gather gathers into a temporary of the output's size,
// allocated on its worker thread, and copies it out. Freed, that temporary
// stays in the worker thread's malloc arena: glibc raises its mmap threshold
// to the largest freed mapping (up to 32 MiB), so a unit's gather of under
// 32 MiB comes from the arena and never goes back, one arena per gloo thread.
// On a 14M GPT at stage 3 that is most of what stage 3 held above DDP's
// resident memory (docs/benchmarks.md). Gloo's all-to-all sends from and
// receives into the caller's tensors: the input holds this rank's shard once
// per rank (a reusable host block, csrc/reusable_blocks.h) and rank r's chunk
// of the output receives rank r's shard. The same bytes go over the wire,
// (n-1) shards a rank, in one work: the collective checks see one collective.
// The copies move from gloo's thread (its copy-out) to the caller (the
// repeated shard), the same bytes.

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace zero_ext {

// Starts the gather of every rank's `shard_in` into `full_out` (the group's
// size chunks, in rank order) on `group`; `full_out` holds them once the
// work completes.
c10::intrusive_ptr<c10d::Work> start_exchange_all_gather(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                         const at::Tensor& full_out, const at::Tensor& shard_in);

} // namespace zero_ext
