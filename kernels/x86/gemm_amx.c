/* AMX int8 GEMM for calls of ULB_AMX_MIN_TOKENS tokens or more (prefill),
 * every code width. A panel's codes are unpacked once into u8 B tiles
 * (amx_unpack: field j of a tile, brought down to 0..2^bits-1, is one
 * 64-byte B row of 16 rows x 4 k, already in the VNNI order AMX reads), then
 * each block of 16 tokens runs through them with TDPBSUD (s8 activations as
 * A, u8 codes as B, int32 sums), one group at a time, and the group step of
 * internal.h's contract follows in AVX-512 in the same order as the scalar
 * reference (ref/panel_ref.c), so the results are the same bits.
 *
 * Why AMX: on a CPU with it, torch's bf16 F.linear runs on AMX's bf16 tiles,
 * at ~4x the multiply-adds per cycle of AVX-512 vpdpbusd; the int8 tiles do
 * twice what the bf16 ones do.
 *
 * Tiles: tmm0-3 hold the int32 sums of the panel's 4 row tiles for 16 tokens,
 * tmm4 the activations (16 tokens x kblk), tmm5-7 the B tiles in turn. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi,amx-tile,amx-int8")
#include <immintrin.h>
#include <string.h>

#include "../src/internal.h"

/* k-columns one TDPBSUD covers: 64, or the whole group where groups are shorter
 * (a multiple of 4 for every width), so a group never spans a partial block
 * but its last. */
static int64_t amx_kblk(const ulb_weight *w) {
    const int64_t group_k = w->gsteps * ulb_tile_k(w->bits);
    return group_k < 64 ? group_k : 64;
}

/* Blocks of kblk columns in group g (the last group may be shorter). */
static int64_t amx_group_blocks(const ulb_weight *w, int64_t g, int64_t kblk) {
    const int64_t ks0 = g * w->gsteps, ks1 = ks0 + w->gsteps < w->ksteps ? ks0 + w->gsteps : w->ksteps;
    return ((ks1 - ks0) * ulb_tile_k(w->bits) + kblk - 1) / kblk;
}

static int64_t amx_btile_bytes(int64_t kblk) { return kblk / 4 * ULB_TILE_BYTES; }

/* Bytes from the start of group g's B tiles to the next group's. */
static int64_t amx_group_stride(const ulb_weight *w, int nt, int64_t kblk) {
    return amx_group_blocks(w, 0, kblk) * nt * amx_btile_bytes(kblk);
}

static int64_t amx_unpacked_bytes(const ulb_weight *w) {
    return w->n_groups * amx_group_stride(w, ULB_PANEL_TILES, amx_kblk(w));
}

typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

static void amx_tiles_begin(const ulb_weight *w) {
    const int64_t kblk = amx_kblk(w);
    amx_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.colsb[t] = 64, c.rows[t] = ULB_AMX_TOKENS; /* sums */
    c.colsb[4] = (uint16_t)kblk, c.rows[4] = ULB_AMX_TOKENS;                 /* activations */
    for (int t = 5; t < 8; t++) c.colsb[t] = 64, c.rows[t] = (uint8_t)(kblk / 4); /* codes */
    /* Not _tile_loadconfig: GCC 12's tells the compiler it reads 8 bytes, and
     * the stores of the shapes above are then dropped as dead. */
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

static void amx_tiles_end(void) { _tile_release(); }

/* The permutation that turns a LANES tile (byte 16b + l) into the VNNI
 * order (byte 4l + b) with one vpermb. */
static __m512i lanes_to_vnni(void) {
    uint8_t idx[64] __attribute__((aligned(64)));
    for (int i = 0; i < 64; i++) idx[i] = (uint8_t)ulb_tile_byte(ULB_TILES_LANES, i / 4, i % 4);
    return _mm512_load_si512(idx);
}

/* B row q of a group (k-quad q: columns 4q .. 4q+3 of the group, 16 rows) of
 * row tile t goes to block q / (kblk/4), row q % (kblk/4); rows past the
 * group's columns stay zero, so the activations they meet (the next group's,
 * or padding) add nothing. */
ALWAYS_INLINE void unpack_panel(const ulb_weight *w, int64_t p, uint8_t *b, const int bits) {
    const int nt = ulb_panel_ntiles(w->M_pad, p), fields = 8 / bits;
    const int64_t kblk = amx_kblk(w), rows = kblk / 4, btile = amx_btile_bytes(kblk);
    const int64_t gstride = amx_group_stride(w, nt, kblk);
    const __m512i mask = _mm512_set1_epi8((char)((1 << bits) - 1)), perm = lanes_to_vnni();
    const int lanes = w->tiles == ULB_TILES_LANES;
    for (int64_t g = 0; g < w->n_groups; g++) {
        const int64_t ks0 = g * w->gsteps, ks1 = ks0 + w->gsteps < w->ksteps ? ks0 + w->gsteps : w->ksteps;
        const uint8_t *codes = ulb_group_base(w, p, nt, g) + nt * ULB_TILE_SCALE_BYTES;
        uint8_t *bg = b + g * gstride;
        const int64_t quads = (ks1 - ks0) * fields, quads_pad = amx_group_blocks(w, g, kblk) * rows;
        for (int t = 0; t < nt; t++) {
            for (int64_t ks = 0; ks < ks1 - ks0; ks++) {
                __m512i v = _mm512_loadu_si512(codes + (ks * nt + t) * ULB_TILE_BYTES);
                if (lanes) v = _mm512_permutexvar_epi8(perm, v);
#pragma GCC unroll 8
                for (int j = 0; j < fields; j++) {
                    const int64_t q = ks * fields + j;
                    const __m512i u = bits == 8 ? v : _mm512_and_si512(_mm512_srli_epi16(v, bits * j), mask);
                    _mm512_store_si512(bg + ((q / rows) * nt + t) * btile + (q % rows) * ULB_TILE_BYTES, u);
                }
            }
            for (int64_t q = quads; q < quads_pad; q++)
                _mm512_store_si512(bg + ((q / rows) * nt + t) * btile + (q % rows) * ULB_TILE_BYTES,
                                   _mm512_setzero_si512());
        }
    }
}

static void amx_unpack(const ulb_weight *w, int64_t p, uint8_t *b) {
    switch (w->bits) {
    case 1: unpack_panel(w, p, b, 1); return;
    case 2: unpack_panel(w, p, b, 2); return;
    case 4: unpack_panel(w, p, b, 4); return;
    default: unpack_panel(w, p, b, 8); return;
    }
}

/* The group step for 16 tokens (nb of them real) and the nt row tiles whose
 * int32 sums sit in sums[t][token][16]. */
static void group_step(const ulb_weight *w, const ulb_acts *a, int64_t n0, int nb, int nt, int64_t g,
                       const float *scales, const int32_t *sums, float *facc, int32_t *dots) {
    const __m512i va = _mm512_set1_epi32(w->level_a);
    for (int j = 0; j < nb; j++) {
        const __m512i vb = _mm512_set1_epi32(w->level_b * a->xsum[(n0 + j) * w->n_groups + g]);
        for (int t = 0; t < nt; t++) {
            const __m512i c = _mm512_load_si512(sums + (t * ULB_AMX_TOKENS + j) * ULB_TILE);
            const __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(c, va), vb);
            float *f = facc + j * ULB_PANEL_ROWS + t * ULB_TILE;
            const __m512 term = _mm512_mul_ps(_mm512_loadu_ps(scales + t * ULB_TILE), _mm512_cvtepi32_ps(dot));
            _mm512_storeu_ps(f, _mm512_add_ps(_mm512_loadu_ps(f), term));
            if (dots) _mm512_storeu_si512(dots + (j * w->n_groups + g) * ULB_PANEL_ROWS + t * ULB_TILE, dot);
        }
    }
}

