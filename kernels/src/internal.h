/* Internal interfaces between the driver, the microkernels and the pool. */
#ifndef ULB_INTERNAL_H
#define ULB_INTERNAL_H

#include "ulb/ulb.h"
#include "ulb/ulb_testing.h"
#include "layout.h"

/* Whether the AArch64 kernels (kernels/arm) are part of this build: on Linux,
 * where setup.py compiles them and the HWCAPs say what the CPU runs. */
#if defined(__aarch64__) && defined(__linux__)
#define ULB_ARM 1
#else
#define ULB_ARM 0
#endif

/* Microkernel helpers take compile-time tile and token counts; inlining
 * them is what turns those into unrolled, register-resident loops. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The pause of a spin-wait loop. */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ulb_cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define ulb_cpu_relax() __asm__ __volatile__("yield")
#else
#define ulb_cpu_relax() ((void)0)
#endif

/* Columns (tokens) one microkernel call handles: weights unpacked once serve
 * this many activation vectors. */
#define ULB_NB_MAX 4

/* Prefetch the line `dist` bytes past p into L2 (dist: ulb_prefetch_resolve,
 * 0 = none), unless that is at or past `end`, the end of the panels the
 * calling thread reads: beyond it lie another thread's panels or another
 * matrix, and on a small matrix the overshoot is a sizeable share of the
 * traffic (16 KiB more on the 130 KiB each thread reads of a 1-bit 1024x2048
 * GEMV on two threads). */
static inline void ulb_prefetch_ahead(const uint8_t *p, int64_t dist, const uint8_t *end) {
    if (dist && p + dist < end) __builtin_prefetch(p + dist, 0, 2); /* prefetcht1 */
}

typedef struct {
    int bits, tiles, level_a, level_b; /* tiles: a ulb_tiles */
    int64_t M, K, M_pad, K_pad, n_groups;
    int64_t ksteps; /* K_pad / ulb_tile_k(bits) */
    int64_t gsteps; /* group_size / ulb_tile_k(bits) */
    const uint8_t *panels; /* scales and codes, layout.h */
} ulb_weight;

static inline ulb_layout ulb_weight_layout(const ulb_weight *w) {
    return (ulb_layout){w->bits, w->tiles, w->M_pad, w->ksteps, w->gsteps, w->n_groups};
}

/* Bytes of codes in one group of one full panel: how often the group step
 * interrupts the stream (ulb_prefetch_resolve). */
static inline int64_t ulb_weight_group_code_bytes(const ulb_weight *w) {
    return w->gsteps * ULB_PANEL_TILES * ULB_TILE_BYTES;
}

/* Panels of 64 rows in w; the last may hold fewer. */
static inline int64_t ulb_weight_npanels(const ulb_weight *w) { return (w->M_pad + ULB_PANEL_ROWS - 1) / ULB_PANEL_ROWS; }

/* The end of panels [0, p) of w: a bound for the prefetches of a thread whose
 * panels end at p (ulb_prefetch_ahead). */
static inline const uint8_t *ulb_weight_panels_end(const ulb_weight *w, int64_t p) {
    return w->panels + ulb_panels_end(w->M_pad, w->ksteps, w->n_groups, p);
}

/* K-steps in group g: gsteps, or fewer in the last group. */
static inline int64_t ulb_group_steps(const ulb_weight *w, int64_t g) {
    const int64_t left = w->ksteps - g * w->gsteps;
    return left < w->gsteps ? left : w->gsteps;
}

/* Group g of panel p (nt tiles): its scales, nt x 16 fp32, then its codes. */
static inline const uint8_t *ulb_group_base(const ulb_weight *w, int64_t p, int nt, int64_t g) {
    return w->panels + ulb_panel_offset(w->ksteps, w->n_groups, p) + ulb_group_offset(nt, w->gsteps, g);
}

/* ulb_prefetch_resolve as if `isa` were active (the read probe asks for the
 * AVX-512 distance on every CPU). */
int64_t ulb_prefetch_resolve_for(ulb_isa isa, int bits, int nthreads, int64_t group_code_bytes);

typedef struct {
    const int8_t *xq;    /* N x ldq, zero padded to K_pad */
    int64_t ldq;
    const int32_t *xsum; /* N x n_groups */
    const uint8_t *lut1; /* lookup tables of the 1-bit one-token kernel, or NULL (see linear.c) */
    const uint8_t *prefetch_end; /* end of the calling thread's panels, see ulb_prefetch_ahead */
    int64_t prefetch_dist;       /* ulb_prefetch_resolve for this call */
    int64_t tokens;              /* N of the call (a kernel call takes nb <= ULB_NB_MAX of them) */
} ulb_acts;

