/* ulbtorch kernels: the C API every other layer calls.
 *
 * A weight matrix W is M x K (out_features x in_features). Each weight is an
 * unsigned code q of `bits` bits whose integer level is a*q + b (see
 * ulb_format_info); the real weight is scale * level, with one scale per row
 * and group of `group_size` consecutive input elements. Activations are
 * quantised per token to int8 (absmax), so every format reduces to one
 * integer dot product of levels with int8 activations per (row, group).
 *
 * A packed weight is one self-describing byte blob: a 64-byte header, then
 * the scales and codes interleaved in the panel layout of src/layout.h
 * (packed by src/format.c), then one line of zero padding. Every entry point
 * validates the header, so a blob of another format or shape is an error,
 * never garbage; the header's checksum over the whole blob (version 3) is
 * checked where a blob is read whole (ulb_blob_verify, ulb_unpack,
 * ulb_retile), so that damaged bytes on disk do not load as another weight.
 * Functions return ulb_status; nothing aborts. What only tests and
 * benchmarks call (probes, scheduler knobs) is in ulb_testing.h. */
#ifndef ULB_ULB_H
#define ULB_ULB_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    ULB_OK = 0,
    ULB_ERR_FORMAT,     /* unknown format id */
    ULB_ERR_SHAPE,      /* M, K, N or a buffer size is invalid */
    ULB_ERR_GROUP,      /* group size unsupported for this K */
    ULB_ERR_CODE,       /* a code is out of range for the format */
    ULB_ERR_BLOB,       /* packed blob header is corrupt or too small */
    ULB_ERR_DTYPE,      /* unsupported activation / output dtype */
    ULB_ERR_ISA,        /* requested ISA not available on this CPU */
    ULB_ERR_NOMEM,
    ULB_ERR_THREADS,
    ULB_ERR_SCALE,      /* a scale is NaN or infinite */
    ULB_ERR_BLOB_VERSION, /* packed blob of an older layout version */
    ULB_ERR_TILES,       /* tile order unknown, or not offered for this format */
    ULB_ERR_LAYOUT,      /* a KMAJOR (accelerator) blob handed to a CPU kernel */
    ULB_ERR_CHECKSUM     /* a blob's bytes do not match its header's checksum */
} ulb_status;

const char *ulb_status_str(ulb_status s);

/* ---- formats ----------------------------------------------------------- */

typedef enum {
    ULB_FMT_INT2 = 1,     /* levels {-2,-1,0,1}:  q - 2          */
    ULB_FMT_INT2_SYM = 2, /* levels {-3,-1,1,3}:  2q - 3 (= 2 x {-1.5,-0.5,0.5,1.5}) */
    ULB_FMT_TERNARY = 3,  /* levels {-1,0,1}:     q - 1, code 3 invalid */
    ULB_FMT_BINARY = 4,   /* levels {-1,1}:       2q - 1          */
    ULB_FMT_INT8 = 5,     /* levels -127..127:    q - 127, code 255 invalid (for layers kept near full
                           * precision, such as lm_head); ulb_pack, ulb_unpack and ulb_blob_verify
                           * refuse it (the kernels do not look: they would read it differently) */
    ULB_FMT_INT4 = 6,     /* levels -8..7:        q - 8 (llama.cpp's Q4_0 levels) */
    ULB_FMT_TERNARY_BASE3 = 7 /* levels {-1,0,1}: q - 1, five codes a byte (1.6 bits a weight, ULB_BASE3_BITS) */
} ulb_format;

/* The `bits` of a format whose codes (0..2) are not bit fields: five of them
 * make one byte, a base-3 number (src/base3.h says how), and a tile holds 16
 * rows x 20 columns. Not a width any bit-field kernel reads: base-3 formats
 * have kernels of their own (panel_base3*.c). */
#define ULB_BASE3_BITS 3

/* One row of the format table (src/format.c), the single source every layer
 * reads: Python reads it through ulb_format_at at import. A new level map at
 * an existing code width is one row there. */
typedef struct {
    int id;                /* the ulb_format value */
    const char *name;      /* "int2_sym" */
    int bits;              /* storage bits per code: 1, 2, 4 or 8; ULB_BASE3_BITS for five codes a byte */
    int level_a, level_b;  /* level = level_a * q + level_b */
    int max_code;          /* largest valid code */
    int tile_k;            /* input columns per tile (32 / bits; 20 for base 3): K pads to a multiple, group sizes are multiples */
    unsigned tiles;        /* bit (1u << t) set for each ulb_tiles order it may be packed in */
    const char *aliases;   /* comma-separated spellings of quantize_'s `bits` that choose it: "2"; "ternary,1.58"; "" for none */
    const char *bits_name; /* the `bits` a config of this format reports: "1", "ternary", "2" (both 2-bit maps), "4", "8" */
    const char *module;    /* the ulbtorch.nn class that holds it: "Linear2Bit" */
    int module_default;    /* 1 for the format that class builds when none is named */
} ulb_format_info;

