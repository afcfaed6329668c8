/* What a second 1-bit layout would buy under AVX2: a one-token 1-bit GEMV by
 * vpshufb lookups (after T-MAC) over a layout with one row per byte, timed in
 * cache against the library's AVX2 1-bit kernel on the same bits, one core.
 *
 * Why a second layout: vpshufb looks up 16-entry tables per 128-bit lane, so
 * every byte of a lane must index the same 4 columns. In the library's tiles
 * (layout.h) a lane holds 4 rows x 4 byte slots, and the columns of a nibble
 * depend on the slot, so one lookup cannot serve a lane; here a lane holds 16
 * rows and a nibble 4 consecutive columns.
 *
 * Layout: blocks of 32 rows x 8 columns, 32 bytes, byte r = row r, bit c =
 * column c; TILES blocks of rows per k-step, k-step after k-step. Tables per
 * k-step: [L0 | H0 | L1 | H1], 16 bytes each, entry n of group g:
 *   L_g[n] = sum_{i<4} bit_i(n) * (x[8ks + 4g + i] & 15)   in [0, 60]
 *   H_g[n] = sum_{i<4} bit_i(n) * (x[8ks + 4g + i] >> 4)   in [-32, 28]
 * so that L + 16 H is the dot of nibble n with those 4 activations. A block
 * then takes 3 operations for the nibbles, 4 lookups, 2 byte adds (L0 + L1,
 * H0 + H1), and 2 x (unpack L with H, vpmaddubsw by [1, 16], add) into int16
 * sums widened every 31 k-steps: 15 for 256 weights, against 25 for the
 * library's kernel. It computes s = sum of x over the set bits (the binary
 * format's dot is 2 s - sum x), checked against plain C.
 *
 * Then cold, M x K matrices streamed from DRAM over a ~512 MiB rotation, one
 * thread: the lookups (tables built per call, 16 KiB of prefetch as the
 * library's 1-bit kernels take) against ulb_linear, a pass of each in turn.
 * Build and usage: benchmarks/README.md ([K [M]]; defaults 2048 and 2048). */
#pragma GCC target("avx2")
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../kernels/src/internal.h"
#include "cold_blobs.h"

#define ROWS 32  /* rows per block: one per byte of a 32-byte vector */
#define TILES 4  /* blocks of rows taken per k-step */
#define STEP 8   /* columns per k-step: two nibbles */
#define WIDEN 31 /* k-steps summed in 16 bits: each adds at most 1024 in magnitude */
#define PREFETCH 16384

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

/* The tables as the header says, in plain C. */
static void build_tables_ref(const int8_t *x, int64_t ksteps, int8_t *tab) {
    for (int64_t ks = 0; ks < ksteps; ks++)
        for (int g = 0; g < 2; g++)
            for (int n = 0; n < 16; n++) {
                int l = 0, h = 0;
                for (int i = 0; i < 4; i++)
                    if (n >> i & 1) {
                        const int v = x[ks * STEP + 4 * g + i];
                        l += v & 15, h += v >> 4;
                    }
                tab[ks * 64 + 32 * g + n] = (int8_t)l;
                tab[ks * 64 + 32 * g + 16 + n] = (int8_t)h;
            }
}

/* The same with vpshufb: lane 0 of src holds x & 15, lane 1 x >> 4, so four
 * lookups of the group's columns (index 0x80 reads 0) and three adds give
 * [L_g | H_g] at once: 0.55 us at K = 2048 on the Zen 3 VM. */
static void build_tables(const int8_t *x, int64_t ksteps, int8_t *tab) {
    __m256i pick[2][4];
    for (int g = 0; g < 2; g++)
        for (int i = 0; i < 4; i++) {
            uint8_t idx[32];
            for (int e = 0; e < 32; e++) idx[e] = (e % 16) >> i & 1 ? (uint8_t)(4 * g + i) : 0x80;
            pick[g][i] = _mm256_loadu_si256((const __m256i *)idx);
        }
    const __m128i low = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    for (int64_t ks = 0; ks < ksteps; ks++) {
        const __m128i v = _mm_loadl_epi64((const __m128i *)(x + ks * STEP));
        /* x >> 4, arithmetic: the high nibble sign-extended by (h ^ 8) - 8. */
        const __m128i high = _mm_sub_epi8(_mm_xor_si128(_mm_and_si128(_mm_srli_epi16(v, 4), low), eight), eight);
        const __m256i src = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(v, low)), high, 1);
        for (int g = 0; g < 2; g++)
            _mm256_storeu_si256((__m256i *)(tab + ks * 64 + 32 * g),
                                _mm256_add_epi8(_mm256_add_epi8(_mm256_shuffle_epi8(src, pick[g][0]),
                                                                _mm256_shuffle_epi8(src, pick[g][1])),
                                                _mm256_add_epi8(_mm256_shuffle_epi8(src, pick[g][2]),
                                                                _mm256_shuffle_epi8(src, pick[g][3]))));
    }
}

