/* AMX int8 GEMM for calls of ULB_AMX_MIN_TOKENS tokens or more (prefill),
 * every code width and base 3. Field j of a 64-byte tile is 16 rows x 4 k in
 * the VNNI order AMX's B operand takes, so a shift, a mask and the affine map
 * make it one B row of signed levels (a*q + b fits in s8 for every format),
 * as a table lookup on each byte makes digit j of a base-3 tile: the
 * int32 sums of TDPBSSD (s8 activations x s8 levels) are then the group's
 * dots of internal.h's contract, with no activation-sum term. Codes are
 * unpacked a chunk of k at a time into a buffer that stays in L1, every block
 * of 16 tokens runs through the chunk, and at the end of each group its step
 * follows in AVX-512 in the scalar reference's order (ref/panel_ref.c): the
 * same bits.
 *
 * Why AMX: on a CPU with it, torch's bf16 F.linear runs on AMX's bf16 tiles,
 * at several times the multiply-adds per cycle of AVX-512 vpdpbusd; the
 * int8 tiles do twice what the bf16 ones do.
 *
 * Tiles: tmm0-3 hold the sums of the panel's 4 row tiles for 16 tokens,
 * tmm4 the activations (16 tokens x kblk), tmm5-7 the B tiles in turn. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi,amx-tile,amx-int8")
#include <immintrin.h>
#include <string.h>

#include "../src/base3.h"
#include "../src/internal.h"

/* Tokens of one tile: its rows. */
#define AMX_ROWS 16

/* int32s of one token tile's sums: [row tile][token][16]. */
#define AMX_SUMS_STRIDE (ULB_PANEL_TILES * AMX_ROWS * ULB_TILE)

/* k-blocks unpacked at a time: 32 KiB of B tiles for a full panel, which
 * every block of tokens reads from L1; the whole panel's codes unpacked at
 * once (64 x K bytes) were written to and read from L2, slower. */
#define AMX_CHUNK_BLOCKS 8

/* k-columns one TDPBSSD covers: 64, or the whole group where groups are
 * shorter (a multiple of 4 for every width), so that only a group's last
 * block may be partial. */
static int64_t amx_kblk(const ulb_weight *w) {
    const int64_t group_k = w->gsteps * ulb_tile_k(w->bits);
    return group_k < 64 ? group_k : 64;
}

static int64_t amx_btile_bytes(int64_t kblk) { return kblk / 4 * ULB_TILE_BYTES; }

/* The B tiles of one chunk, then the sums of every block of tokens. */
static int64_t amx_chunk_bytes(const ulb_weight *w) {
    return AMX_CHUNK_BLOCKS * ULB_PANEL_TILES * amx_btile_bytes(amx_kblk(w));
}