static void amx_block(const ulb_weight *w, int64_t p, const uint8_t *b, const ulb_acts *a, int64_t n0, int nb,
                   float *facc, int32_t *dots) {
    const int nt = ulb_panel_ntiles(w->M_pad, p);
    const int64_t kblk = amx_kblk(w), btile = amx_btile_bytes(kblk), gstride = amx_group_stride(w, nt, kblk);
    const int64_t group_k = w->gsteps * ulb_tile_k(w->bits);
    const int8_t *x = a->xq + n0 * a->ldq;
    int32_t sums[ULB_PANEL_TILES * ULB_AMX_TOKENS * ULB_TILE] __attribute__((aligned(64)));
    for (int j = 0; j < nb; j++) memset(facc + j * ULB_PANEL_ROWS, 0, (size_t)nt * ULB_TILE * sizeof(float));
    for (int64_t g = 0; g < w->n_groups; g++) {
        const uint8_t *bg = b + g * gstride;
        const int8_t *xg = x + g * group_k;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const int64_t blocks = amx_group_blocks(w, g, kblk);
        for (int64_t kb = 0; kb < blocks; kb++) {
            const uint8_t *bk = bg + kb * nt * btile;
            _tile_loadd(4, xg + kb * kblk, a->ldq);
            _tile_loadd(5, bk, ULB_TILE_BYTES);
            _tile_dpbsud(0, 4, 5);
            if (nt > 1) {
                _tile_loadd(6, bk + btile, ULB_TILE_BYTES);
                _tile_dpbsud(1, 4, 6);
            }
            if (nt > 2) {
                _tile_loadd(7, bk + 2 * btile, ULB_TILE_BYTES);
                _tile_dpbsud(2, 4, 7);
            }
            if (nt > 3) {
                _tile_loadd(5, bk + 3 * btile, ULB_TILE_BYTES);
                _tile_dpbsud(3, 4, 5);
            }
        }
        const int64_t row_bytes = ULB_TILE * sizeof(int32_t), tile = ULB_AMX_TOKENS * ULB_TILE;
        _tile_stored(0, sums, row_bytes);
        if (nt > 1) _tile_stored(1, sums + tile, row_bytes);
        if (nt > 2) _tile_stored(2, sums + 2 * tile, row_bytes);
        if (nt > 3) _tile_stored(3, sums + 3 * tile, row_bytes);
        group_step(w, a, n0, nb, nt, g, (const float *)ulb_group_base(w, p, nt, g), sums, facc, dots);
    }
}

const ulb_gemm_kernel ulb_gemm_amx = {ULB_AMX_TOKENS, 64, amx_unpacked_bytes, amx_tiles_begin, amx_tiles_end,
                                     amx_unpack, amx_block};
