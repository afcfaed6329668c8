/* The packed layout of codes and scales, shared by pack/unpack, the scalar
 * reference and (through the offsets below) every SIMD kernel.
 *
 * A tile is one 64-byte vector holding 16 rows x (32 / bits) columns: byte
 * 4*l + b holds, in field j (bits j*bits .. j*bits + bits - 1), the code of
 * row l and column 4*j + b of the tile. Masking field j in place therefore
 * gives the VNNI4 u8 operand of k-quad j (16 rows x 4 k) scaled by 2^(bits*j),
 * with no shuffle: seed 000's interleaving idea, carried to 1-bit codes too
 * (8 fields of one bit), to 4-bit codes (two nibbles) and to 8-bit codes
 * (one field, the byte itself).
 *
 * That is the VNNI tile order (ulb_tiles). 1-bit codes may instead take the
 * LANES order: the same bytes placed so that each 128-bit lane holds byte
 * slot b of all 16 rows (ulb_tile_byte) and one 16-entry table lookup serves
 * the lane (x86/lut1_avx2.c); a byte transpose turns it into the VNNI order.
 *
 * The KMAJOR layout (for accelerators, ulb.h) keeps the same padding but
 * places scales and codes by k-step and row instead of by panel; the
 * functions below place every code and scale of any layout.
 *
 * Rows are padded to 16 and K to the tile width. Rows are grouped in panels
 * of 64 (4 tiles; the last panel may hold fewer), and each panel is one
 * contiguous stream over K, group after group; a group is its scales (fp32,
 * one per row of the panel) followed by its codes:
 *   [panel][group][scales: nt x 16 fp32 | codes: k-step][tile][64 bytes]
 * so a kernel reads every byte it needs in address order. One stream per
 * core matters: a core reading several interleaved streams loses DRAM
 * bandwidth to the prefetcher on the Zen 4 of benchmarks/results, and the
 * scales kept apart (blob version 1) slowed a cold GEMV. */
#ifndef ULB_LAYOUT_H
#define ULB_LAYOUT_H

#include <stdint.h>

#include "ulb/ulb.h"
#include "base3.h"

#define ULB_TILE 16 /* rows per tile */
#define ULB_TILE_BYTES 64
#define ULB_TILE_SCALE_BYTES (ULB_TILE * 4) /* the fp32 scales of one tile's rows in one group */
#define ULB_PANEL_TILES 4

static inline int64_t ulb_round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

/* Columns per tile: 32 for 1-bit codes, 16 for 2-bit, 8 for 4-bit, 4 for 8-bit
 * (the format table's tile_k); 20 for base-3 codes, whose byte 4l + b holds
 * digit j = code of row l, column 4j + b (base3.h), like field j of a 2-bit tile. */
#define ULB_TILE_K(bits) ((bits) == ULB_BASE3_BITS ? 4 * ULB_BASE3_DIGITS : 32 / (bits))
static inline int64_t ulb_tile_k(int bits) { return ULB_TILE_K(bits); }

/* Tiles in panel p (4, or fewer in the last panel). */
static inline int ulb_panel_ntiles(int64_t M_pad, int64_t p) {
    const int64_t left = M_pad / ULB_TILE - p * ULB_PANEL_TILES;
    return left < ULB_PANEL_TILES ? (int)left : ULB_PANEL_TILES;
}

/* Bytes of one group of a panel of nt tiles holding gsteps k-steps. */
static inline int64_t ulb_group_bytes(int nt, int64_t gsteps) {
    return nt * (ULB_TILE_SCALE_BYTES + gsteps * ULB_TILE_BYTES);
}

/* Byte offset of panel p in the panel area: every earlier panel is full and
 * holds n_groups scale blocks and ksteps k-steps of 4 tiles. */
static inline int64_t ulb_panel_offset(int64_t ksteps, int64_t n_groups, int64_t p) {
    return p * ULB_PANEL_TILES * (n_groups * ULB_TILE_SCALE_BYTES + ksteps * ULB_TILE_BYTES);
}

/* Byte offset just past panel p - 1, i.e. the end of panels [0, p). */
static inline int64_t ulb_panels_end(int64_t M_pad, int64_t ksteps, int64_t n_groups, int64_t p) {
    return ulb_panel_offset(ksteps, n_groups, p - 1) +
           ulb_panel_ntiles(M_pad, p - 1) * (n_groups * ULB_TILE_SCALE_BYTES + ksteps * ULB_TILE_BYTES);
}