/* The activations of a call on w with N tokens that nthreads threads run:
 * the prefetch bound of the whole blob (each thread narrows it to its
 * panels) and the call's prefetch distance. */
static inline ulb_acts ulb_acts_of(const ulb_weight *w, int64_t N, const int8_t *xq, const int32_t *xsum,
                                   const uint8_t *lut1, int nthreads) {
    return (ulb_acts){xq, w->K_pad, xsum, lut1, ulb_weight_panels_end(w, ulb_weight_npanels(w)),
                      ulb_prefetch_resolve(w->bits, nthreads, ulb_weight_group_code_bytes(w)), N};
}

/* The microkernel contract, identical for every ISA:
 * for rows r of tiles [tile0, tile0 + ntiles) (ntiles <= 4) and columns
 * j < nb (nb <= ULB_NB_MAX) of activations starting at column n0,
 *   dot_g   = level_a * sum_{k in g} q[r,k] xq[n0+j,k] + level_b * xsum[n0+j,g]
 *   facc[j*64 + r] = (((0 + s[g0,r]*dot_g0) + s[g1,r]*dot_g1) + ...)
 * in fp32, multiply then add, groups in order, so that every ISA produces the
 * same bits. If dots != NULL also dots[(j*n_groups + g)*64 + r] = dot_g. */
typedef void (*ulb_panel_fn)(const ulb_weight *w, int64_t tile0, int ntiles,
                             const ulb_acts *a, int64_t n0, int nb,
                             float *facc, int32_t *dots);

/* One token through two full panels p and q (4 tiles each), read in
 * lockstep, a k-step of each in turn: the contract of ulb_panel_fn for each,
 * n0 = 0, nb = 1, no dots, into facc_p and facc_q. Two streams draw more
 * bandwidth from one core than one on some CPUs (kernels/src/probe.c); where
 * an ISA and code width has one, linear.c pairs the panels of each thread. */
#define ULB_PANEL_PAIR 2
typedef void (*ulb_panel_pair_fn)(const ulb_weight *w, int64_t p, int64_t q, const ulb_acts *a, float *facc_p,
                                  float *facc_q);
/* The pair kernel of `isa` for w, or NULL; lut1: whether the call has
 * 1-bit lookup tables. */
ulb_panel_pair_fn ulb_panel_pair_for(ulb_isa isa, const ulb_weight *w, int lut1);

/* Defines the ulb_panel_fn NAME of a SIMD file that has compiled one static
 * panel_1bit .. panel_8bit per code width: it picks by w->bits. */
#define ULB_PANEL_BY_WIDTH(NAME)                                                                   \
    void NAME(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0, int nb, \
              float *facc, int32_t *dots) {                                                       \
        switch (w->bits) {                                                                         \
        case 1: panel_1bit(w, tile0, ntiles, a, n0, nb, facc, dots); return;                      \
        case 2: panel_2bit(w, tile0, ntiles, a, n0, nb, facc, dots); return;                      \
        case 4: panel_4bit(w, tile0, ntiles, a, n0, nb, facc, dots); return;                      \
        default: panel_8bit(w, tile0, ntiles, a, n0, nb, facc, dots); return;                     \
        }                                                                                          \
    }

/* A GEMM kernel for calls of many tokens (prefill), where an ISA has one
 * (ulb_gemm_for_isa): panel runs tokens [n0, n0 + nb) (nb <= tokens) through
 * panel p under the contract of ulb_panel_fn (facc: nb x 64 floats, dots as
 * there), with scratch_bytes(w) bytes of scratch (64-byte aligned). Its loads
 * read activation rows in tiles of tile_tokens, so up to round_up(N,
 * tile_tokens), and up to xq_slack bytes past the end of the last, which the
 * caller allocates (zeroed, so that nothing reads undefined bytes; the codes
 * they meet are zero). A thread brackets its calls with begin (for w) and
 * end. */
typedef struct {
    int tokens, tile_tokens;
    int64_t xq_slack;
    int64_t (*scratch_bytes)(const ulb_weight *w);
    void (*begin)(const ulb_weight *w);
    void (*end)(void);
    void (*panel)(const ulb_weight *w, int64_t p, const ulb_acts *a, int64_t n0, int nb, uint8_t *scratch,
                  float *facc, int32_t *dots);
} ulb_gemm_kernel;