static __m256i table(const int8_t *p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p)); }

/* s[m] for every row: codes [pass][k-step][block][32 bytes]. */
static void lookup_gemv(const uint8_t *codes, int64_t M, int64_t ksteps, const int8_t *tab, int32_t *s) {
    const __m256i low = _mm256_set1_epi8(0x0F), one_sixteen = _mm256_set1_epi16(0x1001);
    for (int64_t p = 0; p < M / (ROWS * TILES); p++) {
        const uint8_t *pc = codes + p * ksteps * TILES * ROWS;
        __m256i acc[TILES][4];
        for (int t = 0; t < TILES; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = _mm256_setzero_si256();
        for (int64_t c0 = 0; c0 < ksteps; c0 += WIDEN) {
            const int64_t c1 = c0 + WIDEN < ksteps ? c0 + WIDEN : ksteps;
            __m256i sum[TILES][2];
            for (int t = 0; t < TILES; t++) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
            for (int64_t ks = c0; ks < c1; ks++) {
                const int8_t *tb = tab + ks * 64;
                const __m256i l0 = table(tb), h0 = table(tb + 16), l1 = table(tb + 32), h1 = table(tb + 48);
                for (int o = 0; o < TILES * ROWS; o += 64) __builtin_prefetch(pc + ks * TILES * ROWS + o + PREFETCH, 0, 3);
#pragma GCC unroll 4
                for (int t = 0; t < TILES; t++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(pc + (ks * TILES + t) * ROWS));
                    const __m256i n0 = _mm256_and_si256(v, low), n1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    const __m256i l = _mm256_add_epi8(_mm256_shuffle_epi8(l0, n0), _mm256_shuffle_epi8(l1, n1));
                    const __m256i h = _mm256_add_epi8(_mm256_shuffle_epi8(h0, n0), _mm256_shuffle_epi8(h1, n1));
                    sum[t][0] = _mm256_add_epi16(sum[t][0], _mm256_maddubs_epi16(one_sixteen, _mm256_unpacklo_epi8(l, h)));
                    sum[t][1] = _mm256_add_epi16(sum[t][1], _mm256_maddubs_epi16(one_sixteen, _mm256_unpackhi_epi8(l, h)));
                }
            }
            for (int t = 0; t < TILES; t++)
                for (int j = 0; j < 2; j++) {
                    acc[t][2 * j] = _mm256_add_epi32(acc[t][2 * j], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(sum[t][j])));
                    acc[t][2 * j + 1] =
                        _mm256_add_epi32(acc[t][2 * j + 1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(sum[t][j], 1)));
                }
        }
        /* unpacklo took rows 0-7 and 16-23 of a block, unpackhi 8-15 and 24-31. */
        for (int t = 0; t < TILES; t++) {
            int32_t *o = s + (p * TILES + t) * ROWS;
            _mm256_storeu_si256((__m256i *)o, acc[t][0]);
            _mm256_storeu_si256((__m256i *)(o + 16), acc[t][1]);
            _mm256_storeu_si256((__m256i *)(o + 8), acc[t][2]);
            _mm256_storeu_si256((__m256i *)(o + 24), acc[t][3]);
        }
    }
}

/* The lookup GEMV of one token through a call: tables, then the rows. */
static void lookup_call(const uint8_t *codes, int64_t M, int64_t ksteps, const int8_t *x, int8_t *tab, int32_t *s) {
    build_tables(x, ksteps, tab);
    lookup_gemv(codes, M, ksteps, tab, s);
}