/* Rows in the table. */
int ulb_format_count(void);
/* Row i in table order (0 <= i < ulb_format_count()), else NULL. */
const ulb_format_info *ulb_format_at(int i);
/* The row of format id `format`; NULL for an unknown one. */
const ulb_format_info *ulb_format_get(int format);
/* sizeof(ulb_format_info), so that a mirror of the struct (ctypes) can be checked. */
size_t ulb_format_info_size(void);

/* Rows of one panel: threads split work in whole panels. */
#define ULB_PANEL_ROWS 64
/* K is padded to a multiple of the format's tile_k columns; group sizes must
 * be multiples of the same. */

/* How the codes of a 64-byte tile of 16 rows are arranged (src/layout.h).
 * VNNI: byte 4l + b of row l, so that a field masked in place is a VNNI4
 * operand; every width. LANES (1-bit codes only): byte 16b + l, so that a
 * 128-bit lane holds one byte of each row and table lookups (vpshufb) serve a
 * whole lane; the AVX2 one-token kernel looks codes up this way, the other
 * SIMD kernels turn such a tile into VNNI order in registers (the portable
 * one in a copy; the scalar reference reads codes through layout.h).
 * KMAJOR is not a tile order but the accelerator layout of the whole body
 * (every format; same size): scales [n_groups][M_pad] fp32, then codes
 * [K_pad / tile_k][M_pad] as little-endian 32-bit words, field j of word
 * (s, m) holding code (m, s * tile_k + j), so that the GPU threads of one
 * k-step read adjacent rows' words (coalesced). The Triton kernels
 * (ulbtorch/triton/) read it; the CPU kernels refuse it (ULB_ERR_LAYOUT),
 * while pack, unpack and retile take it like the tile orders. */
typedef enum { ULB_TILES_VNNI = 0, ULB_TILES_LANES = 1, ULB_TILES_KMAJOR = 2 } ulb_tiles;
#define ULB_TILES_COUNT 3
#define ULB_TILES_PREFERRED (-1)
/* "vnni", "lanes", "kmajor"; NULL for another value. */
const char *ulb_tiles_name(int tiles);

typedef struct {
    uint32_t magic;   /* ULB_MAGIC */
    uint16_t version; /* ULB_BLOB_VERSION */
    uint8_t format;
    uint8_t tiles; /* ulb_tiles; 0 in every blob before LANES existed */
    int64_t M;
    int32_t K;
    uint32_t checksum;  /* version 3: of the whole blob (src/checksum.c); before, the high half of a 64-bit K: 0 */
    int64_t group_size; /* == K_pad for one group per row */
    int64_t n_groups;
    int64_t M_pad, K_pad;
    int64_t panels_bytes; /* scales and codes, from byte 64 on (src/layout.h) */
} ulb_header;

#define ULB_MAGIC 0x31424c55u /* "ULB1" little-endian */
#define ULB_BLOB_VERSION 3 /* 1: scales after all codes (refused); 2: no checksum (read, unchecked) */
#define ULB_HEADER_BYTES 64

/* The largest K (in_features) and M (out_features) a blob holds. K keeps
 * every kernel's int32 accumulators exact (see format.c). */
#define ULB_MAX_K (1LL << 16)
#define ULB_MAX_M (1LL << 26)

/* Size in bytes of the blob for these parameters; < 0 (a -ulb_status) when
 * they are invalid. group_size <= 0 or >= K means one group per row. */
int64_t ulb_packed_nbytes(int format, int64_t M, int64_t K, int64_t group_size);

/* codes: M x K uint8 with row stride ldc; scales: M x n_groups float32 (row
 * major). Writes the whole blob (nbytes from ulb_packed_nbytes), its tiles in
 * the order ulb_tiles_preferred gives. */
ulb_status ulb_pack(int format, int64_t M, int64_t K, int64_t group_size,
                    const uint8_t *codes, int64_t ldc, const float *scales,
                    uint8_t *blob, int64_t nbytes);
/* The same with the tile order named: a ulb_tiles, or ULB_TILES_PREFERRED.
 * Same size whatever the order. */