/* AMX's int8 tiles (x86/gemm_amx.c), up to 128 tokens a panel call (whose
 * codes it unpacks once), from 16 tokens on: below that a tile of 16 does the
 * same work as a full one, and the AVX-512 kernels run. */
#define ULB_AMX_TOKENS 128
#define ULB_AMX_MIN_TOKENS 16
extern const ulb_gemm_kernel ulb_gemm_amx;

/* i8mm's smmla/usmmla (arm/gemm_i8mm.c), up to 8 tokens a panel call, from 5
 * tokens on: below that the panel kernels' blocks of 4 do as well. */
#define ULB_I8MM_TOKENS 8
#define ULB_I8MM_MIN_TOKENS 5
extern const ulb_gemm_kernel ulb_gemm_i8mm;

/* The GEMM kernel for a call of N tokens on w under `isa`, or NULL: the panel
 * kernels serve. */
const ulb_gemm_kernel *ulb_gemm_for(ulb_isa isa, const ulb_weight *w, int64_t N);

/* Where a linear call writes its result. */
typedef struct {
    const float *xscale; /* per token: 1 / the activation quantisation factor */
    const void *bias;    /* M elements of bias_dt, or NULL */
    ulb_dtype bias_dt;
    void *y; /* N x ldy elements of y_dt */
    ulb_dtype y_dt;
    int64_t ldy;
    int stream; /* whole 64-byte lines of y may bypass the caches (non-temporal stores; see linear.c) */
} ulb_out;

/* The output step, identical for every ISA: for j < nb, r < rows,
 *   y[n0+j, m0+r] = (facc[j*64 + r] * xscale[n0+j]) (+ bias[m0+r])
 * in fp32, multiply then add, rounded once to y_dt (nearest even). rows <= 64
 * (one panel) unless nb == 1. */
typedef void (*ulb_store_fn)(const ulb_out *o, const float *facc, int64_t n0, int nb, int64_t m0, int64_t rows);

void ulb_panel_ref(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a,
                   int64_t n0, int nb, float *facc, int32_t *dots);
void ulb_panel_portable(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a,
                        int64_t n0, int nb, float *facc, int32_t *dots);
void ulb_panel_avxvnni(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a,
                       int64_t n0, int nb, float *facc, int32_t *dots);
void ulb_panel_avx2(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a,
                    int64_t n0, int nb, float *facc, int32_t *dots);
void ulb_panel_avx512(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a,
                      int64_t n0, int nb, float *facc, int32_t *dots);
void ulb_panel_pair_avx2(const ulb_weight *w, int64_t p, int64_t q, const ulb_acts *a, float *facc_p,
                         float *facc_q); /* 2-, 4- and 8-bit codes */
void ulb_panel_neon(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0, int nb,
                    float *facc, int32_t *dots);
void ulb_panel_dotprod(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0, int nb,
                       float *facc, int32_t *dots);
void ulb_panel_i8mm(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0, int nb,
                    float *facc, int32_t *dots);

/* Base-3 codes (format ternary_base3, src/base3.h), the same contract. */
void ulb_panel_base3_portable(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0,
                              int nb, float *facc, int32_t *dots);
void ulb_panel_base3_avx2(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0, int nb,
                          float *facc, int32_t *dots);
void ulb_panel_base3_avx512(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0, int nb,
                            float *facc, int32_t *dots); /* VBMI too */

void ulb_store_rows_ref(const ulb_out *o, const float *facc, int64_t n0, int nb, int64_t m0, int64_t rows);
void ulb_store_rows_avx512(const ulb_out *o, const float *facc, int64_t n0, int nb, int64_t m0, int64_t rows);

/* Best ISA this CPU supports (detected once, at load), whatever ULB_ISA or
 * ulb_isa_set chose. */
ulb_isa ulb_isa_best(void);

/* Whether this is an Intel CPU (detected once, on first use): where a kernel or
 * a prefetch distance was measured to pay off on one vendor only. */
int ulb_cpu_intel(void);

/* The CPUID family of an AMD CPU (0x19: Zen 3 and Zen 4, the latter running
 * AVX-512 in two 256-bit halves; 0x1a: Zen 5), 0 on other CPUs; detected
 * once. Where Zen 4 and Zen 5 were measured to differ. */
int ulb_cpu_amd_family(void);

