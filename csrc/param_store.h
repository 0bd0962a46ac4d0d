#pragma once
// ParamStore: the parameter values of one wrapped model, per bucket.
//
//   flat    the full bucket the parameters view (stage 3: released between
//           uses, see [Note: release by resize] in storage_release.h)
//   shard   this rank's slice of flat (stage 3: memory of its own, unless the
//           gather casts it from the master; replicated: the whole bucket)
//   master  fp32 shard the optimizer steps when parameters compute in lower
//           precision or the optimizer is offloaded (host memory then)
// Parameters compute in the "compute copy" (flat/shard), refreshed from the
// masters after each step. Every rank starts from rank 0's values.
// Defined by concern: the buffers in param_store.cpp, the masters (refresh,
// gathers, loads) in param_store_masters.cpp, deferred initialization in
// param_store_materialize.cpp, offload to a file in param_store_swap.cpp.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Storage.h>

#include "communicator.h"
#include "layout.h"
#include "mesh.h"
#include "step_gate.h"
#include "swap_space.h"

namespace zero_ext {

struct BucketValues {
  at::Tensor flat;
  at::Tensor shard;
  at::Tensor master;
  // Offload from an accelerator with a compute dtype: the shard in that
  // dtype in pinned host memory, which the fused CPU Adam writes and the
  // refresh copies to the device asynchronously.
  at::Tensor host_compute;
  // Stage 3, shard_is_flat: a copy of flat the parameters view while
  // gathered for inspection ([Note: one rank's shard is its flat buffer]).
  at::Tensor inspected;
};

class ParamStore {
 public:
  // Makes every parameter a view of its bucket's flat buffer, broadcasts
  // rank 0's values, creates the masters and (stage 3) keeps only the shard.
  // deferred: the parameters hold no values yet (a meta-device model); the
  // buckets are laid out empty for begin/end_materialize.
  // Shards over the mesh's shard group; the initial values (and a deferred
  // model's) come from mesh rank 0 to every rank. Expert buckets shard over
  // `expert_comm`, and their initial values come from its rank 0 ([Note:
  // expert buckets] in layout.h).
  ParamStore(std::vector<at::Tensor> params, const Layout& layout, const Mesh& mesh, Communicator& expert_comm,
             const Progress& progress, std::optional<c10::ScalarType> compute_dtype, bool offload,
             bool deferred);

  const std::vector<at::Tensor>& params() const { return params_; }
  const at::Tensor& param(int64_t i) const { return params_[i]; }
  const BucketValues& bucket(int64_t b) const { return values_[b]; }
  bool has_masters() const { return has_masters_; }
  bool offload() const { return offload_; }
  c10::Device device() const { return params_[0].device(); }

  // The tensors the optimizer steps (see Layout::segments) and, per segment,
  // where a fused optimizer may write the updated value in the compute dtype
  // (undefined where it cannot: another device, or no low-precision copy).
  const std::vector<at::Tensor>& segments() const { return segments_; }
  std::vector<at::Tensor> segment_compute_copies() const;

  // Stage 3: point bucket b's parameters at its flat buffer (gathered) or at
  // their unreadable stand-ins (released; [Note: unreadable released parameters]).
  void point_params(int64_t b, bool gathered);
  void regrow_flat(int64_t b);
  void release_flat(int64_t b);
  bool flat_released(int64_t b) const;
  // [Note: one rank's shard is its flat buffer] Stage 3 alone in its shard
  // group without masters: the shard is the whole flat buffer, never
  // released (regrow_flat and release_flat leave it be).
  bool shard_is_flat(int64_t b) const {
    return layout_.params_sharded() && values_[b].shard.defined() && values_[b].shard.is_alias_of(values_[b].flat);
  }
  // Gathered for inspection (full_params, state_dict, load_state_dict): a
  // shard_is_flat bucket's parameters view a copy, so what is changed there
  // is kept only by write_back_shards, as on more ranks. No-op otherwise.
  void open_inspection_copy(int64_t b);
  at::Tensor& flat_mut(int64_t b) { return values_[b].flat; }
  // Stage 3: what a gather of bucket b sends, in the compute dtype: the
  // shard, or the master cast into flat's own slot (flat must be grown).
  at::Tensor gather_input(int64_t b);

  // Parameters whose values were just rewritten (step, load) bump their
  // autograd version, as an in-place update in plain PyTorch would, so a
  // graph saved before raises "modified by an inplace operation".
  void bump_versions(const std::function<bool(int64_t)>& rewritten);

  // Offload: the optimizer wrote the compute copy itself (fused CPU Adam).
  void note_compute_copy_written() { compute_copy_written_ = true; }
  void forget_compute_copy_written() { compute_copy_written_ = false; }
  // Masters -> compute copies of the shards (unless the optimizer wrote them).
  // After a step (every_bucket false) buckets of frozen parameters are left
  // out: no step writes their masters. Offload from an accelerator:
  // host-to-device copies from pinned memory, not waited for ([Note: offload refresh]).
  void refresh_compute_copies(bool every_bucket);
  // Before the host writes what the last refresh copies from (the masters,
  // host_compute): those copies are done. Queried first; waits only if not.
  void wait_host_sources_free();
  // Stages 1-2: all-gather the shards of the buckets `touched` says changed.
  void all_gather_updated(const std::function<bool(int64_t)>& touched);
  // After full parameters were written in place (stage 3, gathered buckets):
  // keep them as the shards.
  void write_back_shards();

