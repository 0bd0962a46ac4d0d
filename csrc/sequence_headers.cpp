// A sequence check's headers (sequence_headers.h): composed from the
// sequence's decided state, split per rank, rendered for errors, and the
// report that names each rank's header when the ranks are apart.
#include "sequence_headers.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "collective_sequence.h"

namespace zero_ext {

namespace header_words {

std::string label_of(const std::vector<int64_t>& h) {
  char text[kLabelWords * 8 + 1] = {};
  std::memcpy(text, h.data() + kLabel, kLabelWords * 8);
  return std::string(text);
}

void set_label(std::vector<int64_t>& h, const std::string& label) {
  char text[kLabelWords * 8] = {};
  std::memcpy(text, label.data(), std::min<size_t>(label.size(), sizeof(text) - 1));
  std::memcpy(h.data() + kLabel, text, sizeof(text));
}

}  // namespace header_words

using namespace header_words;

std::string round_name(int64_t key) {
  const auto kind = static_cast<RoundKind>(key >> 32);
  const int64_t detail = key & 0xffffffff;
  switch (kind) {
    case RoundKind::kForward: return detail ? "a forward with grad enabled" : "a forward under no_grad";
    case RoundKind::kBackward: return "a backward";
    case RoundKind::kStep: return "optimizer.step()";
    case RoundKind::kZeroGrad: return "zero_grad()";
    case RoundKind::kInspect: return "a gather of full parameters (state_dict, full_params)";
    case RoundKind::kSettle: return "a read of the gradients (clip_grad_norm_, full_grads)";
    case RoundKind::kPython: return "a collective called from Python";
    case RoundKind::kLoad: return "a load";
    case RoundKind::kUnknown: break;
  }
  return "work outside any forward, backward or step";
}

CollectiveSequence::Header CollectiveSequence::header(HeaderType type, int64_t seq) const {
  Header h(kWords, 0);
  h[kType] = type;
  h[kSeq] = seq;
  h[kRoundKey] = key_;
  h[kRoundIndex] = round_index_;
  h[kPlanHash] = static_cast<int64_t>(plan_hash_);
  h[kPlanLength] = static_cast<int64_t>(plan_.size());
  h[kPosition] = static_cast<int64_t>(position_);
  const Progress progress = progress_();
  h[kStep] = progress.step_index;
  h[kSyncedInStep] = progress.synced_in_step;
  return h;
}

std::vector<CollectiveSequence::Header> CollectiveSequence::split(const at::Tensor& all) const {
  const int64_t* words = all.data_ptr<int64_t>();
  std::vector<Header> out;
  for (int64_t r = 0; r < data_.size(); ++r) {
    out.emplace_back(words + r * kWords, words + (r + 1) * kWords);
  }
  return out;
}

std::string CollectiveSequence::render(const Header& h) const {
  std::ostringstream out;
  const std::string round = h[kType] == kSingle ? round_name(h[kRoundKey]) : label_of(h);
  switch (h[kType]) {
    case kSingle: {
      CollectiveId id;
      id.purpose = static_cast<Purpose>(h[kPurpose]);
      id.subject = h[kSubject];
      id.op = static_cast<CollectiveOp>(h[kOp]);
      id.numel = h[kNumel];
      id.dtype = h[kDtype];
      out << "about to issue " << describe_(id, label_of(h)) << " as collective #" << h[kSeq] << ", in " << round;
      break;
    }
    case kRound:
      out << "starting " << round << " at collective #" << h[kSeq];
      break;
    case kAhead:
      out << "started " << round << " at collective #" << h[kSeq]
          << " and went on with the collectives every rank had agreed on";
      break;
    default:
      out << "not in step (header type " << h[kType] << ")";
  }
  out << " (step " << h[kStep] << ", after " << h[kSyncedInStep] << " synced backward(s) in the step)";
  return out.str();
}

void CollectiveSequence::fail_locked(const std::vector<Header>& all) {
  std::ostringstream out;
  out << "zero_ext: the ranks are about to issue different collectives on " << group_description_
      << ", so they took different paths through the model:";
  for (size_t r = 0; r < all.size(); ++r) {
    out << "\n  rank " << r << ": " << render(all[r]);
  }
  // What differs, in the order that explains it best.
  auto differs = [&](int64_t word) {
    return std::any_of(all.begin(), all.end(), [&](const Header& h) { return h[word] != all[0][word]; });
  };
  if (differs(kSubject) || differs(kPurpose)) {
    out << "\nThey are about to exchange different data: each rank ran different modules here.";
    out << data_.advice(out.str());
  } else if (differs(kRoundKey) || differs(kType)) {
    out << "\nThey are in different phases of training (a forward with and without grad, a backward, a step).";
  } else if (differs(kStep)) {
    out << "\nThey are at different optimizer steps: a rank ran more forward or backward passes between two "
           "steps than another.";
  } else if (differs(kSeq)) {
    out << "\nOne rank issued more collectives than another before this point.";
  }
  out << "\nCollectives pair by their order, so issuing these would hand one unit's data to another (or abort "
         "the backend); every rank stops here instead. "
      << divergence_causes();
  fail_locked(out.str());
}

} // namespace zero_ext