/* The read probe's loop over `words` 8-byte words at q, read as `streams`
 * interleaved runs of ulb_probe_run_words words (a line of each in turn),
 * then the tail, prefetching dist bytes ahead of each (0: none): their sum
 * modulo 2^64 (probe.c). */
typedef uint64_t (*ulb_probe_sum_fn)(const uint64_t *q, int64_t words, int streams, int64_t dist);
uint64_t ulb_probe_sum_avx2(const uint64_t *q, int64_t words, int streams, int64_t dist);
static inline int64_t ulb_probe_run_words(int64_t words, int streams) { return words / streams / 8 * 8; }

/* Quantise one contiguous activation row to int8 and sum it per group:
 * q[k] for k < K, xsum[g] = sum of q over [g*group, min((g+1)*group, K)) for
 * g < ceil(K / group). Returns inv = 127/absmax, or NaN (q and xsum
 * untouched) if the row is not finite. Every ISA gives the same bits. */
typedef float (*ulb_quant_row_fn)(const void *x, ulb_dtype dt, int64_t K, int64_t group, int8_t *q, int32_t *xsum);
float ulb_quant_row_ref(const void *x, ulb_dtype dt, int64_t K, int64_t group, int8_t *q, int32_t *xsum);
float ulb_quant_row_avx2(const void *x, ulb_dtype dt, int64_t K, int64_t group, int8_t *q, int32_t *xsum);
float ulb_quant_row_avx512(const void *x, ulb_dtype dt, int64_t K, int64_t group, int8_t *q, int32_t *xsum);
float ulb_quant_row_neon(const void *x, ulb_dtype dt, int64_t K, int64_t group, int8_t *q, int32_t *xsum);
void ulb_quant_tail_ref(const void *x, ulb_dtype dt, int64_t k0, int64_t K, float inv, int8_t *q);
void ulb_group_sums_ref(const int8_t *q, int64_t K, int64_t group, int32_t *xsum);
ulb_quant_row_fn ulb_quant_row_for_isa(ulb_isa isa);

/* One-token 1-bit GEMV by table lookup (x86/lut1_avx512.c): tables of
 * ULB_LUT1_STEP_BYTES per 32 columns, built once per call; AVX-512 VBMI only,
 * where ulb_lut1_serves says. ulb_lut1_group_avx512 sums k-steps
 * [ks0, ks1) of one group whose codes start at `codes`. */
#define ULB_LUT1_STEP_BYTES 256
/* Tokens a call may take the LANES lookups for: their tables follow one
 * another in acts.lut1, ksteps * ULB_LUT1_STEP_BYTES each (x86/lut1_avx2.c). */
#define ULB_LUT1_MAX_TOKENS ULB_NB_MAX
typedef void (*ulb_lut1_build_fn)(const int8_t *xq, int64_t ksteps, uint8_t *lut);
void ulb_lut1_build_avx512(const int8_t *xq, int64_t ksteps, uint8_t *lut);
void ulb_lut1_group_avx512(const uint8_t *codes, int64_t ks0, int64_t ks1, int nt, const uint8_t *lut,
                           int64_t prefetch_dist, const uint8_t *prefetch_end, int32_t *acc);

/* The same over LANES tiles under AVX2 (x86/lut1_avx2.c), tables of the
 * same size in their own layout; kernels/ref/lut1_lanes_ref.c builds them in
 * plain C. ulb_lut1_lanes_group_avx2 writes acc[16t + r] like the AVX-512
 * one; the AVX2 and AVX-VNNI panel kernels take it where acts.lut1 is set on
 * a LANES blob (the AVX-512 one hands such blobs to them). */
void ulb_lut1_lanes_build_ref(const int8_t *xq, int64_t ksteps, uint8_t *lut);
void ulb_lut1_lanes_build_avx2(const int8_t *xq, int64_t ksteps, uint8_t *lut);
void ulb_lut1_lanes_group_avx2(const uint8_t *codes, int64_t ks0, int64_t ks1, int nt, const uint8_t *lut,
                               int64_t prefetch_dist, const uint8_t *prefetch_end, int32_t *acc);
/* The same through two full panels in lockstep (see ulb_panel_pair_fn). */
void ulb_lut1_lanes_pair_avx2(const uint8_t *codes_p, const uint8_t *codes_q, int64_t ks0, int64_t ks1,
                              const uint8_t *lut, int64_t prefetch_dist, const uint8_t *prefetch_end, int32_t *acc_p,
                              int32_t *acc_q);
