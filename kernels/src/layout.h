/* The packed code layout, shared by pack/unpack, the scalar reference and
 * (implicitly) every SIMD kernel.
 *
 * A tile is one 64-byte vector holding 16 rows x (32 / bits) columns: byte
 * 4*l + b holds, in field j (bits j*bits .. j*bits + bits - 1), the code of
 * row l and column 4*j + b of the tile. Masking field j in place therefore
 * gives the VNNI4 u8 operand of k-quad j (16 rows x 4 k) scaled by 2^(bits*j),
 * with no shuffle: seed 000's interleaving idea, carried to 1-bit codes too
 * (8 fields of one bit).
 *
 * Rows are padded to 16 and K to the tile width. Rows are grouped in panels
 * of 64 (4 tiles; the last panel may hold fewer), and each panel is one
 * contiguous stream over K: [panel][k-step][tile][64 bytes]. One stream per
 * panel matters: a core reading four interleaved streams loses ~35% of its
 * DRAM bandwidth to the prefetcher on this machine. */
#ifndef ULB_LAYOUT_H
#define ULB_LAYOUT_H

#include <stdint.h>

#define ULB_TILE 16 /* rows per tile */
#define ULB_TILE_BYTES 64
#define ULB_PANEL_TILES 4

static inline int64_t ulb_round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

/* Columns per tile: 16 for 2-bit codes, 32 for 1-bit codes. */
static inline int64_t ulb_tile_k(int bits) { return 32 / bits; }

/* Tiles in panel p (4, or fewer in the last panel). */
static inline int ulb_panel_ntiles(int64_t M_pad, int64_t p) {
    const int64_t left = M_pad / ULB_TILE - p * ULB_PANEL_TILES;
    return left < ULB_PANEL_TILES ? (int)left : ULB_PANEL_TILES;
}

/* Byte offset of panel p inside the code area. */
static inline int64_t ulb_panel_offset(int bits, int64_t K_pad, int64_t p) {
    return p * (K_pad / ulb_tile_k(bits)) * ULB_PANEL_TILES * ULB_TILE_BYTES;
}

/* Byte offset and bit shift of code (m, k) inside the code area. */
static inline void ulb_code_pos(int bits, int64_t M_pad, int64_t K_pad, int64_t m, int64_t k,
                                int64_t *byte, int *shift) {
    const int64_t p = m / (ULB_TILE * ULB_PANEL_TILES);
    const int64_t t = (m / ULB_TILE) % ULB_PANEL_TILES, l = m % ULB_TILE;
    const int64_t ks = k / ulb_tile_k(bits), kk = k % ulb_tile_k(bits);
    const int64_t j = kk / 4, b = kk % 4;
    const int64_t tile = ulb_panel_offset(bits, K_pad, p) +
                         (ks * ulb_panel_ntiles(M_pad, p) + t) * ULB_TILE_BYTES;
    *byte = tile + 4 * l + b;
    *shift = (int)(bits * j);
}

static inline unsigned ulb_code_get(const uint8_t *codes, int bits, int64_t M_pad,
                                    int64_t K_pad, int64_t m, int64_t k) {
    int64_t byte;
    int shift;
    ulb_code_pos(bits, M_pad, K_pad, m, k, &byte, &shift);
    return (codes[byte] >> shift) & ((1u << bits) - 1u);
}

#endif
