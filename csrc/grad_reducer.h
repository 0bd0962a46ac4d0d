#pragma once
// GradReducer: the gradient path, from a parameter's AccumulateGrad to the
// optimizer's shard (see [Note: gradient layouts] in layout.h).
//
// A gradient arrives (on_grad_ready) and is moved into its bucket's staging
// buffer; in stages 0-2 a bucket launches its reduction once all its
// parameters arrived, strictly in bucket order, so every rank issues the same
// sequence of collectives even when ranks use different parameters; stage 3
// launches a unit's buckets when the unit's backward is over ([Note: issue
// order] in grad_reducer.cpp). The epilogue flushes the rest (missing
// gradients count as zeros) and waits. A retired reduction
// is folded into the fp32 shard accumulator (offload: landed in host memory
// and added there, never copied over it, so every backward of a step counts).
// grad_reducer.cpp holds the way in (arrival, the launch order, retire),
// grad_reducer_launch.cpp a bucket's launch per gradient layout,
// grad_accumulators.cpp the way out (accumulators, offload landing, .grad),
// and grad_accumulators_swap.cpp the accumulators kept in an offload file.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "communicator.h"
#include "reduction_stream.h"
#include "layout.h"
#include "param_store.h"
#include "step_gate.h"
#include "swap_space.h"

namespace zero_ext {

// Whether two tensors are the same memory with the same geometry (a .grad
// that is still the view zero_ext put there).
inline bool same_memory(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() &&
         a.strides() == b.strides();
}

enum class BucketPhase : int8_t {
  kFilling,   // gradients arriving
  kInFlight,  // its reduction was issued and not yet folded in
  kRetired,   // folded in (or nothing to reduce: frozen parameters only)
};

class GradReducer {
 public:
  // comm: the shard group; replica_comm: across the copies of the shard
  // (hybrid sharding, [Note: hybrid sharding] in mesh.h; none when flat).
  GradReducer(const Layout& layout, ParamStore& store, Communicator& comm, Communicator& replica_comm,
              Communicator& expert_comm,
              const StepGate& gate, std::optional<c10::ScalarType> reduce_dtype);