/* The ARM lookup kernel (arm/lut1_neon.c), over VNNI or LANES tiles, tables
 * of ULB_LUT1_STEP_BYTES a k-step in their own layout: acc[16t + r] = row r
 * of tile t's dot over the `steps` k-steps of one group whose codes start at
 * `codes` (nt tiles a k-step) and whose tables start at `lut`; the first
 * pf_steps k-steps prefetch dist bytes ahead. */
void ulb_lut1_build_neon(const int8_t *xq, int64_t ksteps, uint8_t *lut);
void ulb_lut1_group_neon(const uint8_t *codes, int64_t steps, int64_t pf_steps, int nt, int lanes,
                         const uint8_t *lut, int64_t dist, int32_t *acc);
/* The table builder for one token on w under `isa`, or NULL where no lookup
 * kernel serves (ulb_lut1_serves aside). */
ulb_lut1_build_fn ulb_lut1_builder_for(const ulb_weight *w, ulb_isa isa);

/* Rows kernel of the one-token bf16 GEMV (src/gemv_bf16.c): out[r] = the
 * fp32 dot of row r of w (bf16, K columns, row stride ldw) with the K
 * contiguous bf16 activations x. Accumulation order: ref/gemv_bf16_ref.c. */
#define ULB_BF16_SETS 4
typedef void (*ulb_gemv_bf16_rows_fn)(const uint16_t *w, int64_t ldw, int64_t K, int64_t rows,
                                      const uint16_t *x, float *out);
void ulb_gemv_bf16_rows_ref(const uint16_t *w, int64_t ldw, int64_t K, int64_t rows, const uint16_t *x,
                            float *out);
void ulb_gemv_bf16_rows_avx512(const uint16_t *w, int64_t ldw, int64_t K, int64_t rows, const uint16_t *x,
                               float *out);
void ulb_gemv_bf16_rows2_avx512(const uint16_t *w, int64_t ldw, int64_t K, int64_t rows, const uint16_t *x,
                                float *out);
void ulb_gemv_bf16_rows_avx2(const uint16_t *w, int64_t ldw, int64_t K, int64_t rows, const uint16_t *x,
                             float *out);
void ulb_gemv_bf16_rows_neon(const uint16_t *w, int64_t ldw, int64_t K, int64_t rows, const uint16_t *x,
                             float *out);
ulb_gemv_bf16_rows_fn ulb_gemv_bf16_rows_for_isa(ulb_isa isa);

/* The kernel chosen for the active ISA (set once at load, or by ulb_isa_set):
 * for bit-field codes, and (ulb_panel_for) for the codes of w, base 3 too. */
ulb_panel_fn ulb_panel_for_isa(ulb_isa isa);
ulb_panel_fn ulb_panel_for(ulb_isa isa, const ulb_weight *w);
ulb_store_fn ulb_store_for_isa(ulb_isa isa);

/* Validated view of a blob, for the CPU kernels: ULB_ERR_LAYOUT for a
 * KMAJOR blob, whose body they cannot read. */
ulb_status ulb_weight_view(const uint8_t *blob, int64_t nbytes, ulb_weight *w);

/* The checksum a version-3 header holds for its blob (src/checksum.c); nbytes
 * is the blob's validated size. */
uint32_t ulb_blob_checksum(const uint8_t *blob, int64_t nbytes);

/* Thread pool: runs fn over [0, nwork) panels split across nthreads by the
 * scheduler table of `family`; fn(ctx, begin, end) per thread. */
typedef void (*ulb_range_fn)(void *ctx, int64_t begin, int64_t end);
/* Below this many weight bytes (x tokens) a second thread costs more than it saves. */
#define ULB_PARALLEL_MIN_BYTES (64 * 1024)
ulb_status ulb_parallel(int family, int nthreads, int64_t nwork, ulb_range_fn fn, void *ctx);
int ulb_sched_family(int bits, ulb_isa isa);
/* Spin-waiting for another thread of a job: `while (!done) ulb_spin_step(&w);`
 * after `ulb_spin_wait w = ulb_spin_start();`. It yields the CPU every few
 * microseconds, for where threads outnumber CPUs. */
typedef struct {
    double start_us;
    int spins;
} ulb_spin_wait;
ulb_spin_wait ulb_spin_start(void);
void ulb_spin_step(ulb_spin_wait *w);

void *ulb_aligned_alloc(size_t bytes);
void ulb_aligned_free(void *p);

#endif
