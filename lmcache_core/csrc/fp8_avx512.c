/* The fp8 kernel for x86-64 CPUs with AVX-512 (x86-64-v4), 512-bit vectors preferred:
 * the encode's quantization is written for them (fp8_kernel.c), 1.6x faster than the
 * compiler's default width. GCC only, as fp8_avx2.c. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx,avx2,f16c,bmi,bmi2,popcnt,lzcnt,movbe,avx512f,avx512bw,avx512vl,avx512dq,avx512cd")
#pragma GCC target("prefer-vector-width=512")
#if defined(__AVX512F__) && defined(__F16C__)
#define LMC_NAME(f) f##_avx512
#include "fp8_kernel.c"
#endif
#endif