static int64_t amx_scratch_bytes(const ulb_weight *w) {
    return amx_chunk_bytes(w) + (int64_t)(ULB_AMX_TOKENS / AMX_ROWS) * AMX_SUMS_STRIDE * (int64_t)sizeof(int32_t);
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
    for (int t = 0; t < 4; t++) c.colsb[t] = 64, c.rows[t] = AMX_ROWS;      /* sums */
    c.colsb[4] = (uint16_t)kblk, c.rows[4] = AMX_ROWS;                      /* activations */
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

/* Digit j of a base-3 byte as its level (c - 1) for the byte's low 7 bits,
 * sign bit clear (base3.h); the sign bit negates it. Filled at load. */
static int8_t BASE3_LEVELS[ULB_BASE3_DIGITS][128] __attribute__((aligned(64)));

__attribute__((constructor)) static void fill_base3_levels(void) {
    for (int j = 0; j < ULB_BASE3_DIGITS; j++)
        for (int i = 0; i < 128; i++) BASE3_LEVELS[j][i] = (int8_t)((int)ulb_base3_code((uint8_t)i, j) - 1);
}

/* Levels of field (digit) j of the tile v: the bit field's a*q + b, or the
 * base-3 digit's table entry, negated in the bytes of `neg`. */
ALWAYS_INLINE __m512i tile_levels(__m512i v, int j, const __m512i *base3, __mmask64 neg, __m512i mask,
                                  __m512i level_b, const int twice, const int bits) {
    if (bits == ULB_BASE3_BITS) {
        const __m512i level = _mm512_permutex2var_epi8(base3[2 * j], v, base3[2 * j + 1]);
        return _mm512_mask_sub_epi8(level, neg, _mm512_setzero_si512(), level);
    }
    const __m512i u = bits == 8 ? v : _mm512_and_si512(_mm512_srli_epi16(v, bits * j), mask);
    return _mm512_add_epi8(twice ? _mm512_add_epi8(u, u) : u, level_b);
}

/* k-blocks [c0, c1) of a group of `steps` k-steps whose codes start at
 * `codes`, into chunk[kb - c0][t][row][64] as levels level_a * q + level_b
 * (level_a is 1 or 2 in every format: ulb_format_get). B row q of the group
 * (k-quad q: columns 4q .. 4q+3, 16 rows) of row tile t is field q % fields
 * of k-step q / fields; rows past the group's columns are zero, so the
 * activations they meet (the next group's, or padding) add nothing. A chunk
 * may start or end inside a base-3 k-step (5 quads): that step is decoded
 * in both chunks, each keeping its own quads. */
ALWAYS_INLINE void unpack_chunk(const ulb_weight *w, const uint8_t *codes, int64_t steps, int nt, int64_t c0,
                                int64_t c1, int64_t kblk, uint8_t *chunk, const int bits) {
    const int fields = bits == ULB_BASE3_BITS ? ULB_BASE3_DIGITS : 8 / bits, lanes = w->tiles == ULB_TILES_LANES;
    const int twice = w->level_a == 2;
    const int64_t rows = kblk / 4, btile = amx_btile_bytes(kblk);
    const int64_t q0 = c0 * rows, q1 = c1 * rows, ks_end = (q1 + fields - 1) / fields;
    const int64_t ks1 = ks_end < steps ? ks_end : steps;
    const __m512i mask = _mm512_set1_epi8((char)((1 << bits) - 1)), perm = lanes_to_vnni();
    const __m512i level_b = _mm512_set1_epi8((char)w->level_b);
    __m512i base3[2 * ULB_BASE3_DIGITS];
    if (bits == ULB_BASE3_BITS)
        for (int i = 0; i < 2 * ULB_BASE3_DIGITS; i++) base3[i] = _mm512_load_si512(BASE3_LEVELS[i / 2] + 64 * (i % 2));
    for (int64_t ks = q0 / fields; ks < ks1; ks++)
        for (int t = 0; t < nt; t++) {
            __m512i v = _mm512_loadu_si512(codes + (ks * nt + t) * ULB_TILE_BYTES);
            if (lanes) v = _mm512_permutexvar_epi8(perm, v);
            const __mmask64 neg = _mm512_movepi8_mask(v);
#pragma GCC unroll 8
            for (int j = 0; j < fields; j++) {
                const int64_t q = ks * fields + j - q0;
                if (q < 0 || q >= q1 - q0) continue;
                _mm512_store_si512(chunk + ((q / rows) * nt + t) * btile + (q % rows) * ULB_TILE_BYTES,
                                   tile_levels(v, j, base3, neg, mask, level_b, twice, bits));
            }
        }
    for (int64_t q = ks1 * fields - q0; q < q1 - q0; q++)
        for (int t = 0; t < nt; t++)
            _mm512_store_si512(chunk + ((q / rows) * nt + t) * btile + (q % rows) * ULB_TILE_BYTES,
                               _mm512_setzero_si512());
}

static void unpack_chunk_bits(const ulb_weight *w, const uint8_t *codes, int64_t steps, int nt, int64_t c0,
                              int64_t c1, int64_t kblk, uint8_t *chunk) {
    switch (w->bits) {
    case 1: unpack_chunk(w, codes, steps, nt, c0, c1, kblk, chunk, 1); return;
    case 2: unpack_chunk(w, codes, steps, nt, c0, c1, kblk, chunk, 2); return;
    case ULB_BASE3_BITS: unpack_chunk(w, codes, steps, nt, c0, c1, kblk, chunk, ULB_BASE3_BITS); return;
    case 4: unpack_chunk(w, codes, steps, nt, c0, c1, kblk, chunk, 4); return;
    default: unpack_chunk(w, codes, steps, nt, c0, c1, kblk, chunk, 8); return;
    }
}

/* Sums of the nt row tiles over k-blocks [c0, c1) for one block of 16
 * tokens whose activations for the chunk's first column start at x; the
 * sums start from zero (first) or from `sums`, and end there. */
static void tiles_chunk(const uint8_t *chunk, int nt, int64_t nblocks, int64_t kblk, const int8_t *x, int64_t ldq,
                        int first, int32_t *sums) {
    const int64_t row_bytes = ULB_TILE * sizeof(int32_t), tile = AMX_ROWS * ULB_TILE, btile = amx_btile_bytes(kblk);
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, sums, row_bytes);
        if (nt > 1) _tile_loadd(1, sums + tile, row_bytes);
        if (nt > 2) _tile_loadd(2, sums + 2 * tile, row_bytes);
        if (nt > 3) _tile_loadd(3, sums + 3 * tile, row_bytes);
    }
    for (int64_t kb = 0; kb < nblocks; kb++) {
        const uint8_t *bk = chunk + kb * nt * btile;
        _tile_loadd(4, x + kb * kblk, ldq);
        _tile_loadd(5, bk, ULB_TILE_BYTES);
        _tile_dpbssd(0, 4, 5);
        if (nt > 1) {
            _tile_loadd(6, bk + btile, ULB_TILE_BYTES);
            _tile_dpbssd(1, 4, 6);
        }
        if (nt > 2) {
            _tile_loadd(7, bk + 2 * btile, ULB_TILE_BYTES);
            _tile_dpbssd(2, 4, 7);
        }
        if (nt > 3) {
            _tile_loadd(5, bk + 3 * btile, ULB_TILE_BYTES);
            _tile_dpbssd(3, 4, 5);
        }
    }
    _tile_stored(0, sums, row_bytes);
    if (nt > 1) _tile_stored(1, sums + tile, row_bytes);
    if (nt > 2) _tile_stored(2, sums + 2 * tile, row_bytes);
    if (nt > 3) _tile_stored(3, sums + 3 * tile, row_bytes);
}

