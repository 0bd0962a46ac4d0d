// SequencedWork (sequenced_work.h): a collective held back for its headers,
// settled once issued or failed; waiting on it drives its sequence.
#include "sequenced_work.h"

#include <chrono>
#include <exception>
#include <mutex>
#include <string>
#include <utility>

#include "collective_sequence.h"

namespace zero_ext {

void SequencedWork::set_issued(c10::intrusive_ptr<c10d::Work> work) {
  std::lock_guard<std::mutex> lock(mutex_);
  issued_ = std::move(work);
}

void SequencedWork::set_failed(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  error_ = std::move(error);
}

c10::intrusive_ptr<c10d::Work> SequencedWork::issued() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return issued_;
}

bool SequencedWork::settled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return issued_ || error_;
}

bool SequencedWork::isCompleted() {
  if (!settled()) {
    if (auto sequence = sequence_.lock()) sequence->advance();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) return true;
  return issued_ && issued_->isCompleted();
}

bool SequencedWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !error_ && issued_ && issued_->isSuccess();
}

std::exception_ptr SequencedWork::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) return error_;
  return issued_ ? issued_->exception() : nullptr;
}

bool SequencedWork::wait(std::chrono::milliseconds timeout) {
  auto sequence = sequence_.lock();
  c10::intrusive_ptr<c10d::Work> self = c10::intrusive_ptr<c10d::Work>::reclaim_copy(this);
  c10::intrusive_ptr<c10d::Work> work =
      sequence ? sequence->issued_work(self, [] { return std::string("a collective"); }) : issued();
  if (exception()) std::rethrow_exception(exception());
  return work ? work->wait(timeout) : true;
}

void SequencedWork::synchronize() {
  wait();
}

} // namespace zero_ext