  // A parameter's gradient was accumulated into param.grad. Returns the
  // bucket whose last parameter this was (-1: none), for stage 3's release.
  int64_t on_grad_ready(int64_t i, bool sync);
  // Retires reductions already complete, oldest first. Never waits.
  void retire_completed();
  // [Note: reductions in flight]
  // Stages 2-3 hold a bucket's staging buffer (and its reduce-scatter output)
  // only while its reduction is in flight, so peak gradient memory in
  // backward is the filling buckets plus the reductions in flight. Those are
  // bounded in bytes: past the bound, the oldest reduction is retired before
  // the backward goes on. With NCCL that wait orders the compute stream
  // after the collective (no host wait), and the buffers are released in
  // stream order for the caching allocator to reuse. Where a wait blocks the
  // host (gloo), it is a bounded poll: a full wait inside a hook could
  // deadlock with a peer that reaches this bucket only in its epilogue, after
  // another collective of its backward (a layer used on some ranks only next
  // to a tensor-parallel all-reduce, say), so after kHostBoundWait the bound
  // is lifted for the rest of the backward instead (counted in bound_lifts).
  void set_max_in_flight_bytes(int64_t bytes) { max_in_flight_bytes_ = bytes; }
  int64_t max_in_flight_bytes() const { return max_in_flight_bytes_; }
  int64_t bound_lifts() const { return bound_lifts_; }
  // Most bytes of staging and reduce-scatter outputs alive at once (the
  // gradient memory of backward outside the accumulators).
  int64_t peak_staging_bytes() const { return peak_staging_bytes_; }
  // Stage 3 (see [Note: issue order]): the last use of a unit in this
  // backward is over, so its buckets launch, missing gradients as zeros.
  void launch_buckets(const std::vector<int64_t>& buckets);
  // [Note: deferred replica all-reduce]
  // Hybrid sharding with gradient accumulation: FSDP2's
  // set_requires_all_reduce(False). A backward that defers still reduces
  // within the shard group (so gradients stay sharded), but keeps each
  // bucket's result back from the replicas: it is added into the bucket's
  // fp32 `unsynced` shard instead of the accumulator. The next bucket
  // reduction that does go across replicas adds `unsynced` into its result
  // first, so one all-reduce carries every deferred round, overlapped with
  // backward as usual; whatever is still kept back when the gradients are
  // read (step, clip, full_grads) is all-reduced then (sync_deferred). Costs
  // one fp32 shard per bucket while anything is deferred, and the sum over
  // replicas is the same as synced every time (fp32, one rounding later).
  // Stage 0 reduces whole gradients and never defers: no_sync() is its
  // accumulation tool.
  void set_replica_sync(bool sync) { replica_sync_ = sync; }
  // FSDP2's set_gradient_divide_factor: reductions divide the sum over every
  // rank by `factor` instead of the number of ranks (0: that number again).
  void set_divide_factor(double factor) { divide_factor_ = factor; }
  // wrap(compress_grads=): reductions within the shard group send
  // block-quantized integers with error feedback ([Note: quantized
  // collectives]); stages 2-3, before the first backward.
  void set_compression(const QuantFormat& format) { grad_format_ = format; }
  // Bytes of the error-feedback residuals held (fp32, a bucket each once reduced).
  int64_t residual_bytes() const;
  bool replica_sync() const { return replica_sync_; }
  // Whether a bucket launched now keeps its result back from the replicas.
  bool defers_replica_sync() const { return hybrid_ && !replica_sync_ && layout_.stage() > 0; }
  bool has_deferred() const;
  // Collective across the replicas: all-reduces what is kept back, in bucket
  // order, and folds it into the accumulators.
  void sync_deferred();
  // Epilogue: launch every bucket not yet launched (in order), then wait.
  void flush();
  // [Note: buckets frozen since wrap] A bucket whose parameters are all
  // frozen now (requires_grad_(False) after wrap) gets no gradient on any
  // rank (torch's AccumulateGrad drops the gradient of a parameter frozen
  // when it runs, even one frozen after its forward), so reducing it would
  // only add zeros: it is retired unreduced,
  // provided nothing of an earlier backward waits to be reduced (no no_sync()
  // backward since the last synced one, and the last exchange settled):
  // whether it is skipped then depends only on what every rank agrees on
  // (the flags, checked in each backward's exchange, and the loop's shape).
  // Allowed per backward round: set when it starts, cleared when it ends.
  void allow_frozen_skip(bool settled) { frozen_skip_allowed_ = settled && !unsynced_since_reduce_; }
  void note_unsynced_backward() { unsynced_since_reduce_ = true; }
  bool unsynced_since_reduce() const { return unsynced_since_reduce_; }
  // [Note: reductions at read]: gradients a schedule wrote into param.grad
  // itself (zero-bubble's weight pass: torch.autograd.grad, then
  // `weight.grad = dw` or `+=`), which no hook saw, count as accumulated
  // locally, as under no_sync(). Returns whether there were any.
  bool adopt_written_grads();
  int64_t frozen_skips() const { return frozen_skips_; }
  void wait_all();
  // Offload from an accelerator: the host adds of landed results, done when
  // the host gradients are read ([Note: offload without a host sync in backward]).
  void finish_host_adds();
  // A second round for gradients that came after their bucket went out
  // (a parameter reached twice through a reentrant checkpoint, say).
  void rerun_all();
  void start_round();
  bool late() const { return late_; }
  void set_late(bool late) { late_ = late; }
  int64_t waiting(int64_t b) const { return buckets_[b].waiting; }