/* The group step of group g for tokens j0 .. j0 + nb - 1 of the call (nb <=
 * 16) and the nt row tiles whose dots sit in sums[t][token][16]. */
static void group_step(const ulb_weight *w, int j0, int nb, int nt, int64_t g, const float *scales,
                       const int32_t *sums, float *facc, int32_t *dots) {
    __m512 s[ULB_PANEL_TILES];
    for (int t = 0; t < nt; t++) s[t] = _mm512_loadu_ps(scales + t * ULB_TILE);
    for (int j = 0; j < nb; j++) {
        float *f = facc + (j0 + j) * ULB_PANEL_ROWS;
        for (int t = 0; t < nt; t++) {
            const __m512i dot = _mm512_load_si512(sums + (t * AMX_ROWS + j) * ULB_TILE);
            const __m512 term = _mm512_mul_ps(s[t], _mm512_cvtepi32_ps(dot));
            _mm512_storeu_ps(f + t * ULB_TILE, _mm512_add_ps(_mm512_loadu_ps(f + t * ULB_TILE), term));
            if (dots) _mm512_storeu_si512(dots + ((j0 + j) * w->n_groups + g) * ULB_PANEL_ROWS + t * ULB_TILE, dot);
        }
    }
}

static void amx_panel(const ulb_weight *w, int64_t p, const ulb_acts *a, int64_t n0, int nb, uint8_t *scratch,
                      float *facc, int32_t *dots) {
    const int nt = ulb_panel_ntiles(w->M_pad, p), nblk = (nb + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t kblk = amx_kblk(w), group_k = w->gsteps * ulb_tile_k(w->bits), ldq = a->ldq;
    uint8_t *chunk = scratch;
    int32_t *sums = (int32_t *)(scratch + amx_chunk_bytes(w)); /* AMX_SUMS_STRIDE per token tile */
    for (int j = 0; j < nb; j++) memset(facc + j * ULB_PANEL_ROWS, 0, (size_t)nt * ULB_TILE * sizeof(float));
    for (int64_t g = 0; g < w->n_groups; g++) {
        const uint8_t *group = ulb_group_base(w, p, nt, g);
        const int64_t steps = ulb_group_steps(w, g);
        const int64_t blocks = (steps * ulb_tile_k(w->bits) + kblk - 1) / kblk;
        const float *scales = (const float *)group;
        /* A group of one chunk needs the sums of two blocks of tokens at a
         * time (one being summed, the other stepped), which L1 then keeps. */
        const int rotate = blocks <= AMX_CHUNK_BLOCKS;
        for (int64_t c0 = 0; c0 < blocks; c0 += AMX_CHUNK_BLOCKS) {
            const int64_t c1 = c0 + AMX_CHUNK_BLOCKS < blocks ? c0 + AMX_CHUNK_BLOCKS : blocks;
            const int last = c1 == blocks;
            unpack_chunk_bits(w, group + nt * ULB_TILE_SCALE_BYTES, steps, nt, c0, c1, kblk, chunk);
            /* GCC's _tile_loadd declares no memory read: without a barrier
             * the chunk's stores could be moved past the tile loads. */
            __asm__ volatile("" ::: "memory");
            /* In the group's last chunk, the step of each block of tokens
             * after the tiles of the next: the vector units work on one while
             * AMX works on the other (with the signed levels and the sums of
             * two tiles in turn). */
            for (int tb = 0; tb <= nblk; tb++) {
                if (tb < nblk)
                    tiles_chunk(chunk, nt, c1 - c0, kblk,
                                a->xq + (n0 + tb * AMX_ROWS) * ldq + g * group_k + c0 * kblk, ldq, c0 == 0,
                                sums + (rotate ? tb % 2 : tb) * AMX_SUMS_STRIDE);
                if (last && tb > 0) {
                    const int j0 = (tb - 1) * AMX_ROWS, n = nb - j0 < AMX_ROWS ? nb - j0 : AMX_ROWS;
                    group_step(w, j0, n, nt, g, scales, sums + (rotate ? (tb - 1) % 2 : tb - 1) * AMX_SUMS_STRIDE, facc,
                               dots);
                }
            }
        }
    }
}

const ulb_gemm_kernel ulb_gemm_amx = {ULB_AMX_TOKENS,  AMX_ROWS,      64,       amx_scratch_bytes,
                                     amx_tiles_begin, amx_tiles_end, amx_panel};