ulb_status ulb_pack_tiles(int format, int tiles, int64_t M, int64_t K, int64_t group_size,
                          const uint8_t *codes, int64_t ldc, const float *scales,
                          uint8_t *blob, int64_t nbytes);
/* The tile order whose kernels run `format` fastest under the active ISA:
 * LANES for 1-bit codes where AVX2 (without AVX-512) is active, else VNNI.
 * Blobs of either order run under every ISA. */
ulb_tiles ulb_tiles_preferred(int format);

/* Validates a blob's header (not its checksum: every call reads it) and returns it. */
ulb_status ulb_blob_header(const uint8_t *blob, int64_t nbytes, ulb_header *out);

/* Validates a whole blob, for loaders: its header, its checksum
 * (ULB_ERR_CHECKSUM), every code in range for the format (ULB_ERR_CODE) and
 * every scale finite (ULB_ERR_SCALE), as ulb_pack makes them. *checked
 * (may be NULL) is 1 where the blob carries a checksum, 0 for a version-2
 * blob, whose bytes no checksum vouches for. */
ulb_status ulb_blob_verify(const uint8_t *blob, int64_t nbytes, int *checked);

/* The blob in tile order `tiles` (a ulb_tiles or ULB_TILES_PREFERRED), into
 * out (nbytes, not overlapping blob): a byte permutation of each tile, for
 * blobs packed where another order was preferred, or the body rearranged
 * to or from KMAJOR, for a weight moved to or from an accelerator. */
ulb_status ulb_retile(const uint8_t *blob, int64_t nbytes, int tiles, uint8_t *out);

/* Inverse of ulb_pack: codes M x K (dense), scales M x n_groups. */
ulb_status ulb_unpack(const uint8_t *blob, int64_t nbytes, uint8_t *codes, float *scales);

/* ---- activations --------------------------------------------------------- */

typedef enum { ULB_DT_F32 = 0, ULB_DT_BF16 = 1 } ulb_dtype;

/* Per-token absmax int8 quantisation, BitNet's rule in fp32:
 *   inv = 127 / max(max|x|, 1e-5);  q = clamp(rint(x * inv), -128, 127)
 * x is N x K with strides (ldx, incx) in elements. Writes xq (N x K_pad,
 * zero padded), xscale[n] = 1 / inv, and xsum (N x n_groups): the sum of
 * xq over each group. */
ulb_status ulb_quantize_act(int64_t N, int64_t K, int64_t K_pad, int64_t group_size,
                            const void *x, ulb_dtype dt, int64_t ldx, int64_t incx,
                            int8_t *xq, float *xscale, int32_t *xsum);

/* ---- linear -------------------------------------------------------------- */

/* y[n, m] = xscale[n] * sum_g scale[m, g] * dot_g(level[m, :], xq[n, :]) + bias[m]
 * x: N x K with strides (ldx, incx); y: N x M contiguous rows of stride ldy;
 * bias may be NULL. nthreads <= 0 means 1. */
ulb_status ulb_linear(const uint8_t *blob, int64_t nbytes, int64_t N,
                      const void *x, ulb_dtype x_dt, int64_t ldx, int64_t incx,
                      const void *bias, ulb_dtype bias_dt,
                      void *y, ulb_dtype y_dt, int64_t ldy, int nthreads);

/* One layer of ulb_linear_many: ulb_linear's arguments for one weight. */
typedef struct {
    const uint8_t *blob;
    int64_t nbytes, N;
    const void *x;
    int64_t ldx, incx;
    const void *bias; /* or NULL */
    void *y;
    int64_t ldy;
} ulb_linear_args;

/* count layers in one parallel region, each computed as ulb_linear computes
 * it, to the bit: their panels are split over the threads as one weight's
 * are, so the pool forks and joins once, and each thread's stream runs on
 * from one weight into the next. For the experts a token visits, which are
 * too small to stream well one call each. Dtypes are shared by all layers;
 * the split follows the first non-empty layer's kernel family. */
ulb_status ulb_linear_many(const ulb_linear_args *layers, int count, ulb_dtype x_dt, ulb_dtype bias_dt,
                           ulb_dtype y_dt, int nthreads);

/* One token through a plain bf16 weight w (M x K, row stride ldw >= K) and
 * bf16 activations x: y[m] = sum_k w[m,k] x[k*incx] (+ bias[m]) in fp32, in
 * the accumulation order of kernels/ref/gemv_bf16_ref.c, rounded once to
 * y_dt. For the layers left in bf16 (lm_head), which PyTorch's N = 1 bf16
 * F.linear reads well below DRAM speed on CPUs without AMX. */
