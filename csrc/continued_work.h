#pragma once
// A collective followed by local work on its result: the exchange of
// gloo's reduce-scatter ([Note: gloo's reduce-scatter as an exchange]) and
// the quantized collectives ([Note: quantized collectives]) run a backend
// collective, then a continuation (a sum, a dequantization) on its future.
// The work is done once the continuation is.

#include <chrono>
#include <exception>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace zero_ext {

class ContinuedWork : public c10d::Work {
 public:
  // `collective`: the backend's work; `continued`: its future's then(),
  // which completes once the result is in place, or with the error.
  ContinuedWork(c10::intrusive_ptr<c10d::Work> collective, c10::intrusive_ptr<c10::ivalue::Future> continued,
                c10d::OpType op)
      : c10d::Work(-1, op), collective_(std::move(collective)), continued_(std::move(continued)) {}

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  // A finite timeout bounds the collective (as gloo's own works do: it
  // throws once the time is up); the continuation takes microseconds.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return continued_; }

 private:
  c10::intrusive_ptr<c10d::Work> collective_;
  c10::intrusive_ptr<c10::ivalue::Future> continued_;
};

} // namespace zero_ext
