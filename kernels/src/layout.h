/* The packed code layout, shared by pack/unpack, the scalar reference and
 * (implicitly) every SIMD kernel.
 *
 * Rows are padded to 16 and K to 16. The matrix is cut into 16 x 16 tiles,
 * stored row-of-tiles major: tile (i, ks) starts at byte
 * (i * K_pad/16 + ks) * 32 * bits. Inside a tile, the code of row l (0..15)
 * and column kk = 4*s + b sits at:
 *   bits = 2: byte 4*l + b, bits 2s..2s+1   (one 64-byte vector: shifting it
 *             by 2s and masking gives the VNNI4 u8 operand for k-quad s,
 *             16 rows x 4 k, with no shuffle: seed 000's interleaving idea)
 *   bits = 1: bit 64*s + 4*l + b            (qword s is the VNNI4 operand of
 *             k-quad s as a 64-bit byte mask: AVX-512 expands it with one
 *             masked move)
 * Each row of tiles is one contiguous stream over K, so a kernel that works
 * on 16 rows at a time (AVX2) reads sequentially, and one that works on 64
 * rows (AVX-512) reads four sequential streams. */
#ifndef ULB_LAYOUT_H
#define ULB_LAYOUT_H

#include <stdint.h>

#define ULB_TILE 16

static inline int64_t ulb_round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

static inline int64_t ulb_tile_bytes(int bits) { return 32 * (int64_t)bits; }

/* Byte offset and bit shift of code (m, k) inside the code area. */
static inline void ulb_code_pos(int bits, int64_t K_pad, int64_t m, int64_t k,
                                int64_t *byte, int *shift) {
    const int64_t i = m / ULB_TILE, l = m % ULB_TILE;
    const int64_t ks = k / ULB_TILE, kk = k % ULB_TILE;
    const int64_t s = kk / 4, b = kk % 4;
    const int64_t tile = (i * (K_pad / ULB_TILE) + ks) * ulb_tile_bytes(bits);
    if (bits == 2) {
        *byte = tile + 4 * l + b;
        *shift = (int)(2 * s);
    } else {
        const int64_t bit = 64 * s + 4 * l + b;
        *byte = tile + bit / 8;
        *shift = (int)(bit % 8);
    }
}

static inline unsigned ulb_code_get(const uint8_t *codes, int bits, int64_t K_pad,
                                    int64_t m, int64_t k) {
    int64_t byte;
    int shift;
    ulb_code_pos(bits, K_pad, m, k, &byte, &shift);
    return (codes[byte] >> shift) & ((1u << bits) - 1u);
}

#endif