ulb_status ulb_gemv_bf16(const uint16_t *w, int64_t M, int64_t K, int64_t ldw, const uint16_t *x, int64_t incx,
                         const void *bias, ulb_dtype bias_dt, void *y, ulb_dtype y_dt, int nthreads);
/* 1 where ulb_gemv_bf16 runs a vector kernel under `isa` (AVX2 and up), 0
 * where it runs the reference's rows, which callers leave to F.linear. */
int ulb_gemv_bf16_native(int isa);

/* ---- ISA ----------------------------------------------------------------- */

/* AVXVNNI: the AVX2 kernels with AVX-VNNI's vpdpbusd (Intel client cores
 * without AVX-512); preferred to AVX2, AVX-512 to both. AMX: the AVX-512
 * kernels, and calls of 16 tokens or more (prefill) on AMX's int8 tiles
 * (Intel Xeon from Sapphire Rapids on), preferred to AVX-512. On AArch64
 * (kernels/arm): NEON, the ARMv8.0 kernels every such CPU runs; DOTPROD, with
 * FEAT_DotProd's sdot (Cortex-A76, Neoverse N1, Apple M1 on); I8MM, those and
 * FEAT_I8MM's usdot and smmla/usmmla for several tokens (Neoverse V1/N2,
 * Apple M2 on), each preferred to the one before, as the kernel's HWCAPs
 * say. PORTABLE: plain C that the compiler vectorises (src/panel_portable.c),
 * on every CPU; the default where none of the SIMD kernels runs. SCALAR: the
 * reference. */
typedef enum {
    ULB_ISA_SCALAR = 0,
    ULB_ISA_AVX2 = 1,
    ULB_ISA_AVX512 = 2,
    ULB_ISA_AVXVNNI = 3,
    ULB_ISA_PORTABLE = 4,
    ULB_ISA_AMX = 5,
    ULB_ISA_NEON = 6,
    ULB_ISA_DOTPROD = 7,
    ULB_ISA_I8MM = 8
} ulb_isa;
#define ULB_ISA_COUNT 9

/* Best ISA this CPU supports, or the one named by env ULB_ISA at load. */
ulb_isa ulb_isa_active(void);
int ulb_isa_supported(ulb_isa isa);
ulb_status ulb_isa_set(ulb_isa isa);
const char *ulb_isa_name(ulb_isa isa);

/* The 1-bit GEMVs by table lookup (after T-MAC). Under AVX2 (AVX-VNNI and
 * AVX-512 CPUs too), over LANES tiles, any thread count, up to 4 tokens,
 * faster than masking in cache and from DRAM. Under AVX-512 VBMI, over VNNI
 * tiles, one token on one thread: faster in cache, but from DRAM only on
 * some CPUs (not Zen 5, whose full-width vpdpbusd runs the masking kernel
 * faster than one core streams, while tables past K = 2048 spill its L1).
 * Under the ARM ISAs, with NEON's tbl (arm/lut1_neon.c), over either tile
 * order, any thread count: one token under I8MM and over VNNI tiles under
 * DOTPROD, up to 4 under NEON and over LANES tiles under DOTPROD, where that
 * takes fewer instructions than masking (benchmarks/insn_per_weight.py).
 * ulb_lut1_set(mode): ULB_LUT1_AUTO, the default, takes the lookups where
 * they pay (LANES tiles; VNNI tiles on Intel and Zen 4; as above on ARM);
 * ULB_LUT1_ON wherever one can run (tests; on ARM up to 4 tokens under every
 * ISA); ULB_LUT1_OFF never, the masking kernels serve.
 * ULB_ERR_SHAPE for another mode. Env ULB_LUT1=0|1|auto at load.
 * ulb_lut1_available: whether either kernel runs under `isa` on this CPU;
 * ulb_lut1_serves: whether a 1-bit call of `ntokens` tokens on `nthreads`
 * threads over `tiles` (ulb_tiles) takes one under `isa`, as the setting
 * stands. */
#define ULB_LUT1_OFF 0
#define ULB_LUT1_ON 1
#define ULB_LUT1_AUTO (-1)
ulb_status ulb_lut1_set(int mode);
int ulb_lut1_get(void);
int ulb_lut1_available(ulb_isa isa);
int ulb_lut1_serves(int tiles, int64_t ntokens, int nthreads, ulb_isa isa);

