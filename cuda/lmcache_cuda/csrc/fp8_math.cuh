// The fp8 codec's arithmetic for the GPU, bit for bit the one of lmcache_core's CPU
// codec (lmcache_core/fp8.py documents the format, lmcache_core/csrc/fp8_kernel.c
// computes it on CPUs): one bfloat16 scale per 64 values, float8 e4m3fn codes.
//
// Torch-free and CUDA-free: every function is __host__ __device__, so
// cuda/native_tests/fp8_math_check.cpp compiles this header with a plain C++ compiler
// and tests/cuda/test_native_fp8_math.py compares its frames and values with the CPU
// codec's on any machine. Float steps go through mul_rn/add_rn/div_rn: IEEE, rounded
// to nearest, never contracted into a fused multiply-add (on the GPU the __f*_rn
// intrinsics, which nvcc never fuses; on the host plain operators, built with
// -ffp-contract=off). Subnormals are kept (no -ftz, no fast math): the CPU codec keeps
// them.
#pragma once

#include <cstdint>
#include <cstring>

#ifndef LMC_HD
#if defined(__CUDACC__)
#define LMC_HD __host__ __device__ __forceinline__
#else
#define LMC_HD inline
#endif
#endif

namespace lmcache_cuda {
namespace fp8 {

constexpr int kGroup = 64;  // values per scale
// dtype codes, as lmcache_core's fused kernel numbers them
constexpr int kFloat16 = 0;
constexpr int kBFloat16 = 1;
constexpr int kFloat32 = 2;
// what a check finds wrong (bits of the status word)
constexpr int kBadScale = 1;   // a scale negative, not finite or over the dtype's limit
constexpr int kNanCode = 2;    // a float8 NaN code (the encoder never writes one)
constexpr int kNotFinite = 4;  // NaN or infinite KV to encode

LMC_HD float from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

LMC_HD uint32_t to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

LMC_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

LMC_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

LMC_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// bfloat16 <- float32, round to nearest even (finite inputs)
LMC_HD uint16_t bf16_rne(float f) {
  const uint32_t u = to_bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// float16 <- float32, round to nearest even, in integer steps (the same on host and
// GPU). Inputs here are finite and below 65520 (the scale limit keeps decoded values
// there); larger magnitudes become infinity, as IEEE rounding would.
LMC_HD uint16_t f16_rne(float f) {
  const uint32_t u = to_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to infinity
  if (a < 0x38800000u) {
    // below 2**-14 (float16's smallest normal): adding 0.5 leaves float32 a spacing of
    // 2**-24 (float16's subnormal step), so the FPU rounds to it
    return static_cast<uint16_t>(sign | (to_bits(add_rn(from_bits(a), 0.5f)) - 0x3F000000u));
  }
  // normal: rebias the exponent (127 -> 15) and round the mantissa to 10 bits
  const uint32_t r = a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

// float8 e4m3fn <- float32, clamped to +-448, round to nearest even
LMC_HD uint8_t e4m3_rne(float f) {
  const int32_t u = static_cast<int32_t>(to_bits(f));
  const int32_t sign = (u >> 24) & 0x80;
  int32_t a = u & 0x7FFFFFFF;
  a = a < 0x43E00000 ? a : 0x43E00000;  // 448.0f
  if (a < (121 << 23)) {
    // below 2**-6 (float8's smallest normal): adding 2**14 leaves float32 a spacing of
    // 2**-9 (float8's subnormal step)
    const int32_t sub = static_cast<int32_t>(to_bits(add_rn(from_bits(static_cast<uint32_t>(a)), 16384.0f))) - (141 << 23);
    return static_cast<uint8_t>(sub | sign);
  }
  // normal: rebias the exponent (127 -> 7) and round the mantissa to 3 bits
  const int32_t nor =
      (a + static_cast<int32_t>((static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu) + ((a >> 20) & 1)) >> 20;
  return static_cast<uint8_t>(nor | sign);
}

// one value of dtype (its bits, widened) as float32: exact
LMC_HD float load_value(const void* base, int64_t i, int dtype) {
  if (dtype == kFloat32) return static_cast<const float*>(base)[i];
  const uint16_t b = static_cast<const uint16_t*>(base)[i];
  if (dtype == kBFloat16) return from_bits(static_cast<uint32_t>(b) << 16);
  // float16 -> float32, exact, in integer steps
  const uint32_t sign = static_cast<uint32_t>(b & 0x8000u) << 16;
  const uint32_t e = (b >> 10) & 0x1Fu, m = b & 0x3FFu;
  if (e == 0x1Fu) return from_bits(sign | 0x7F800000u | (m << 13));  // inf / NaN
  if (e != 0) return from_bits(sign | ((e + 112u) << 23) | (m << 13));
  // subnormal: m * 2**-24, exact in float32
  const float v = mul_rn(static_cast<float>(m), 5.9604644775390625e-8f);
  return sign ? -v : v;
}

// float32 -> one value of dtype at base[i] (round to nearest even)
LMC_HD void store_value(void* base, int64_t i, int dtype, float v) {
  if (dtype == kFloat32) {
    static_cast<float*>(base)[i] = v;
  } else {
    static_cast<uint16_t*>(base)[i] = dtype == kBFloat16 ? bf16_rne(v) : f16_rne(v);
  }
}

// The scale of a group whose largest magnitude has the bits `top` (a float32 of sign
// 0; above 0x7F7FFFFF it is NaN or infinite, which the caller refuses first), as
// bfloat16 bits: top * inv_max_up, clamped to [min_scale, limit], rounded.
LMC_HD uint16_t scale_bits(uint32_t top, float inv_max_up, float min_scale, float limit) {
  float s = mul_rn(from_bits(top), inv_max_up);
  s = s < min_scale ? min_scale : s;
  s = s > limit ? limit : s;
  return bf16_rne(s);
}

// the multiplier that turns a group's values into float8 units: 1 / scale
LMC_HD float scale_reciprocal(uint16_t sb) { return div_rn(1.0f, from_bits(static_cast<uint32_t>(sb) << 16)); }

// the code of one value, given its group's reciprocal scale
LMC_HD uint8_t encode_value(float v, float r) { return e4m3_rne(mul_rn(v, r)); }

// A scale's bits read from a payload are usable: finite, non-negative, at most limit
LMC_HD bool scale_ok(uint16_t sb, float limit) {
  const float s = from_bits(static_cast<uint32_t>(sb) << 16);
  return s >= 0.0f && s <= limit;  // false for NaN
}

// A code is usable: not one of float8 e4m3fn's NaN codes (0x7F, 0xFF)
LMC_HD bool code_ok(uint8_t c) { return (c & 0x7Fu) != 0x7Fu; }

// The value of a code under its group's scale, as float32 (exact): the code's bits
// moved into a float32 read 2**-120 of its value, times 2**120, times the scale.
LMC_HD float decode_value(uint8_t c, float scale) {
  const uint32_t code = c;
  const float v = mul_rn(from_bits(((code & 0x7Fu) << 20) | ((code & 0x80u) << 24)), 1.329227995784916e+36f);  // 2**120
  return mul_rn(v, scale);
}

}  // namespace fp8
}  // namespace lmcache_cuda
