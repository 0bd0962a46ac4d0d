#include "cpu_adam.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace zero_ext {
namespace {

struct AdamScalars {
  float lr, beta1, beta2, eps, weight_decay;
  float one_minus_beta1, one_minus_beta2;  // rounded from double, as torch does
  float step_size;             // lr / (1 - beta1^t)
  float bias_correction2_sqrt; // sqrt(1 - beta2^t)
  float decay_factor;          // AdamW: 1 - lr * wd
  bool decoupled, amsgrad, maximize;
};

// GCC compiles one copy per ISA and picks at load time; the loop body is
// plain arithmetic over restrict pointers so each copy vectorizes fully
// (-fno-math-errno lets sqrt vectorize).
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define ZERO_EXT_ISA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ZERO_EXT_ISA_CLONES
#endif

inline uint16_t bfloat16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;  // nearest even
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return nan ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

// One loop per combination of options, each compiled once per ISA: the
// options are template parameters so every loop is branch-free and
// vectorizes fully (runtime branches kept GCC from vectorizing some).
template <bool kL2, bool kDecay, bool kAmsgrad, bool kBfloat16Copy>
ZERO_EXT_ISA_CLONES void adam_kernel(float* __restrict p, const float* __restrict g,
                                     float* __restrict m, float* __restrict v,
                                     float* __restrict vmax, uint16_t* __restrict bf16_out,
                                     int64_t n, AdamScalars s) {
  const float one_minus_beta1 = s.one_minus_beta1;
  const float one_minus_beta2 = s.one_minus_beta2;
  const float grad_sign = s.maximize ? -1.0f : 1.0f;
  const float inv_bias_correction2_sqrt = 1.0f / s.bias_correction2_sqrt;
  for (int64_t i = 0; i < n; ++i) {
    float grad = grad_sign * g[i];
    float param = p[i];
    // As torch: the weight decay terms exist only when weight_decay != 0.
    if (kL2) grad = grad + s.weight_decay * param;  // Adam: L2 into the gradient
    if (kDecay) param = param * s.decay_factor;    // AdamW: decoupled decay
    const float mi = m[i] + one_minus_beta1 * (grad - m[i]);  // exp_avg.lerp_(grad, 1 - beta1)
    const float vi = s.beta2 * v[i] + one_minus_beta2 * grad * grad;
    m[i] = mi;
    v[i] = vi;
    float second = vi;
    if (kAmsgrad) {
      second = vmax[i] > vi ? vmax[i] : vi;
      vmax[i] = second;
    }
    // One division per element: torch divides by sqrt(1 - beta2^t) too; the
    // product with its reciprocal differs by at most an ulp.
    const float denom = std::sqrt(second) * inv_bias_correction2_sqrt + s.eps;
    const float updated = param - s.step_size * (mi / denom);
    p[i] = updated;
    if (kBfloat16Copy) bf16_out[i] = bfloat16_bits(updated);  // the compute copy, same pass
  }
}

using AdamKernel = void (*)(float*, const float*, float*, float*, float*, uint16_t*, int64_t,
                            AdamScalars);

template <bool kL2, bool kDecay>
AdamKernel pick_kernel(bool amsgrad, bool bf16) {
  if (amsgrad) {
    return bf16 ? &adam_kernel<kL2, kDecay, true, true> : &adam_kernel<kL2, kDecay, true, false>;
  }
  return bf16 ? &adam_kernel<kL2, kDecay, false, true> : &adam_kernel<kL2, kDecay, false, false>;
}

AdamKernel pick_kernel(const AdamScalars& s, bool bf16) {
  const bool l2 = !s.decoupled && s.weight_decay != 0.0f;
  const bool decay = s.decoupled && s.weight_decay != 0.0f;
  if (l2) return pick_kernel<true, false>(s.amsgrad, bf16);
  if (decay) return pick_kernel<false, true>(s.amsgrad, bf16);
  return pick_kernel<false, false>(s.amsgrad, bf16);
}

void to_half(const float* src, c10::Half* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = c10::Half(src[i]);
  }
}

void check_operand(const at::Tensor& t, const at::Tensor& param, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "zero_ext.adam_step_: ", name, " must be a contiguous float32 CPU tensor");
  TORCH_CHECK(t.numel() == param.numel(), "zero_ext.adam_step_: ", name, " has ", t.numel(),
              " elements, param has ", param.numel());
}

} // namespace

void adam_step_(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
                const std::optional<at::Tensor>& param_lowp, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, bool decoupled_weight_decay,
                bool amsgrad, bool maximize) {
  check_operand(param, param, "param");
  check_operand(grad, param, "grad");
  check_operand(exp_avg, param, "exp_avg");
  check_operand(exp_avg_sq, param, "exp_avg_sq");
  TORCH_CHECK(step >= 1, "zero_ext.adam_step_: step counts from 1, got ", step);
  TORCH_CHECK(!amsgrad || max_exp_avg_sq.has_value(),
              "zero_ext.adam_step_: amsgrad=True needs max_exp_avg_sq");
  if (amsgrad) {
    check_operand(*max_exp_avg_sq, param, "max_exp_avg_sq");
  }
  if (param_lowp.has_value()) {
    const auto dtype = param_lowp->scalar_type();
    TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kHalf) && param_lowp->is_contiguous() &&
                    param_lowp->device().is_cpu() && param_lowp->numel() == param.numel(),
                "zero_ext.adam_step_: param_lowp must be a contiguous bf16/fp16 CPU tensor "
                "shaped like param");
  }
  AdamScalars s;
  s.lr = static_cast<float>(lr);
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.eps = static_cast<float>(eps);
  s.weight_decay = static_cast<float>(weight_decay);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  // Bias corrections in double, as torch computes them from Python floats.
  s.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  s.bias_correction2_sqrt =
      static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  s.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  s.decoupled = decoupled_weight_decay;
  s.amsgrad = amsgrad;
  s.maximize = maximize;

  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  float* vmax = amsgrad ? max_exp_avg_sq->data_ptr<float>() : nullptr;
  const at::ScalarType lowp = param_lowp.has_value() ? param_lowp->scalar_type() : at::kFloat;
  void* out = param_lowp.has_value() ? param_lowp->data_ptr() : nullptr;

  const AdamKernel kernel = pick_kernel(s, lowp == at::kBFloat16);
  // Chunks whose updated params (256 KiB) stay in L2 for an fp16 copy pass.
  constexpr int64_t kChunk = 1 << 16;
  at::parallel_for(0, param.numel(), kChunk, [&](int64_t begin, int64_t end) {
    for (int64_t lo = begin; lo < end; lo += kChunk) {
      const int64_t n = std::min(kChunk, end - lo);
      kernel(p + lo, g + lo, m + lo, v + lo, vmax ? vmax + lo : nullptr,
             lowp == at::kBFloat16 ? static_cast<uint16_t*>(out) + lo : nullptr, n, s);
      if (lowp == at::kHalf) {
        to_half(p + lo, static_cast<c10::Half*>(out) + lo, n);
      }
    }
  });
}

std::string cpu_adam_isa() {
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
  __builtin_cpu_init();  // the same test the clones' resolver makes
  if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4 (AVX-512)";
  if (__builtin_cpu_supports("x86-64-v3")) return "x86-64-v3 (AVX2, FMA)";
  return "x86-64 baseline (SSE2)";
#else
  return "one copy, the compiler's default target (no ISA clones off GCC on x86-64)";
#endif
}

} // namespace zero_ext
