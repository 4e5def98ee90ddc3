/* NEON integer dot kernels with SDOT (Armv8.2 dotprod; CMake adds +dotprod to this file
 * only, dispatch.c checks HWCAP_ASIMDDP / FEAT_DotProd first): quant_neon.h. */
#if defined(__aarch64__)
#define NEON_SFX _dotprod
#define NEON_SDOT 1
#include "quant_neon.h"
#endif