/* How far ahead of the codes it reads a microkernel prefetches into L2, per
 * code width (bits 1, 2, 4 or 8): a distance in bytes (a multiple of 64 up
 * to 1 MiB; 0 = no software prefetch, the hardware prefetcher alone) or
 * ULB_PREFETCH_AUTO, the default, which picks one per call by CPU vendor,
 * active ISA, thread count and group length (kernels/src/prefetch.c gives
 * the rule). A speed setting only: results are the same bits
 * whatever it is. Env ULB_PREFETCH_1BIT, _2BIT, _4BIT, _8BIT (bytes or
 * "auto") set it at load. ulb_prefetch_set returns ULB_ERR_SHAPE for another
 * value, ulb_prefetch_get for a NULL bytes, and both ULB_ERR_FORMAT for
 * another width. ulb_prefetch_resolve gives the distance a call would use:
 * nthreads threads, group_code_bytes of codes in one group of one 64-row
 * panel; 0 for another width. */
#define ULB_PREFETCH_AUTO (-1)
#define ULB_PREFETCH_MAX (1 << 20) /* the largest distance */
ulb_status ulb_prefetch_get(int bits, int64_t *bytes);
ulb_status ulb_prefetch_set(int bits, int64_t bytes);
int64_t ulb_prefetch_resolve(int bits, int nthreads, int64_t group_code_bytes);

/* ---- threads & scheduler -------------------------------------------------- */

/* Parallel regions run on ulbtorch's own pool unless the host registers a
 * runner: runner(n, task, ctx) must call task(ctx, tid) once for every tid in
 * [0, n), on as many threads as it likes. PyTorch's wrapper registers
 * at::parallel_for so that one OpenMP runtime serves the whole process: a
 * second pool's threads would be time-sliced against OpenMP workers that
 * spin after each torch op. NULL restores the built-in pool. */
typedef void (*ulb_task_fn)(void *ctx, int tid);
typedef void (*ulb_runner_fn)(int n, ulb_task_fn task, void *ctx);
void ulb_set_parallel_runner(ulb_runner_fn runner);

#define ULB_MAX_THREADS 64

/* How long the pool's idle workers spin before they sleep (microseconds), as
 * ULB_SPIN_US gives it now: a number from 0 to 1e6, else 200. The pool reads
 * the variable once, at its first job. *env_accepted (if not NULL): 0 when
 * ULB_SPIN_US is set to anything else. */
double ulb_spin_us(int *env_accepted);

typedef struct {
    int nthreads;          /* threads of the last call */
    int64_t calls;         /* calls recorded */
    double ratio[ULB_MAX_THREADS];   /* share of work per thread (sums to 1) */
    double last_us[ULB_MAX_THREADS]; /* each thread's time in the last call */
    int64_t last_panels[ULB_MAX_THREADS];
} ulb_sched_stats;

/* One performance table per kernel family (format bits x ISA; bits 16: ulb_gemv_bf16;
 * bits 0: ulb_read_probe of ulb_testing.h, whatever the ISA). A thread's last_us runs from the
 * job's publication to the end of its share, so the largest of them is the
 * call's time inside its parallel region (calls on one thread record nothing). */
ulb_status ulb_sched_stats_get(int bits, ulb_isa isa, ulb_sched_stats *out);
void ulb_sched_reset(void);

/* ---- constants ------------------------------------------------------------ */

/* The macros of ulb.h and ulb_testing.h as values, for callers that cannot
 * read a header (Python's ctypes). */
typedef struct {
    int64_t max_m, max_k;          /* ULB_MAX_M, ULB_MAX_K */
    int max_threads;               /* ULB_MAX_THREADS */
    int panel_rows;                /* ULB_PANEL_ROWS */
    int isa_count;                 /* ULB_ISA_COUNT (names: ulb_isa_name) */
    int tiles_count;               /* ULB_TILES_COUNT, the number of ulb_tiles orders */
    int tiles_preferred;           /* ULB_TILES_PREFERRED */
    int lut1_off, lut1_on, lut1_auto; /* ULB_LUT1_OFF, _ON, _AUTO */
    int64_t prefetch_auto, prefetch_max; /* ULB_PREFETCH_AUTO, ULB_PREFETCH_MAX */
    int probe_max_streams;         /* ULB_PROBE_MAX_STREAMS */
    double slowdown_max;           /* ULB_SLOWDOWN_MAX */
    int base3_bits;                /* ULB_BASE3_BITS */
} ulb_constants;

void ulb_constants_get(ulb_constants *out);
/* sizeof(ulb_constants), so that a mirror of the struct can be checked. */
size_t ulb_constants_size(void);

#ifdef __cplusplus
}
#endif
#endif
