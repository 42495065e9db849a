// kernels_dotprod_neon.c — kernels_neon.c's int8 dot-product kernels with SDOT (ARMv8.2 dot
// product), compiled with -march=armv8.2-a+dotprod (aarch64 builds only; dispatch.c runs them
// where the CPU has it).

#define LS_NEON_DOTPROD 1
#include "kernels_neon.c"
