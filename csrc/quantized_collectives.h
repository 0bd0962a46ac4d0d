#pragma once
// Collectives that send block-quantized integers (wrap's compress_weights
// and compress_grads; [Note: quantized payloads] in block_quantization.h).
//
// [Note: quantized collectives]
// A stage 3 gather quantizes this rank's shard into one payload, all-gathers
// the payloads (bytes) and dequantizes every rank's, its own included, into
// the unit's buffer: every rank computes with the same values, and the fp32
// masters and the optimizer never see the rounding (it is taken anew from
// the exact shard at each gather, so it does not add up over steps).
// A gradient reduce-scatter quantizes each rank's chunk of the bucket, sends
// the payloads by all-to-all (over gloo the exchange the plain reduction
// uses, over NCCL the same all-to-all), and sums the received chunks in
// fp32, in rank order, its own chunk exact (it never leaves the rank). With
// error feedback, what a chunk lost to rounding (the residual) is added to
// the next reduction of that bucket before it is quantized: over steps the
// rounding errors cancel instead of adding up, so the model learns as it
// would unquantized (the residual is the size of the bucket, fp32).
// On a hybrid mesh the reduction across replicas (each rank's reduced shard,
// summed over the R replicas) is quantized too where that sends fewer bytes
// than the exact all-reduce's 2 (R - 1) / R x B: each replica quantizes its
// shard (plus its residual) once, the payloads are all-gathered, and every
// replica sums all R dequantized payloads, its own included, in rank order,
// so the replicas keep identical shards. That is (R - 1) payloads sent: with
// int8 fewer bytes up to 7 replicas, with int4 up to 15; more replicas
// all-reduce exact.

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "block_quantization.h"

namespace zero_ext {

// `full_in`: the group's size chunks in rank order; `shard_out` holds the
// sum of this rank's chunk over the ranks once the work completes.
// `residual` (fp32, full_in's size, or undefined: no error feedback) is
// added to full_in first and then holds what this call's rounding lost.
c10::intrusive_ptr<c10d::Work> start_quantized_reduce_scatter(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                              const at::Tensor& shard_out, const at::Tensor& full_in,
                                                              const QuantFormat& format, const at::Tensor& residual);

// `tensor` (1-D, contiguous) holds the sum over the ranks of their
// quantized `tensor` (plus `residual`, which then holds what rounding lost),
// the same on every rank, once the work completes.
c10::intrusive_ptr<c10d::Work> start_quantized_all_reduce(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                          const at::Tensor& tensor, const QuantFormat& format,
                                                          const at::Tensor& residual);

// `full_out` holds every rank's `shard_in`, each quantized and dequantized,
// once the work completes.
c10::intrusive_ptr<c10d::Work> start_quantized_all_gather(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                          const at::Tensor& full_out, const at::Tensor& shard_in,
                                                          const QuantFormat& format);

} // namespace zero_ext
