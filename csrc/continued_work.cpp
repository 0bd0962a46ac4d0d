#include "continued_work.h"

namespace zero_ext {

bool ContinuedWork::isCompleted() {
  return continued_->completed();
}

bool ContinuedWork::isSuccess() const {
  return continued_->completed() && !continued_->hasError();
}

std::exception_ptr ContinuedWork::exception() const {
  return continued_->completed() && continued_->hasError() ? continued_->exception_ptr() : nullptr;
}

bool ContinuedWork::wait(std::chrono::milliseconds timeout) {
  collective_->wait(timeout);  // throws on the collective's failure or at the timeout
  continued_->wait();
  if (continued_->hasError()) {
    std::rethrow_exception(continued_->exception_ptr());
  }
  return true;
}

} // namespace zero_ext
