#pragma once
// Dynamic loss scaling for fp16 training under a plain loss.backward().
//
// fp16 has 5 exponent bits: small activation gradients underflow to zero. The
// gradient entering the model (at its forward outputs) is multiplied by
// `scale()`, which every gradient inside the model then carries; the reduced
// gradient is divided by it again before it reaches the optimizer. A step
// whose gradients overflowed (inf/nan on any rank) is skipped and the scale
// lowered; after `growth_interval` clean steps in a row it is raised.

#include <algorithm>
#include <cstdint>

namespace zero_ext {

struct LossScalerOptions {
  double initial_scale = 65536.0;  // 2^16, as DeepSpeed's initial_scale_power=16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 1000;  // DeepSpeed's loss_scale_window
  double min_scale = 1.0;          // DeepSpeed's min_loss_scale
  int64_t hysteresis = 1;          // overflowing steps tolerated before lowering
  bool dynamic = true;             // false: a static scale, overflowing steps still skipped
};

class LossScaler {
 public:
  LossScaler() = default;
  explicit LossScaler(LossScalerOptions options)
      : options_(options), scale_(options.initial_scale), hysteresis_left_(options.hysteresis) {}

  bool enabled() const { return enabled_; }
  void enable(LossScalerOptions options) { *this = LossScaler(options); enabled_ = true; }
  void disable() { enabled_ = false; scale_ = 1.0; }
  double scale() const { return enabled_ ? scale_ : 1.0; }
  int64_t skipped_steps() const { return skipped_steps_; }
  int64_t clean_steps() const { return clean_steps_; }

  // Once per optimizer step, with whether any rank saw a non-finite gradient.
  void update(bool overflow) {
    if (!enabled_) {
      return;
    }
    if (overflow) {
      ++skipped_steps_;
      clean_steps_ = 0;
      if (options_.dynamic && --hysteresis_left_ <= 0) {
        scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
        hysteresis_left_ = options_.hysteresis;
      }
      return;
    }
    if (options_.dynamic && ++clean_steps_ >= options_.growth_interval) {
      scale_ *= options_.growth_factor;
      clean_steps_ = 0;
      hysteresis_left_ = options_.hysteresis;
    }
  }

  // Checkpoints: the state that must survive a restart.
  void restore(double scale, int64_t clean_steps, int64_t skipped_steps) {
    scale_ = scale;
    clean_steps_ = clean_steps;
    skipped_steps_ = skipped_steps;
    hysteresis_left_ = options_.hysteresis;
  }

 private:
  LossScalerOptions options_;
  bool enabled_ = false;
  double scale_ = 1.0;
  int64_t clean_steps_ = 0;
  int64_t skipped_steps_ = 0;
  int64_t hysteresis_left_ = 1;
};

} // namespace zero_ext