  // Collective: each parameter's fp32 master value (flat).
  std::vector<at::Tensor> full_masters();
  // Collective: the same for the parameters of `buckets` only, in parameter
  // order (memory: those buckets), so a model can be written bucket by bucket.
  std::vector<at::Tensor> full_masters_of(const std::vector<int64_t>& buckets);
  void load_masters(const std::vector<at::Tensor>& full_params);
  // Per bucket, the tensor holding this rank's values (master, else shard).
  std::vector<at::Tensor> local_value_shards() const;

  // Deferred initialization ([Note: deferred initialization]): bucket b's
  // parameters view a zeroed full buffer in their own dtype until
  // end_materialize, which (collective) broadcasts rank 0's values and keeps
  // this rank's master and shard.
  void begin_materialize(int64_t b);
  void end_materialize(const std::vector<int64_t>& buckets);
  // Of the full buffers open, the bytes of temporaries (not counted in param_bytes).
  int64_t materializing_bytes() const;

  // A parameter resized after wrap() is refused by name.
  void check_shapes() const;
  // Whether parameter i still views its bucket (its .data was not replaced).
  bool still_in_place(int64_t i) const;

  // offload_*="nvme" ([Note: swapped values]): before anything reads the
  // shards. `params`: stage 3 shards (and their masters) live in the file;
  // `masters`: fp32 masters do (mixed precision). Buckets whose value is
  // smaller than `persist_bytes` stay in memory.
  void enable_swap(SwapSpace& swap, bool params, bool masters, int64_t persist_bytes);
  bool swapping() const { return swap_ != nullptr; }
  bool value_swapped(int64_t b) const { return !value_slot_.empty() && value_slot_[b] >= 0; }
  // Bucket b's value (master, else shard) in memory, its segments pointing
  // at it; parked again (written back if `dirty`), the segments unreadable.
  void ensure_value(int64_t b);
  void park_value(int64_t b, bool dirty);
  void prefetch_value(int64_t b);
  // Stage 3: a gather of bucket b is done with its input.
  void after_gather(int64_t b);
  // The optimizer's step, a checkpoint: bucket b's value stays in memory
  // (parks from gathers wait) until unhold, which parks it (written back if
  // `dirty` or if anything marked it changed meanwhile; `stepped`: see park_stepped).
  void hold_value(int64_t b);
  void unhold_value(int64_t b, bool stepped);
  // After the optimizer stepped bucket b: its compute copy refreshed from
  // the master (stages 1-2 under mixed precision), then parked, written back.
  void park_stepped(int64_t b);

  int64_t param_bytes() const;
  int64_t master_bytes() const;
  int64_t host_compute_bytes() const;  // of param_bytes, in pinned host memory (offload on a GPU)

 private:
  const Layout& layout_;
  const Mesh& mesh_;
  Communicator& comm_;  // the shard group
  Communicator& expert_comm_;
  // The group bucket b is sharded over.
  Communicator& comm_of(int64_t b) const { return layout_.expert(b) ? expert_comm_ : comm_; }
  const Progress& progress_;
  std::vector<at::Tensor> params_;
  std::vector<BucketValues> values_;
  std::vector<at::Tensor> segments_;
  // Per bucket: the full buffer its parameters view while being materialized.
  std::vector<at::Tensor> materializing_;
  // Stage 3: what each parameter points at while its unit is released.
  std::vector<c10::Storage> released_;
  bool has_masters_ = false;
  bool offload_ = false;
  std::optional<c10::Event> host_sources_sent_;
  bool compute_copy_written_ = false;
  bool deferred_ = false;  // laid out without values (wrap() materializes them)
  // The constructor's steps, per bucket: the flat buffer the parameters
  // view (holding their values unless deferred); then what the stage keeps:
  // the fp32 master and the compute copy in compute_dtype (keep_master),
  // and (stage 3) the shard `mine` apart, the flat buffer released (keep_shard).
  void lay_out_flat(int64_t b);
  void keep_what_the_stage_keeps(int64_t b, std::optional<c10::ScalarType> compute_dtype);
  void keep_master(int64_t b, std::optional<c10::ScalarType> compute_dtype);
  void keep_shard(int64_t b, const at::Tensor& mine);
  void build_segments();
  SwapSpace* swap_ = nullptr;
  std::vector<int64_t> value_slot_;            // by bucket: its value's swap slot (-1: in memory)
  std::vector<uint8_t> held_;                  // by bucket: hold_value'd
  std::vector<uint8_t> held_dirty_;            // by bucket: changed while held
  std::vector<c10::Storage> parked_segments_;  // by bucket: what its segments view while parked
  std::vector<std::vector<int64_t>> segments_of_bucket_;
};

// fp32 in host memory; pinned when it feeds an accelerator, so transfers can
// run asynchronously.
at::TensorOptions host_fp32(const c10::Device& device);

} // namespace zero_ext
