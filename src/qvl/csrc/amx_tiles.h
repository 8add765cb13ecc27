/* AMX tile configuration shared by the AMX kernels (amx_gemm.c, amx_attention.c). */
#ifndef QVL_AMX_TILES_H
#define QVL_AMX_TILES_H
#include "common.h"

#if defined(QVL_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Every tile register as a full tile, 16 rows x 64 bytes: the many-row kernels (int8, 16-bit
 * planes, bf16 panels) and the vision attention. */
static inline void configure_full_tiles(void) {
    TileConfig cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}
#endif
#endif
