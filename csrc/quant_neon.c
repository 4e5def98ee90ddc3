/* NEON integer dot kernels, plain Armv8.0 NEON (the aarch64 baseline): quant_neon.h. */
#if defined(__aarch64__)
#define NEON_SFX
#define NEON_SDOT 0
#include "quant_neon.h"
#endif
