#include "block_quantization.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <ATen/Parallel.h>

namespace zero_ext {
namespace {

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define ZERO_EXT_QUANT_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ZERO_EXT_QUANT_CLONES
#endif

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;

// The largest |x| of a block as its float bits: an integer max, which
// vectorizes where a float max reduction would not, and sorts inf and NaN
// above every finite value.
ZERO_EXT_QUANT_CLONES uint32_t abs_max_bits(const float* __restrict x, int64_t n) {
  uint32_t most = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    bits &= kAbsMask;
    most = bits > most ? bits : most;
  }
  return most;
}

template <bool kResidual>
ZERO_EXT_QUANT_CLONES void quantize_int8(const float* __restrict x, int8_t* __restrict q, float* __restrict residual,
                                         int64_t n, float inv, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::min(std::max(std::nearbyint(x[i] * inv), -127.0f), 127.0f);
    q[i] = static_cast<int8_t>(v);
    if (kResidual) residual[i] = x[i] - v * scale;
  }
}

// n even: element pairs (2k, 2k + 1) in byte k.
template <bool kResidual>
ZERO_EXT_QUANT_CLONES void quantize_int4(const float* __restrict x, uint8_t* __restrict q, float* __restrict residual,
                                         int64_t n, float inv, float scale) {
  for (int64_t k = 0; k < n / 2; ++k) {
    const float lo = std::min(std::max(std::nearbyint(x[2 * k] * inv), -7.0f), 7.0f);
    const float hi = std::min(std::max(std::nearbyint(x[2 * k + 1] * inv), -7.0f), 7.0f);
    q[k] = static_cast<uint8_t>((static_cast<int>(lo) + 8) | ((static_cast<int>(hi) + 8) << 4));
    if (kResidual) {
      residual[2 * k] = x[2 * k] - lo * scale;
      residual[2 * k + 1] = x[2 * k + 1] - hi * scale;
    }
  }
}

template <bool kAccumulate>
ZERO_EXT_QUANT_CLONES void dequantize_int8(const int8_t* __restrict q, float* __restrict out, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(q[i]) * scale;
    out[i] = kAccumulate ? out[i] + v : v;
  }
}

template <bool kAccumulate>
ZERO_EXT_QUANT_CLONES void dequantize_int4(const uint8_t* __restrict q, float* __restrict out, int64_t n,
                                           float scale) {
  for (int64_t k = 0; k < n / 2; ++k) {
    const float lo = static_cast<float>(static_cast<int>(q[k] & 15u) - 8) * scale;
    const float hi = static_cast<float>(static_cast<int>(q[k] >> 4) - 8) * scale;
    out[2 * k] = kAccumulate ? out[2 * k] + lo : lo;
    out[2 * k + 1] = kAccumulate ? out[2 * k + 1] + hi : hi;
  }
}

// One block on the CPU: its scale into scales[0], its integers at `data`.
void quantize_block_cpu(const float* x, int64_t n, const QuantFormat& format, float* scales, uint8_t* data,
                        float* residual) {
  const uint32_t most = abs_max_bits(x, n);
  const float qmax = static_cast<float>(format.qmax());
  float absmax;
  std::memcpy(&absmax, &most, sizeof(absmax));
  const bool finite = most < kInfBits;
  const float inv = finite ? qmax / absmax : 0.0f;
  const bool representable = finite && std::isfinite(inv);  // not all zero, not all below qmax * FLT_MIN
  if (!representable) {
    // All zero or too small to scale: zeros, the values carried in the
    // residual; not finite: a NaN scale, the residual dropped.
    scales[0] = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    std::memset(data, format.bits == 4 ? 0x88 : 0, static_cast<size_t>(format.data_bytes(n)));
    if (residual) {
      if (finite) {
        std::memcpy(residual, x, static_cast<size_t>(n) * sizeof(float));
      } else {
        std::memset(residual, 0, static_cast<size_t>(n) * sizeof(float));
      }
    }
    return;
  }
  const float scale = absmax / qmax;
  scales[0] = scale;
  if (format.bits == 8) {
    auto* q = reinterpret_cast<int8_t*>(data);
    residual ? quantize_int8<true>(x, q, residual, n, inv, scale) : quantize_int8<false>(x, q, nullptr, n, inv, scale);
    return;
  }
  const int64_t even = n / 2 * 2;
  residual ? quantize_int4<true>(x, data, residual, even, inv, scale)
           : quantize_int4<false>(x, data, nullptr, even, inv, scale);
  if (even < n) {  // the last odd element: low nibble, high nibble zero
    const float v = std::min(std::max(std::nearbyint(x[even] * inv), -7.0f), 7.0f);
    data[even / 2] = static_cast<uint8_t>((static_cast<int>(v) + 8) | (8 << 4));
    if (residual) residual[even] = x[even] - v * scale;
  }
}