int main(int argc, char **argv) {
    const int64_t K = argc > 1 ? atoll(argv[1]) : 2048, M = argc > 2 ? atoll(argv[2]) : 2048, ksteps = K / STEP;
    if (K <= 0 || K % 32 || M <= 0 || M % (ROWS * TILES)) {
        fprintf(stderr, "K must be a positive multiple of 32, M of %d\n", ROWS * TILES);
        return 2;
    }
    if (!ulb_isa_supported(ULB_ISA_AVX2)) return fprintf(stderr, "this CPU has no AVX2\n"), 2;
    uint8_t *bits = malloc(M * K), *codes = calloc(M * K / 8, 1);
    int8_t *x = malloc(K), *tab = malloc(ksteps * 64), *tab_ref = malloc(ksteps * 64);
    int32_t *s = calloc(M, sizeof *s);
    for (int64_t i = 0; i < M * K; i++) bits[i] = (uint8_t)(rand() & 1);
    for (int64_t k = 0; k < K; k++) x[k] = (int8_t)(rand() % 256 - 128);
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++)
            codes[((m / (ROWS * TILES) * ksteps + k / STEP) * TILES + m / ROWS % TILES) * ROWS + m % ROWS] |=
                (uint8_t)(bits[m * K + k] << (k % STEP));
    build_tables_ref(x, ksteps, tab_ref);
    lookup_call(codes, M, ksteps, x, tab, s);
    if (memcmp(tab, tab_ref, ksteps * 64)) return fprintf(stderr, "tables differ from plain C\n"), 1;
    for (int64_t m = 0; m < M; m++) {
        int32_t want = 0;
        for (int64_t k = 0; k < K; k++) want += bits[m * K + k] * x[k];
        if (s[m] != want) return fprintf(stderr, "row %ld: %d, plain C %d\n", (long)m, s[m], want), 1;
    }
    /* The library's AVX2 1-bit one-token kernel on the same bits, as kernel_hot times it. */
    const int64_t nbytes = ulb_packed_nbytes(ULB_FMT_BINARY, M, K, 0);
    uint8_t *blob = ulb_aligned_alloc(nbytes);
    float *scales = malloc(M * sizeof(float));
    for (int64_t m = 0; m < M; m++) scales[m] = 1.0f;
    ulb_pack(ULB_FMT_BINARY, M, K, 0, bits, K, scales, blob, nbytes);
    ulb_weight w;
    ulb_weight_view(blob, nbytes, &w);
    int8_t *xq = ulb_aligned_alloc(w.K_pad);
    memcpy(xq, x, K);
    int32_t xsum = 0;
    const ulb_acts a = ulb_acts_of(&w, xq, &xsum, NULL, 1);
    const ulb_panel_fn lib = ulb_panel_for_isa(ULB_ISA_AVX2);
    float facc[ULB_NB_MAX * ULB_PANEL_ROWS];
    double best_lut = 1e30, best_lib = 1e30, best_tab = 1e30;
    for (int rep = 0; rep < 100; rep++) {
        double t0 = now_ns();
        lookup_gemv(codes, M, ksteps, tab, s);
        double t1 = now_ns();
        for (int64_t p = 0; p < M / ULB_PANEL_ROWS; p++) lib(&w, p * ULB_PANEL_TILES, ULB_PANEL_TILES, &a, 0, 1, facc, NULL);
        double t2 = now_ns();
        build_tables(x, ksteps, tab);
        double t3 = now_ns();
        if (t1 - t0 < best_lut) best_lut = t1 - t0;
        if (t2 - t1 < best_lib) best_lib = t2 - t1;
        if (t3 - t2 < best_tab) best_tab = t3 - t2;
    }
    printf("1-bit %ldx%ld in cache, one core: row-layout lookups %.1f GB/s of codes, library AVX2 kernel %.1f: "
           "%.2fx; tables %.2f us a call\n",
           (long)M, (long)K, M * K / 8 / best_lut, M * K / 8 / best_lib, best_lib / best_lut, best_tab / 1e3);

    /* Cold: n copies of each, a pass over each rotation in turn. */
    const int64_t code_bytes = M * K / 8, n = (512ll << 20) / code_bytes + 1;
    uint8_t **cc = malloc(n * sizeof *cc), **bb = malloc(n * sizeof *bb);
    for (int64_t i = 0; i < n; i++) {
        cc[i] = ulb_aligned_alloc(code_bytes), memcpy(cc[i], codes, code_bytes);
        bb[i] = ulb_aligned_alloc(nbytes), memcpy(bb[i], blob, nbytes);
    }
    float *y = malloc(M * sizeof(float));
    enum { ROUNDS = 12 };
    double t_lut[ROUNDS + 1], t_lib[ROUNDS + 1];
    for (int r = 0; r <= ROUNDS; r++)
        for (int j = 0; j < 2; j++) {
            const int lut = (r + j) % 2 == 0;
            const double t0 = bench_now_s();
            for (int64_t i = 0; i < n; i++) {
                if (lut)
                    lookup_call(cc[i], M, ksteps, x, tab, s);
                else if (ulb_linear(bb[i], nbytes, 1, x, ULB_DT_F32, K, 1, NULL, ULB_DT_F32, y, ULB_DT_F32, M, 1))
                    return fprintf(stderr, "ulb_linear failed\n"), 1;
            }
            (lut ? t_lut : t_lib)[r] = (bench_now_s() - t0) / n;
        }
    double ratio[ROUNDS];
    for (int r = 0; r < ROUNDS; r++) ratio[r] = t_lib[r + 1] / t_lut[r + 1];
    printf("1-bit %ldx%ld cold (%ld copies), one thread: lookups %.1f GB/s of codes, ulb_linear %.1f; "
           "%.2fx (median of %d rounds)\n",
           (long)M, (long)K, (long)n, code_bytes / bench_median(t_lut + 1, ROUNDS) / 1e9,
           nbytes / bench_median(t_lib + 1, ROUNDS) / 1e9, bench_median(ratio, ROUNDS), ROUNDS);
    return 0;
}