  // 0-dim float flag on the accumulators' device: whether this rank's
  // reduced shards hold inf/nan. No host sync of its own.
  at::Tensor local_nonfinite() const;
  // Makes the local shard non-finite too (a rank sees only its shard).
  void mark_nonfinite_everywhere();
  // The same, decided on the device: one element of the shard gets NaN
  // added where `flag` (1 element, the sum over ranks) is positive, and 0
  // otherwise. No host sync unless the shards live in host memory.
  void mark_nonfinite_on_device(const at::Tensor& flag);
  // Which parameters got a gradient since the last zero_grad: here / anywhere.
  const std::vector<uint8_t>& local_has_grad() const { return local_has_grad_; }
  std::vector<uint8_t>& global_has_grad() { return global_has_grad_; }
  const std::vector<uint8_t>& global_has_grad() const { return global_has_grad_; }
  // Sets param.grad / segment.grad from the reduced buffers. `provisional`:
  // before the ranks' gradient masks are read (see [Note: host syncs] in
  // rank_agreement.h), every trainable parameter counts as having a
  // gradient (zeros where no rank had one) and late gradients stay in
  // param.grad for the next round.
  void publish(bool provisional);
  void zero_grad(bool set_to_none);
  // A loaded model starts with no gradient.
  void forget_accumulated();
  // Drops the round: waits out reductions in flight first when `wait` (no
  // buffer is freed or zeroed under a collective). Returns the first failed
  // wait, for the caller to raise after its own cleanup.
  std::exception_ptr abandon(bool wait);

  // Full averaged gradient of each parameter (flat, fp32). Collective outside
  // the DDP layout.
  std::vector<at::Tensor> full_grads();

  // [Note: gradient stand-ins]
  // Outside the DDP layout a reduced gradient lives in the optimizer's shards,
  // so param.grad would be None after backward and torch.nn.utils.
  // clip_grad_norm_(model.parameters()) would silently clip nothing. Instead
  // param.grad holds a stand-in of the parameter's shape with no memory, whose
  // data access raises an error naming zero_ext.clip_grad_norm_; a pre hook on
  // the AccumulateGrad node (autograd_hooks.h) drops it before the next
  // gradient accumulates.
  const at::Tensor& stand_in(int64_t i) const { return stand_ins_[i]; }
  bool holds_stand_in(int64_t i) const;
  // Whether param.grad holds a value zero_ext did not reduce.
  bool holds_stray_grad(int64_t i) const;
  // After a synced epilogue: no parameter may keep an unreduced gradient.
  void check_no_unreduced_grads() const;

  // offload_optimizer="nvme" ([Note: swapped gradients]): the fp32
  // accumulators become slots of `swap`. Before its file is made.
  // Accumulators under `persist_bytes` stay in memory ([Note: persistent small buckets]).
  void enable_swap(SwapSpace& swap, int64_t persist_bytes);
  bool grads_swapped() const { return swap_ != nullptr; }
  // Bucket b's accumulated gradient in memory (zeros if none) and its
  // segments' .grad viewing it; parked again (written if `dirty`), the
  // segments' .grad unreadable stand-ins.
  void ensure_grads(int64_t b);
  void park_grads(int64_t b, bool dirty);
  void prefetch_grads(int64_t b);
  int64_t grad_bytes() const;
  int64_t host_bytes() const;  // offload: accumulators and landing buffers in host memory
  int64_t host_landing_buffers() const;

 private:
  struct BucketGrads {
    at::Tensor staging;      // gradients being reduced (see [Note: gradient layouts])
    // DDP layout: zero_grad(set_to_none) left the last values in staging
    // (nothing views it); the next flush overwrites every slot, a bucket
    // retired unflushed zeroes it.
    bool staging_stale = false;
    at::Tensor accum;        // fp32 shard of the reduced gradient (not the DDP layout)
    int64_t swap_slot = -1;  // its slot in the offload file (offload_optimizer="nvme")
    bool accum_has_value = false;
    at::Tensor reduce_out;   // where the reduction writes this rank's result
    at::Tensor host_landing; // offload from an accelerator: pinned copy of reduce_out
    bool host_add_pending = false;
    double host_factor = 1.0;  // applied once the landed result is on the host
    int64_t in_flight_bytes = 0;  // staging and output held by its reduction
    int64_t waiting = 0;     // parameters not yet arrived in this round
    BucketPhase phase = BucketPhase::kFilling;
    c10::intrusive_ptr<c10d::Work> work;          // the reduction within the shard group
    bool replica_pending = false;                 // hybrid: its replica all-reduce is not issued yet
    bool defers = false;     // this reduction's result is kept back from the replicas
    bool result_unscaled = false;  // reduce_out already holds unscaled values (it carries `unsynced`)
    at::Tensor unsynced;     // fp32 sum of results kept back from the replicas ([Note: deferred replica all-reduce])
    c10::intrusive_ptr<c10d::Work> replica_work;  // hybrid: the all-reduce of the result across replicas
    at::Tensor residual;     // compress_grads: what rounding kept back from the last reduction (the staging's size, fp32)
    at::Tensor replica_residual;  // compress_grads, hybrid: the same for the reduction across replicas (the shard's size)
  };