void dequantize_block_cpu(const uint8_t* data, int64_t n, const QuantFormat& format, float scale, float* out,
                          bool accumulate) {
  if (format.bits == 8) {
    auto* q = reinterpret_cast<const int8_t*>(data);
    accumulate ? dequantize_int8<true>(q, out, n, scale) : dequantize_int8<false>(q, out, n, scale);
    return;
  }
  const int64_t even = n / 2 * 2;
  accumulate ? dequantize_int4<true>(data, out, even, scale) : dequantize_int4<false>(data, out, even, scale);
  if (even < n) {
    const float v = static_cast<float>(static_cast<int>(data[even / 2] & 15u) - 8) * scale;
    out[even] = accumulate ? out[even] + v : v;
  }
}

// Blocks per parallel task: ~64K elements.
int64_t grain_blocks(const QuantFormat& format) { return std::max<int64_t>(1, 65536 / format.block); }

void check_args(const at::Tensor& values, const at::Tensor& payload, const QuantFormat& format) {
  TORCH_CHECK(format.bits == 8 || format.bits == 4, "zero_ext internal: quantization to ", format.bits, " bits");
  TORCH_CHECK(format.block > 0 && format.block % 2 == 0, "zero_ext internal: quantization block ", format.block,
              " is not even");
  TORCH_CHECK(values.dim() == 1 && values.is_contiguous() && values.scalar_type() == at::kFloat,
              "zero_ext internal: quantized values must be 1-D contiguous fp32");
  TORCH_CHECK(payload.dim() == 1 && payload.is_contiguous() && payload.scalar_type() == at::kByte &&
                  payload.numel() == format.payload_bytes(values.numel()) && payload.device() == values.device(),
              "zero_ext internal: a payload of ", payload.numel(), " bytes for ", values.numel(), " values");
}

// The same arithmetic as ATen ops, for devices without the CPU kernels.
void quantize_with_ops(const at::Tensor& values, const at::Tensor& payload, const QuantFormat& format,
                       const at::Tensor& residual) {
  const int64_t n = values.numel(), blocks = format.blocks(n), padded = blocks * format.block;
  const double qmax = static_cast<double>(format.qmax());
  at::Tensor x = (padded > n ? at::constant_pad_nd(values, {0, padded - n}, 0) : values).view({blocks, format.block});
  at::Tensor absmax = x.abs().amax(1);
  at::Tensor finite = absmax.isfinite();
  at::Tensor inv = at::where(finite, at::full({}, qmax, absmax.options()) / absmax, at::zeros({}, absmax.options()));
  at::Tensor representable = finite & inv.isfinite();
  inv = at::where(representable, inv, at::zeros({}, inv.options()));
  // Divided by a tensor, not a double: CUDA turns division by a host scalar
  // into a multiplication by its reciprocal, a scale one bit off the CPU's.
  at::Tensor scale =
      at::where(representable, absmax / at::full({}, qmax, absmax.options()), at::zeros({}, absmax.options()));
  scale = at::where(finite, scale, at::full({}, std::numeric_limits<float>::quiet_NaN(), scale.options()));
  // Zeros where the block is not representable (an inf times 0 would be NaN).
  at::Tensor q = at::where(representable.unsqueeze(1), (x * inv.unsqueeze(1)).round().clamp(-qmax, qmax),
                           at::zeros({}, x.options()));
  if (residual.defined()) {
    at::Tensor r = at::where(finite.unsqueeze(1), x - q * scale.unsqueeze(1), at::zeros({}, x.options()));
    residual.copy_(r.view(-1).narrow(0, 0, n));
  }
  payload.narrow(0, 0, 4 * blocks).view(at::kFloat).copy_(scale);
  at::Tensor flat = q.view(-1).narrow(0, 0, n);
  const int64_t data = format.data_bytes(n);
  if (format.bits == 8) {
    payload.narrow(0, 4 * blocks, data).copy_(flat.to(at::kChar).view(at::kByte));
  } else {
    at::Tensor offset = (flat + 8).to(at::kByte);
    if (n % 2) {
      offset = at::cat({offset, at::full({1}, 8, offset.options())});
    }
    at::Tensor pairs = offset.view({-1, 2});
    payload.narrow(0, 4 * blocks, data).copy_(pairs.select(1, 0).bitwise_or(pairs.select(1, 1).bitwise_left_shift(4)));
  }
  const int64_t used = 4 * blocks + data;
  if (payload.numel() > used) {
    payload.narrow(0, used, payload.numel() - used).zero_();
  }
}

