/* The fp8 kernel for x86-64 CPUs with AVX2 and F16C (x86-64-v3). GCC only: its
 * target pragma also defines the instruction-set macros fp8_kernel.c tests; other
 * compilers build the generic variant alone. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx,avx2,f16c,bmi,bmi2,popcnt,lzcnt,movbe")
#if defined(__AVX2__) && defined(__F16C__)
#define LMC_NAME(f) f##_avx2
#include "fp8_kernel.c"
#endif
#endif
