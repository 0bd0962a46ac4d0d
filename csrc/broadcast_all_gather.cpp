#include "broadcast_all_gather.h"

#include <chrono>
#include <exception>
#include <utility>
#include <vector>

namespace zero_ext {
namespace {

// The broadcasts as one work: done when every one is, failed when any failed.
class JoinedWork : public c10d::Work {
 public:
  JoinedWork(std::vector<c10::intrusive_ptr<c10d::Work>> parts, c10::intrusive_ptr<c10::ivalue::Future> all)
      : c10d::Work(-1, c10d::OpType::ALLGATHER), parts_(std::move(parts)), all_(std::move(all)) {}

  bool isCompleted() override { return all_->completed(); }
  bool isSuccess() const override { return all_->completed() && !all_->hasError(); }
  std::exception_ptr exception() const override {
    return all_->completed() && all_->hasError() ? all_->exception_ptr() : nullptr;
  }
  // A finite timeout bounds each broadcast, as gloo's own works do.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    for (auto& part : parts_) part->wait(timeout);  // throws on a failure or at the timeout
    all_->wait();
    if (all_->hasError()) std::rethrow_exception(all_->exception_ptr());
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return all_; }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> parts_;
  c10::intrusive_ptr<c10::ivalue::Future> all_;
};

}  // namespace

c10::intrusive_ptr<c10d::Work> start_broadcast_all_gather(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                          const at::Tensor& full_out, const at::Tensor& shard_in) {
  const int64_t ranks = group->getSize();
  const int64_t rank = group->getRank();
  TORCH_CHECK(full_out.is_contiguous() && full_out.numel() == shard_in.numel() * ranks,
              "zero_ext internal: all-gather by broadcasts needs a contiguous output of one shard per rank");
  const int64_t shard = shard_in.numel();
  at::Tensor mine = full_out.narrow(0, rank * shard, shard);
  if (mine.data_ptr() != shard_in.data_ptr()) {
    mine.copy_(shard_in);  // the root's chunk is what it sends
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> parts;
  c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(c10::FutureType::create(c10::AnyType::get()));
  for (int64_t root = 0; root < ranks; ++root) {
    std::vector<at::Tensor> chunk{full_out.narrow(0, root * shard, shard)};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    parts.push_back(group->broadcast(chunk, opts));
    futures.push_back(parts.back()->getFuture());
  }
  auto all = c10::collectAll(futures)->then(
      [full_out](c10::ivalue::Future& done) -> c10::IValue {
        for (const auto& part : done.value().toList()) {
          const auto& future = part.get().toFuture();
          if (future->hasError()) std::rethrow_exception(future->exception_ptr());
        }
        return c10::IValue(full_out);
      },
      c10::TensorType::get());
  return c10::make_intrusive<JoinedWork>(std::move(parts), std::move(all));
}

} // namespace zero_ext