void dequantize_with_ops(const at::Tensor& payload, const at::Tensor& out, const QuantFormat& format,
                         bool accumulate) {
  const int64_t n = out.numel(), blocks = format.blocks(n), padded = blocks * format.block;
  at::Tensor scale = payload.narrow(0, 0, 4 * blocks).view(at::kFloat);
  at::Tensor bytes = payload.narrow(0, 4 * blocks, format.data_bytes(n));
  at::Tensor q;
  if (format.bits == 8) {
    q = bytes.view(at::kChar).to(at::kFloat);
  } else {
    at::Tensor lo = bytes.bitwise_and(15).to(at::kFloat) - 8;
    at::Tensor hi = bytes.bitwise_right_shift(4).to(at::kFloat) - 8;
    q = at::stack({lo, hi}, 1).view(-1).narrow(0, 0, n);
  }
  if (padded > n) {
    q = at::constant_pad_nd(q, {0, padded - n}, 0);
  }
  at::Tensor v = (q.view({blocks, format.block}) * scale.unsqueeze(1)).view(-1).narrow(0, 0, n);
  accumulate ? out.add_(v) : out.copy_(v);
}

} // namespace

void quantize_blocks(const at::Tensor& values, const at::Tensor& payload, const QuantFormat& format,
                     const at::Tensor& residual, bool with_ops) {
  check_args(values, payload, format);
  TORCH_CHECK(!residual.defined() || (residual.is_contiguous() && residual.scalar_type() == at::kFloat &&
                                      residual.numel() == values.numel() && residual.device() == values.device()),
              "zero_ext internal: the residual must be contiguous fp32 like the values, on their device");
  if (!values.is_cpu() || with_ops) {
    quantize_with_ops(values, payload, format, residual);
    return;
  }
  const int64_t n = values.numel(), blocks = format.blocks(n);
  const float* x = values.const_data_ptr<float>();
  uint8_t* out = payload.mutable_data_ptr<uint8_t>();
  auto* scales = reinterpret_cast<float*>(out);
  uint8_t* data = out + 4 * blocks;
  float* r = residual.defined() ? residual.mutable_data_ptr<float>() : nullptr;
  at::parallel_for(0, blocks, grain_blocks(format), [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t start = b * format.block, len = std::min(format.block, n - start);
      quantize_block_cpu(x + start, len, format, scales + b, data + format.data_bytes(start), r ? r + start : nullptr);
    }
  });
  const int64_t used = 4 * blocks + format.data_bytes(n);
  std::memset(out + used, 0, static_cast<size_t>(payload.numel() - used));
}

void dequantize_blocks(const at::Tensor& payload, const at::Tensor& out, const QuantFormat& format,
                       bool accumulate, bool with_ops) {
  check_args(out, payload, format);
  if (!out.is_cpu() || with_ops) {
    dequantize_with_ops(payload, out, format, accumulate);
    return;
  }
  const int64_t n = out.numel(), blocks = format.blocks(n);
  const uint8_t* in = payload.const_data_ptr<uint8_t>();
  const auto* scales = reinterpret_cast<const float*>(in);
  const uint8_t* data = in + 4 * blocks;
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, blocks, grain_blocks(format), [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t start = b * format.block, len = std::min(format.block, n - start);
      dequantize_block_cpu(data + format.data_bytes(start), len, format, scales[b], o + start, accumulate);
    }
  });
}

} // namespace zero_ext
