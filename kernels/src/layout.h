/* The packed code layout, shared by pack/unpack, the scalar reference and
 * (implicitly) every SIMD kernel.
 *
 * Rows are padded to 16 and K to 16; the matrix is cut into 16 x 16 tiles.
 * Rows are grouped in panels of 64 (4 tiles; the last panel may hold fewer),
 * and each panel is one contiguous stream over K: [panel][ks][tile t][bytes],
 * in the spirit of seed 000's [M/bm][K/bk]... blocking. One stream per
 * panel matters: a core that reads four interleaved streams loses ~35% of
 * its DRAM bandwidth to the prefetcher on this machine.
 *
 * Inside a tile, the code of row l (0..15) and column kk = 4*s + b sits at:
 *   bits = 2: byte 4*l + b, bits 2s..2s+1   (one 64-byte vector: masking
 *             field s gives the VNNI4 u8 operand of k-quad s, 16 rows x 4 k,
 *             with no shuffle: seed 000's interleaving idea)
 *   bits = 1: bit 64*s + 4*l + b            (qword s is the VNNI4 operand of
 *             k-quad s as a 64-bit byte mask: AVX-512 expands it with one
 *             masked move) */
#ifndef ULB_LAYOUT_H
#define ULB_LAYOUT_H

#include <stdint.h>

#define ULB_TILE 16

static inline int64_t ulb_round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

static inline int64_t ulb_tile_bytes(int bits) { return 32 * (int64_t)bits; }

#define ULB_PANEL_TILES 4

/* Tiles in panel p (4, or fewer in the last panel). */
static inline int ulb_panel_ntiles(int64_t M_pad, int64_t p) {
    const int64_t left = M_pad / ULB_TILE - p * ULB_PANEL_TILES;
    return left < ULB_PANEL_TILES ? (int)left : ULB_PANEL_TILES;
}

/* Byte offset of panel p inside the code area. */
static inline int64_t ulb_panel_offset(int bits, int64_t K_pad, int64_t p) {
    return p * (K_pad / ULB_TILE) * ULB_PANEL_TILES * ulb_tile_bytes(bits);
}

/* Byte offset and bit shift of code (m, k) inside the code area. */
static inline void ulb_code_pos(int bits, int64_t M_pad, int64_t K_pad, int64_t m, int64_t k,
                                int64_t *byte, int *shift) {
    const int64_t p = m / (ULB_TILE * ULB_PANEL_TILES);
    const int64_t t = (m / ULB_TILE) % ULB_PANEL_TILES, l = m % ULB_TILE;
    const int64_t ks = k / ULB_TILE, kk = k % ULB_TILE;
    const int64_t s = kk / 4, b = kk % 4;
    const int64_t tile = ulb_panel_offset(bits, K_pad, p) +
                         (ks * ulb_panel_ntiles(M_pad, p) + t) * ulb_tile_bytes(bits);
    if (bits == 2) {
        *byte = tile + 4 * l + b;
        *shift = (int)(2 * s);
    } else {
        const int64_t bit = 64 * s + 4 * l + b;
        *byte = tile + bit / 8;
        *shift = (int)(bit % 8);
    }
}

static inline unsigned ulb_code_get(const uint8_t *codes, int bits, int64_t M_pad,
                                    int64_t K_pad, int64_t m, int64_t k) {
    int64_t byte;
    int shift;
    ulb_code_pos(bits, M_pad, K_pad, m, k, &byte, &shift);
    return (codes[byte] >> shift) & ((1u << bits) - 1u);
}

#endif