  // The constructor's steps: staging (where it persists), accumulators,
  // the views of them; the stand-ins of [Note: gradient stand-ins]; the
  // bound on reductions in flight ([Note: reductions in flight]).
  void allocate_buffers();
  void make_stand_ins();
  void size_in_flight_bound();
  at::Tensor staging_region(int64_t b, int64_t i);
  void ensure_staging(int64_t b);
  // [Note: one rank's staging is its accumulator]
  bool may_stage_into_accum() const;
  bool stages_into_accum(int64_t b) const;
  // Staging allocated per reduction and freed once reduced (stages 2-3; stage 1 alone in its group).
  bool staging_is_transient() const;
  void launch_ready_buckets();
  // Launches bucket b's reduction, by its gradient layout ([Note: gradient
  // layouts] in layout.h), unless it is retired unreduced (frozen).
  void launch(int64_t b);
  bool retires_unreduced(int64_t b);
  void launch_ddp_in_place(int64_t b);
  void launch_replicated(int64_t b);
  void launch_sharded_persistent(int64_t b);
  void launch_sharded_transient(int64_t b);
  // The launch's steps. Gradients not arrived into the staging (zeros where
  // none; the padding zeroed), on the compute stream.
  void stage_missing_as_zeros(int64_t b);
  // The accumulator ready, the reduction stream entered (`on_reduction_stream`
  // holds it until the caller returns), the staging pre-divided.
  void begin_reduction(int64_t b, std::optional<c10::StreamGuard>& on_reduction_stream);
  // Whether reductions within the shard group send quantized payloads (compress_grads).
  bool reduces_quantized(int64_t b) const;
  // Issues a sharded layout's reduction (quantized, an all-reduce in place on
  // the CPU, or a reduce-scatter); returns the scratch bytes it holds in flight.
  int64_t issue_reduce_scatter(int64_t b);
  // Marks it in flight; hybrid: its replica all-reduce pending (issued now on streams).
  void go_in_flight(int64_t b);
  // Counts what the reduction holds in flight: the staging and its output
  // (transient staging), or the exchange's buffers only (persistent staging).
  void count_staging_in_flight(int64_t b, int64_t scratch_bytes);
  void count_exchange_in_flight(int64_t b, int64_t scratch_bytes);
  void retire(int64_t b);  // waits one reduction and folds it in
  // Hybrid: all-reduces bucket b's shard result across the replicas, once
  // its reduction within the shard group is done (a stream wait under NCCL,
  // a host wait otherwise). Issued in launch order on every rank.
  void issue_replica_reduction(int64_t b);
  // Issues the replica all-reduces whose shard reductions completed, oldest
  // first, stopping at the first still running. Never waits.
  void advance_replica_reductions();
  bool reduction_completed(const BucketGrads& bucket) const;
  // Where waits block the host: whether bucket b's reduction (both levels)
  // finished within `limit`.
  bool reduction_done_within(int64_t b, std::chrono::milliseconds limit);
  void retire_oldest();
  void bound_in_flight();
  // Kept as running counts (stages 2-3): a sum over the buckets at every
  // launch would cost a pass over them per bucket per backward.
  void note_staging_peak() {
    peak_staging_bytes_ = std::max(peak_staging_bytes_, filling_staging_bytes_ + in_flight_bytes_);
  }
  void fold_into_accum(BucketGrads& bucket, const at::Tensor& reduced, double factor);
  void keep_back(BucketGrads& bucket, const at::Tensor& reduced, double factor);
  // What a reduction result is multiplied by as it is folded in.
  double result_unscale() const;
  // Grows an accumulator zero_grad released ([Note: accumulator memory]).
  void ensure_accum_memory(BucketGrads& bucket);
  // Before a mark that later folds must add to: the accumulator holds a value (zeros if none).
  void hold_value(BucketGrads& bucket);
  // Before a read or partial write: a released accumulator holds zeros.
  void zero_if_released(BucketGrads& bucket);
  void note_host_copy(const at::Tensor& reduced);
  void close_host_round();

