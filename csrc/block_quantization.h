#pragma once
// Block quantization of the bytes zero_ext puts on the wire (wrap's
// compress_weights / compress_grads; ZeRO++'s qwZ and qgZ).
//
// [Note: quantized payloads]
// A chunk of `numel` values becomes one payload: the blocks' fp32 scales
// first, then the integers (int8: a byte each; int4: two per byte, element
// 2k in the low nibble, stored as q + 8). Block i covers elements
// [i * block, (i + 1) * block); its scale is absmax / qmax (qmax 127 or 7)
// and q = round-half-even(x * (qmax / absmax)), so the largest value of a
// block comes back exactly and every other one within scale / 2. A block
// holding an inf or NaN gets a NaN scale: it dequantizes to NaN, so the
// non-finite check after the reduction still sees it (the fp16 loss scaler
// skips that step), and its residual is dropped rather than carried into
// the next step. Payload sizes are rounded up to 8 bytes so payloads laid
// end to end keep their scales aligned. The CPU kernels are compiled once
// per ISA; other devices run the same arithmetic as ATen ops.

#include <cstdint>

#include <ATen/ATen.h>

namespace zero_ext {

struct QuantFormat {
  int64_t bits = 0;     // 8 or 4; 0: not quantized
  int64_t block = 2048; // elements per scale

  bool enabled() const { return bits > 0; }
  int64_t qmax() const { return bits == 4 ? 7 : 127; }
  int64_t blocks(int64_t numel) const { return (numel + block - 1) / block; }
  int64_t data_bytes(int64_t numel) const { return bits == 4 ? (numel + 1) / 2 : numel; }
  // Bytes of one chunk's payload.
  int64_t payload_bytes(int64_t numel) const { return (4 * blocks(numel) + data_bytes(numel) + 7) / 8 * 8; }
};

// Quantizes `values` (1-D, contiguous, fp32) into `payload` (uint8,
// payload_bytes(numel) of them, on the same device). With `residual`
// defined (fp32, like values), writes values - dequantized there: what the
// next reduction adds back (error feedback).
// `with_ops`: the ATen-op path whatever the device (tests compare it with
// the CPU kernels: it is what CUDA runs).
void quantize_blocks(const at::Tensor& values, const at::Tensor& payload, const QuantFormat& format,
                     const at::Tensor& residual, bool with_ops = false);

// Dequantizes `payload` into `out` (1-D, contiguous, fp32): out = values, or
// out += values with `accumulate`.
void dequantize_blocks(const at::Tensor& payload, const at::Tensor& out, const QuantFormat& format,
                       bool accumulate, bool with_ops = false);

} // namespace zero_ext