/* Byte offset of group g inside a panel of nt tiles: its scales; its codes
 * follow at + nt * ULB_TILE_SCALE_BYTES. Every earlier group is full. */
static inline int64_t ulb_group_offset(int nt, int64_t gsteps, int64_t g) {
    return g * ulb_group_bytes(nt, gsteps);
}

/* Where (m, k) lives, for a matrix of M_pad rows, ksteps k-steps in groups
 * of gsteps k-steps (n_groups of them). */
typedef struct {
    int bits, tiles; /* tiles: a ulb_tiles */
    int64_t M_pad, ksteps, gsteps, n_groups;
} ulb_layout;

/* Bytes of the KMAJOR scales, [n_groups][M_pad] fp32; the code words follow. */
static inline int64_t ulb_kmajor_scale_bytes(const ulb_layout *L) { return L->n_groups * L->M_pad * 4; }

/* Byte of row l and byte slot b inside a tile of order `tiles`. */
static inline int ulb_tile_byte(int tiles, int l, int b) {
    return tiles == ULB_TILES_LANES ? ULB_TILE * b + l : 4 * l + b;
}


/* Byte offset of the scale of row m, group g, inside the panel area. */
static inline int64_t ulb_scale_pos(const ulb_layout *L, int64_t m, int64_t g) {
    if (L->tiles == ULB_TILES_KMAJOR) return (g * L->M_pad + m) * 4;
    const int64_t p = m / (ULB_TILE * ULB_PANEL_TILES);
    return ulb_panel_offset(L->ksteps, L->n_groups, p) +
           ulb_group_offset(ulb_panel_ntiles(L->M_pad, p), L->gsteps, g) + (m % (ULB_TILE * ULB_PANEL_TILES)) * 4;
}

/* Byte offset and bit shift of code (m, k) inside the panel area; for base-3
 * codes, which are not bit fields, the digit (0..4) instead of the shift. */
static inline void ulb_code_pos(const ulb_layout *L, int64_t m, int64_t k, int64_t *byte, int *shift) {
    if (L->tiles == ULB_TILES_KMAJOR) { /* field j = k % tile_k of word (k / tile_k, m), little-endian */
        const int64_t bit = (k % ulb_tile_k(L->bits)) * L->bits;
        *byte = ulb_kmajor_scale_bytes(L) + ((k / ulb_tile_k(L->bits)) * L->M_pad + m) * 4 + bit / 8;
        *shift = (int)(bit % 8);
        return;
    }
    const int64_t p = m / (ULB_TILE * ULB_PANEL_TILES);
    const int nt = ulb_panel_ntiles(L->M_pad, p);
    const int64_t t = (m / ULB_TILE) % ULB_PANEL_TILES, l = m % ULB_TILE;
    const int64_t ks = k / ulb_tile_k(L->bits), kk = k % ulb_tile_k(L->bits);
    const int64_t g = ks / L->gsteps, i = ks % L->gsteps;
    const int64_t j = kk / 4, b = kk % 4;
    *byte = ulb_panel_offset(L->ksteps, L->n_groups, p) + ulb_group_offset(nt, L->gsteps, g) +
            nt * ULB_TILE_SCALE_BYTES + (i * nt + t) * ULB_TILE_BYTES + ulb_tile_byte(L->tiles, (int)l, (int)b);
    *shift = L->bits == ULB_BASE3_BITS ? (int)j : (int)(L->bits * j);
}

static inline unsigned ulb_code_get(const uint8_t *panels, const ulb_layout *L, int64_t m, int64_t k) {
    int64_t byte;
    int shift;
    ulb_code_pos(L, m, k, &byte, &shift);
    if (L->bits == ULB_BASE3_BITS) return ulb_base3_code(panels[byte], shift);
    return (panels[byte] >> shift) & ((1u << L->bits) - 1u);
}

static inline float ulb_scale_get(const uint8_t *panels, const ulb_layout *L, int64_t m, int64_t g) {
    float s;
    __builtin_memcpy(&s, panels + ulb_scale_pos(L, m, g), sizeof s);
    return s;
}

#endif
