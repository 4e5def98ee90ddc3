/* The LoRA inner loops at the AVX2 level (lora_impl.h; same bits as the baseline). */
#define LORA_SUFFIX avx2
#include "lora_impl.h"
