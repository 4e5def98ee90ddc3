/* The AMX tile configuration (the 64-byte LDTILECFG operand), shared by the int8 and bf16
 * tile kernels. Include only from files built with -mamx-tile. */
#ifndef ELLM_AMX_TILE_H
#define ELLM_AMX_TILE_H
#include <immintrin.h>
#include <stdint.h>

/* MinGW-w64's GCC 12 passes the tile stride of these three as a `long`, 32 bits on
 * Windows, and the assembler refuses a 32-bit index register: the same instructions with
 * a 64-bit stride. */
#if defined(_WIN32) && defined(__GNUC__) && !defined(__clang__)
#undef _tile_loadd_internal
#undef _tile_stream_loadd_internal
#undef _tile_stored_internal
#define ELLM_TILE_ASM_(op, t, base, stride, ...) \
    __asm__ volatile(op : : "r"(base), "r"((int64_t)(stride))__VA_ARGS__)
#define _tile_loadd_internal(t, base, stride) \
    ELLM_TILE_ASM_("{tileloadd\t(%0,%1,1), %%tmm" #t "|tileloadd\t%%tmm" #t ", [%0+%1*1]}", t, (const void *)(base), stride)
#define _tile_stream_loadd_internal(t, base, stride) \
    ELLM_TILE_ASM_("{tileloaddt1\t(%0,%1,1), %%tmm" #t "|tileloaddt1\t%%tmm" #t ", [%0+%1*1]}", t, (const void *)(base), stride)
#define _tile_stored_internal(t, base, stride) \
    ELLM_TILE_ASM_("{tilestored\t%%tmm" #t ", (%0,%1,1)|tilestored\t[%0+%1*1], %%tmm" #t "}", t, (void *)(base), stride, : "memory")
#endif

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;
_Static_assert(sizeof(tile_config) == 64, "the LDTILECFG operand is 64 bytes");

/* GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes, which lets the stores
 * that filled cfg be dropped: spell the instruction out with the whole operand */
static inline void ellm_tile_load_config(const tile_config *cfg) {
    __asm__ volatile("ldtilecfg %0" : : "m"(*cfg));
}

/* The configuration this thread's tiles hold: an id per layout (ELLM_TILE_CFG_*), 0 when
 * released. A kernel loads its layout only where another is held (LDTILECFG costs a few
 * hundred cycles, ~5% of what a 64-token Q4_1 item took), and the matmul driver releases the tiles
 * at the end of each task (ellm_amx_release_tiles), so no thread holds tile state
 * between linear calls. */
extern _Thread_local int ellm_tile_config_held __attribute__((visibility("hidden")));
#define ELLM_TILE_CFG_BF16 1 /* int8 layouts use their K bytes (16, 32) as the id */

#endif
