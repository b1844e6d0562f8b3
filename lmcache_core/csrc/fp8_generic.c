/* The fp8 kernel for any CPU: the instruction set the compiler targets by default
 * (on x86-64 the baseline SSE2; on aarch64 NEON). */
#define LMC_NAME(f) f##_generic
#include "fp8_kernel.c"
