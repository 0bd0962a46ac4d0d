#pragma once
// Adam / AdamW step on CPU for optimizer offload, one fused pass per tensor:
// reads param, grad, exp_avg, exp_avg_sq (and max_exp_avg_sq), writes them
// back and, when given, a bf16/fp16 copy of the updated parameter, so the
// step moves each byte once. Same arithmetic as torch.optim.Adam/AdamW
// (single-tensor path), parallel over chunks, vectorized per ISA at run time.

#include <optional>
#include <string>

#include <ATen/ATen.h>

namespace zero_ext {

void adam_step_(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
                const std::optional<at::Tensor>& param_lowp, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, bool decoupled_weight_decay,
                bool amsgrad, bool maximize);

// Which copy of the kernel this CPU runs (GCC's ISA clones pick at load
// time), for the environment report.
std::string cpu_adam_isa();

} // namespace zero_ext