  const Layout& layout_;
  ParamStore& store_;
  Communicator& comm_;
  Communicator& expert_comm_;
  // The group bucket b is reduced over ([Note: expert buckets] in layout.h).
  Communicator& comm_of(int64_t b) const { return layout_.expert(b) ? expert_comm_ : comm_; }
  Communicator& replica_comm_;
  const bool hybrid_;
  bool replica_sync_ = true;  // set_requires_all_reduce()
  bool frozen_skip_allowed_ = false;   // this round (allow_frozen_skip)
  bool unsynced_since_reduce_ = false;  // a no_sync() backward left gradients to reduce
  int64_t frozen_skips_ = 0;            // buckets retired unreduced, for tests
  bool frozen_now(int64_t b) const;
  double divide_factor_ = 0.0;  // 0: the number of ranks
  QuantFormat grad_format_;     // bits 0: reductions send the gradients' own dtype
  ReductionStream streams_;
  const StepGate& gate_;
  at::ScalarType reduce_dtype_ = at::kFloat;  // staging dtype outside the DDP layout
  std::vector<BucketGrads> buckets_;
  std::vector<at::Tensor> grad_views_;     // DDP layout: param-shaped views of staging
  std::vector<at::Tensor> segment_grads_;  // the segments' .grad: views of the accumulators
  std::vector<at::Tensor> stand_ins_;

  // Round state: one round is one synchronized reduction of every bucket.
  std::vector<uint8_t> arrived_;
  std::vector<uint8_t> detached_;  // DDP layout: grad moved into staging for a reduction
  int64_t next_launch_ = 0;
  std::deque<int64_t> in_flight_;  // launched, not yet retired, oldest first
  bool late_ = false;              // a gradient came after its bucket was launched
  bool launch_on_arrival_ = true;  // stages 0-2; stage 3 launches at unit events
  int64_t in_flight_bytes_ = 0;
  int64_t filling_staging_bytes_ = 0;  // staging of buckets not launched yet
  int64_t max_in_flight_bytes_ = 0;  // 0 until the constructor sets it
  bool host_waits_ = false;          // waits on this device's reductions block the host
  // Stages 1-3 over gloo: reduce-scatters by exchange, whose receive buffer
  // (and, stage 1, output) the in-flight bound counts: stage 1's persistent
  // staging would otherwise hold a second bucket-sized buffer per bucket in
  // flight. An all-reduce in place would send twice the bytes.
  bool by_exchange_ = false;
  bool bound_lifted_ = false;        // this round: a bounded host wait ran out
  int64_t bound_lifts_ = 0;
  int64_t peak_staging_bytes_ = 0;  // stage 1: its persistent staging plus the exchanges' buffers
  int64_t persistent_staging_bytes_ = 0;
  // Reductions a broken rank stopped waiting for, kept with their buffers
  // until done: memory is never handed back while a collective may write it.
  struct Dropped {
    c10::intrusive_ptr<c10d::Work> work;
    std::vector<at::Tensor> buffers;
  };
  std::vector<Dropped> dropped_;
  bool host_transfers_pending_ = false;
  // Offload from an accelerator ([Note: offload without a host sync in backward]).
  std::vector<at::Tensor> round_device_sums_;  // this round's reduced results, summed on the device
  std::optional<c10::Stream> host_copy_stream_;
  bool host_copies_on_several_streams_ = false;
  std::optional<c10::Event> host_copies_done_;
  bool host_round_closed_ = false;  // the epilogue recorded host_copies_done_

  std::vector<uint8_t> local_has_grad_;
  std::vector<uint8_t> global_has_grad_;
  SwapSpace* swap_ = nullptr;
  std::vector<at::Tensor> swapped_sums_;       // every folded result since zero_grad, summed (non-finite check)
  std::vector<at::Tensor> segment_stand_ins_;  // the segments' .grad while their bucket is parked
  std::vector<std::vector<int64_t>> segments_of_bucket_;
  void point_segment_grads(int64_t b, bool resident);
};

} // namespace zero_ext
