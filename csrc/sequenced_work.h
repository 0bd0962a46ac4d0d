#pragma once
// SequencedWork: the c10d::Work a caller holds for a collective that waits
// for its sequence check's headers ([Note: collectives that prove what they
// are] in collective_sequence.h).

#include <chrono>
#include <exception>
#include <memory>
#include <mutex>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace zero_ext {

class CollectiveSequence;

// A collective submitted while its headers are not verified yet: it goes out
// once they are (from whichever thread finds them so), and this work stands
// for it until then. Waiting on it waits for the headers, then for it.
class SequencedWork : public c10d::Work {
 public:
  explicit SequencedWork(std::weak_ptr<CollectiveSequence> sequence) : sequence_(std::move(sequence)) {}
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;

  // Set once, by the thread that issues it (or the failure that prevents it).
  void set_issued(c10::intrusive_ptr<c10d::Work> work);
  void set_failed(std::exception_ptr error);
  c10::intrusive_ptr<c10d::Work> issued() const;
  bool settled() const;  // issued or failed

 private:
  std::weak_ptr<CollectiveSequence> sequence_;
  mutable std::mutex mutex_;
  c10::intrusive_ptr<c10d::Work> issued_;
  std::exception_ptr error_;
};

} // namespace zero_ext
