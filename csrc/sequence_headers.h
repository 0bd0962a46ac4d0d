#pragma once
// The header a sequence check exchanges ([Note: collectives that prove what
// they are] in collective_sequence.h): its words, and the names a round and
// a header's label take in errors. CollectiveSequence composes, splits and
// renders headers with these (sequence_headers.cpp).

#include <cstdint>
#include <string>
#include <vector>

namespace zero_ext {

namespace header_words {

// A header's words. The first kAlignedWords must be equal on every rank for
// the ranks to be in step; the prediction words (AHEAD) need not be.
enum Word : int64_t {
  kType = 0,
  kSeq,          // the data group's collectives decided before this point
  kRoundKey,
  kRoundIndex,
  kPlanHash,
  kPlanLength,
  kPosition,     // collectives decided in the round so far
  kPurpose,      // SINGLE: the collective
  kSubject,
  kOp,
  kNumel,
  kDtype,
  kStep,
  kAlignedWords,
  kNextKey = kAlignedWords,  // AHEAD: the next round as this rank predicts it
  kNextPlanHash,
  kNextPlanLength,
  kSyncedInStep,  // for messages only: it may differ between ranks in step
  kLabel,         // text for error messages (kLabelWords words)
};
constexpr int64_t kLabelWords = 12;
constexpr int64_t kWords = kLabel + kLabelWords;

// The label words as text, and text into them (cut to fit).
std::string label_of(const std::vector<int64_t>& h);
void set_label(std::vector<int64_t>& h, const std::string& label);

}  // namespace header_words

// A round key (round_key in collective_sequence.h) in words: "a backward".
std::string round_name(int64_t key);

} // namespace zero_ext
