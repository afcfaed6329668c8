/* Formats, the packed blob (header, panels of scales and codes, padding),
 * packing and unpacking. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stddef.h>
#include <string.h>

#include "internal.h"

/* The format table: one row a level map. Ids are stored in blobs, so a row
 * keeps its id for good. A new level map at an existing code width needs only
 * its row here: the kernels read bits, level_a (1 or 2: gemm_amx.c adds the
 * codes once or twice) and level_b. The first row's width leads the
 * ULB_ERR_GROUP message. */
#define VNNI (1u << ULB_TILES_VNNI)
#define LANES (1u << ULB_TILES_LANES)
#define KMAJOR (1u << ULB_TILES_KMAJOR) /* the accelerator layout: every format */
#define FORMAT(id, name, bits, a, b, max_code, tiles, aliases, bits_name, module, module_default) \
    {id, name, bits, a, b, max_code, ULB_TILE_K(bits), tiles, aliases, bits_name, module, module_default}
static const ulb_format_info FORMATS[] = {
    FORMAT(ULB_FMT_INT2, "int2", 2, 1, -2, 3, VNNI | KMAJOR, "", "2", "Linear2Bit", 0),
    FORMAT(ULB_FMT_INT2_SYM, "int2_sym", 2, 2, -3, 3, VNNI | KMAJOR, "2", "2", "Linear2Bit", 1),
    FORMAT(ULB_FMT_TERNARY, "ternary", 2, 1, -1, 2, VNNI | KMAJOR, "ternary,1.58", "ternary", "LinearTernary", 1),
    FORMAT(ULB_FMT_BINARY, "binary", 1, 2, -1, 1, VNNI | LANES | KMAJOR, "1", "1", "Linear1Bit", 1),
    FORMAT(ULB_FMT_INT8, "int8", 8, 1, -127, 254, VNNI | KMAJOR, "8", "8", "Linear8Bit", 1),
    FORMAT(ULB_FMT_INT4, "int4", 4, 1, -8, 15, VNNI | KMAJOR, "4", "4", "Linear4Bit", 1),
    /* Not chosen by any `bits`: only by name, beside the 2-bit ternary (docs/formats.md says when it is faster). */
    FORMAT(ULB_FMT_TERNARY_BASE3, "ternary_base3", ULB_BASE3_BITS, 1, -1, 2, VNNI, "", "ternary", "LinearTernary", 0),
};
#undef FORMAT
#define NFORMATS ((int)(sizeof FORMATS / sizeof FORMATS[0]))

int ulb_format_count(void) { return NFORMATS; }

const ulb_format_info *ulb_format_at(int i) { return i >= 0 && i < NFORMATS ? &FORMATS[i] : NULL; }

const ulb_format_info *ulb_format_get(int format) {
    for (int i = 0; i < NFORMATS; i++)
        if (FORMATS[i].id == format) return &FORMATS[i];
    return NULL;
}

size_t ulb_format_info_size(void) { return sizeof(ulb_format_info); }

const char *ulb_tiles_name(int tiles) {
    switch (tiles) {
    case ULB_TILES_VNNI: return "vnni";
    case ULB_TILES_LANES: return "lanes";
    case ULB_TILES_KMAJOR: return "kmajor";
    }
    return NULL;
}

/* The messages that name the table's tile widths and tile orders, written
 * from it once. */
static char group_msg[192], tiles_msg[192];
static pthread_once_t msgs_once = PTHREAD_ONCE_INIT;

static void msgs_init(void) {
    /* "a positive multiple of 16 (32 for 1-bit, 8 for 4-bit, 4 for 8-bit)":
     * the first row's width, then each other code width, narrowest first. */
    int n = snprintf(group_msg, sizeof group_msg, "group size must be a positive multiple of %d",
                     FORMATS[0].tile_k);
    const char *sep = " (";
    static const int widths[] = {1, 2, 4, 8, ULB_BASE3_BITS}; /* narrowest first, then base 3 */
    for (int w = 0; w < (int)(sizeof widths / sizeof widths[0]); w++) {
        const int bits = widths[w];
        int found = 0;
        for (int i = 0; i < NFORMATS; i++) found |= FORMATS[i].bits == bits && bits != FORMATS[0].bits;
        if (!found) continue;
        if (bits == ULB_BASE3_BITS)
            n += snprintf(group_msg + n, sizeof group_msg - n, "%s%d for base 3", sep, ULB_TILE_K(bits));
        else
            n += snprintf(group_msg + n, sizeof group_msg - n, "%s%d for %d-bit", sep, ULB_TILE_K(bits), bits);
        sep = ", ";
    }
    snprintf(group_msg + n, sizeof group_msg - n, "%s, or cover all of K", *sep == ',' ? ")" : "");
    /* "tile order unknown, or not offered for this format (lanes: binary)":
     * the formats of each order that not every format offers. */
    n = snprintf(tiles_msg, sizeof tiles_msg, "tile order unknown, or not offered for this format");
    sep = " (";
    for (int t = 0; t < ULB_TILES_COUNT; t++) {
        int all = 1;
        for (int i = 0; i < NFORMATS; i++) all &= (int)(FORMATS[i].tiles >> t) & 1;
        if (all) continue;
        n += snprintf(tiles_msg + n, sizeof tiles_msg - n, "%s%s:", sep, ulb_tiles_name(t));
        for (int i = 0, first = 1; i < NFORMATS; i++)
            if (FORMATS[i].tiles >> t & 1) {
                n += snprintf(tiles_msg + n, sizeof tiles_msg - n, "%s%s", first ? " " : ", ", FORMATS[i].name);
                first = 0;
            }
        sep = "; ";
    }
    if (*sep == ';') snprintf(tiles_msg + n, sizeof tiles_msg - n, ")");
}

const char *ulb_status_str(ulb_status s) {
    switch (s) {
    case ULB_OK: return "ok";
    case ULB_ERR_FORMAT: return "unknown weight format";
    case ULB_ERR_SHAPE: return "invalid shape or buffer size";
    case ULB_ERR_GROUP: pthread_once(&msgs_once, msgs_init); return group_msg;
    case ULB_ERR_CODE: return "weight code out of range for the format";
    case ULB_ERR_BLOB: return "not a valid ulbtorch packed weight (bad header or size)";
    case ULB_ERR_DTYPE: return "unsupported dtype";
    case ULB_ERR_ISA: return "ISA not supported on this CPU";
    case ULB_ERR_NOMEM: return "out of memory";
    case ULB_ERR_THREADS: return "invalid thread count";
    case ULB_ERR_SCALE: return "scale is NaN or infinite";
    case ULB_ERR_BLOB_VERSION:
        return "packed weight made by an older ulbtorch (blob layout version 1); pack it again with this version";
    case ULB_ERR_TILES: pthread_once(&msgs_once, msgs_init); return tiles_msg;
    case ULB_ERR_LAYOUT:
        return "packed weight in the accelerator layout (kmajor), which the CPU kernels do not read; "
               "move the layer to the CPU (layer.cpu()) or retile the blob to vnni";
    case ULB_ERR_CHECKSUM:
        return "packed weight damaged: its bytes do not match the checksum in its header";
    }
    return "unknown error";
}

/* ULB_MAX_K: accumulators are int32: the one-token AVX-512 kernel (and its
 * several-token tokens_group_slots) keeps 64 * sum q x per group for 2-bit
 * codes (64 * 3 * 128 * 65536 < 2^31) and 16 * sum q x for 4-bit codes
 * (16 * 15 * 128 * 65536 < 2^31), and |sum q x| of 8-bit codes stays at most
 * 254 * 128 * 65536 < 2^31 (activations are -127..127 from ulb_quantize_act;
 * int_dots takes -128 too). geometry() holds M and K to these limits. */

typedef struct {
    int64_t group_size, n_groups, M_pad, K_pad, panels_bytes, total;
    ulb_layout layout;
} blob_geometry;

/* After the panels: one line a kernel may read past its last tile. */
#define ULB_TAIL_BYTES 64

/* Whether `format` may be packed in tile order `tiles`. */
static int tiles_offered(const ulb_format_info *fi, int tiles) {
    return tiles >= 0 && tiles < ULB_TILES_COUNT && (fi->tiles >> tiles & 1);
}

static ulb_status geometry(int format, int tiles, int64_t M, int64_t K, int64_t group_size,
                           blob_geometry *g) {
    const ulb_format_info *fi = ulb_format_get(format);
    if (!fi) return ULB_ERR_FORMAT;
    if (!tiles_offered(fi, tiles)) return ULB_ERR_TILES;
    if (M <= 0 || K <= 0 || M > ULB_MAX_M || K > ULB_MAX_K) return ULB_ERR_SHAPE;
    g->M_pad = ulb_round_up(M, ULB_TILE);
    g->K_pad = ulb_round_up(K, fi->tile_k);
    if (group_size <= 0 || group_size >= K) {
        g->group_size = g->K_pad;
    } else {
        if (group_size % fi->tile_k) return ULB_ERR_GROUP;
        g->group_size = group_size;
    }
    g->n_groups = (g->K_pad + g->group_size - 1) / g->group_size;
    const int64_t ksteps = g->K_pad / fi->tile_k;
    g->layout = (ulb_layout){fi->bits, tiles, g->M_pad, ksteps, g->group_size / fi->tile_k, g->n_groups};
    g->panels_bytes = (g->M_pad / ULB_TILE) * (g->n_groups * ULB_TILE_SCALE_BYTES + ksteps * ULB_TILE_BYTES);
    g->total = ULB_HEADER_BYTES + g->panels_bytes + ULB_TAIL_BYTES;
    return ULB_OK;
}

int64_t ulb_packed_nbytes(int format, int64_t M, int64_t K, int64_t group_size) {
    blob_geometry g;
    ulb_status st = geometry(format, ULB_TILES_VNNI, M, K, group_size, &g);
    return st == ULB_OK ? g.total : -(int64_t)st;
}

/* Under AVX2 the lookups of LANES tiles (x86/lut1_avx2.c) run 1-bit codes
 * faster than masking VNNI tiles; AVX-512 has its own lookups of VNNI tiles
 * (x86/lut1_avx512.c), and other ISAs read VNNI tiles directly. */
ulb_tiles ulb_tiles_preferred(int format) {
    const ulb_format_info *fi = ulb_format_get(format);
    const ulb_isa isa = ulb_isa_active();
    return fi && tiles_offered(fi, ULB_TILES_LANES) && (isa == ULB_ISA_AVX2 || isa == ULB_ISA_AVXVNNI)
               ? ULB_TILES_LANES
               : ULB_TILES_VNNI;
}

/* A blob written here made current: version 3, its checksum over the rest. */
static void seal(uint8_t *blob, int64_t nbytes) {
    const uint16_t version = ULB_BLOB_VERSION;
    memcpy(blob + offsetof(ulb_header, version), &version, sizeof version);
    const uint32_t sum = ulb_blob_checksum(blob, nbytes);
    memcpy(blob + offsetof(ulb_header, checksum), &sum, sizeof sum);
}

/* Whether a validated blob's bytes match its checksum; a version-2 blob has none to match. */
static int checksum_ok(const uint8_t *blob, int64_t nbytes, const ulb_header *h) {
    return h->version < 3 || ulb_blob_checksum(blob, nbytes) == h->checksum;
}

/* Every code byte of the panels at p (layout L, base 3) from the V it holds
 * to its stored form (base3.h): the tiles of each group of each panel. */
static void encode_base3(const ulb_layout *L, uint8_t *p) {
    for (int64_t pi = 0; pi * ULB_PANEL_TILES * ULB_TILE < L->M_pad; pi++) {
        const int nt = ulb_panel_ntiles(L->M_pad, pi);
        for (int64_t gi = 0; gi < L->n_groups; gi++) {
            const int64_t left = L->ksteps - gi * L->gsteps, steps = left < L->gsteps ? left : L->gsteps;
            uint8_t *codes = p + ulb_panel_offset(L->ksteps, L->n_groups, pi) + ulb_group_offset(nt, L->gsteps, gi) +
                             nt * ULB_TILE_SCALE_BYTES;
            for (int64_t i = 0; i < steps * nt * ULB_TILE_BYTES; i++) codes[i] = ulb_base3_byte(codes[i]);
        }
    }
}

ulb_status ulb_pack(int format, int64_t M, int64_t K, int64_t group_size,
                    const uint8_t *codes, int64_t ldc, const float *scales,
                    uint8_t *blob, int64_t nbytes) {
    return ulb_pack_tiles(format, ULB_TILES_PREFERRED, M, K, group_size, codes, ldc, scales, blob, nbytes);
}

ulb_status ulb_pack_tiles(int format, int tiles, int64_t M, int64_t K, int64_t group_size,
                          const uint8_t *codes, int64_t ldc, const float *scales,
                          uint8_t *blob, int64_t nbytes) {
    if (tiles == ULB_TILES_PREFERRED) tiles = ulb_tiles_preferred(format);
    blob_geometry g;
    ulb_status st = geometry(format, tiles, M, K, group_size, &g);
    if (st != ULB_OK) return st;
    if (nbytes != g.total || ldc < K || !codes || !scales || !blob) return ULB_ERR_SHAPE;
    const ulb_format_info *fi = ulb_format_get(format);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < K; k++)
            if (codes[m * ldc + k] > fi->max_code) return ULB_ERR_CODE;
        for (int64_t gi = 0; gi < g.n_groups; gi++)
            if (!isfinite(scales[m * g.n_groups + gi])) return ULB_ERR_SCALE;
    }

    memset(blob, 0, (size_t)nbytes);
    ulb_header h = {ULB_MAGIC, ULB_BLOB_VERSION, (uint8_t)format, (uint8_t)tiles, M, (int32_t)K, 0,
                    g.group_size, g.n_groups, g.M_pad, g.K_pad, g.panels_bytes};
    memcpy(blob, &h, sizeof h);

    uint8_t *panels = blob + ULB_HEADER_BYTES;
    static const uint8_t pow3[ULB_BASE3_DIGITS] = {81, 27, 9, 3, 1};
    const int base3 = fi->bits == ULB_BASE3_BITS;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < K; k++) {
            int64_t byte;
            int shift;
            ulb_code_pos(&g.layout, m, k, &byte, &shift);
            /* Base 3: the byte sums V here (padding: code 0), encode_base3 writes it after. */
            panels[byte] += base3 ? (uint8_t)(codes[m * ldc + k] * pow3[shift]) : (uint8_t)(codes[m * ldc + k] << shift);
        }
        for (int64_t gi = 0; gi < g.n_groups; gi++)
            memcpy(panels + ulb_scale_pos(&g.layout, m, gi), &scales[m * g.n_groups + gi], sizeof(float));
    }
    if (base3) encode_base3(&g.layout, panels);
    seal(blob, nbytes);
    return ULB_OK;
}

ulb_status ulb_blob_header(const uint8_t *blob, int64_t nbytes, ulb_header *out) {
    if (!blob || nbytes < ULB_HEADER_BYTES) return ULB_ERR_BLOB;
    ulb_header h;
    memcpy(&h, blob, sizeof h);
    if (h.magic != ULB_MAGIC) return ULB_ERR_BLOB;
    if (h.version == 1) return ULB_ERR_BLOB_VERSION;
    /* Version 2 held K in 64 bits: the checksum's bytes were its high half, 0. */
    if ((h.version == 2 && h.checksum != 0) || h.version < 2 || h.version > ULB_BLOB_VERSION) return ULB_ERR_BLOB;
    blob_geometry g;
    const int64_t gs_arg = h.group_size >= h.K_pad ? 0 : h.group_size;
    if (geometry(h.format, h.tiles, h.M, h.K, gs_arg, &g) != ULB_OK) return ULB_ERR_BLOB;
    if (g.group_size != h.group_size || g.n_groups != h.n_groups || g.M_pad != h.M_pad ||
        g.K_pad != h.K_pad || g.panels_bytes != h.panels_bytes || g.total != nbytes)
        return ULB_ERR_BLOB;
    *out = h;
    return ULB_OK;
}

/* The view of a blob of any layout: pack's inverse and retile read KMAJOR too. */
static ulb_status any_weight_view(const uint8_t *blob, int64_t nbytes, ulb_weight *w) {
    ulb_header h;
    ulb_status st = ulb_blob_header(blob, nbytes, &h);
    if (st != ULB_OK) return st;
    const ulb_format_info *fi = ulb_format_get(h.format);
    w->bits = fi->bits;
    w->tiles = h.tiles;
    w->level_a = fi->level_a;
    w->level_b = fi->level_b;
    w->M = h.M;
    w->K = h.K;
    w->M_pad = h.M_pad;
    w->K_pad = h.K_pad;
    w->n_groups = h.n_groups;
    w->ksteps = h.K_pad / fi->tile_k;
    w->gsteps = h.group_size / fi->tile_k;
    w->panels = blob + ULB_HEADER_BYTES;
    return ULB_OK;
}

ulb_status ulb_weight_view(const uint8_t *blob, int64_t nbytes, ulb_weight *w) {
    const ulb_status st = any_weight_view(blob, nbytes, w);
    return st == ULB_OK && w->tiles == ULB_TILES_KMAJOR ? ULB_ERR_LAYOUT : st;
}

/* Every code and scale moved one at a time through layout.h: the retile to or
 * from KMAJOR, whose body is not a permutation of each tile. */
static void relayout(const ulb_weight *w, const uint8_t *src, int tiles, uint8_t *dst) {
    const ulb_layout from = ulb_weight_layout(w);
    ulb_layout to = from;
    to.tiles = tiles;
    memset(dst, 0, (size_t)(from.n_groups * from.M_pad * 4 + from.ksteps * from.M_pad * 4));
    for (int64_t m = 0; m < w->M; m++) {
        for (int64_t k = 0; k < w->K; k++) {
            int64_t byte;
            int shift;
            ulb_code_pos(&to, m, k, &byte, &shift);
            dst[byte] |= (uint8_t)(ulb_code_get(src, &from, m, k) << shift);
        }
        for (int64_t g = 0; g < w->n_groups; g++)
            memcpy(dst + ulb_scale_pos(&to, m, g), src + ulb_scale_pos(&from, m, g), sizeof(float));
    }
}

/* Every tile of every group of every panel of w (the blob `blob`), in
 * stream order, from its tile order into `tiles` at out. */
static void permute_tiles(const ulb_weight *w, const uint8_t *blob, int tiles, uint8_t *out) {
    for (int64_t p = 0; p < ulb_weight_npanels(w); p++) {
        const int nt = ulb_panel_ntiles(w->M_pad, p);
        for (int64_t gi = 0; gi < w->n_groups; gi++) {
            const int64_t steps = ulb_group_steps(w, gi);
            const int64_t codes = ulb_group_base(w, p, nt, gi) + nt * ULB_TILE_SCALE_BYTES - blob;
            for (int64_t t = 0; t < steps * nt; t++) {
                const uint8_t *src = blob + codes + t * ULB_TILE_BYTES;
                uint8_t *dst = out + codes + t * ULB_TILE_BYTES;
                for (int l = 0; l < ULB_TILE; l++)
                    for (int b = 0; b < 4; b++) dst[ulb_tile_byte(tiles, l, b)] = src[ulb_tile_byte(w->tiles, l, b)];
            }
        }
    }
}

ulb_status ulb_retile(const uint8_t *blob, int64_t nbytes, int tiles, uint8_t *out) {
    ulb_weight w;
    ulb_status st = any_weight_view(blob, nbytes, &w);
    if (st != ULB_OK) return st;
    if (!out || (out < blob + nbytes && blob < out + nbytes)) return ULB_ERR_SHAPE;
    ulb_header h;
    ulb_blob_header(blob, nbytes, &h);
    /* The new blob gets a checksum of its own: it must not vouch for damaged bytes. */
    if (!checksum_ok(blob, nbytes, &h)) return ULB_ERR_CHECKSUM;
    const int format = h.format;
    if (tiles == ULB_TILES_PREFERRED) tiles = ulb_tiles_preferred(format);
    if (!tiles_offered(ulb_format_get(format), tiles)) return ULB_ERR_TILES;
    memcpy(out, blob, (size_t)nbytes);
    out[offsetof(ulb_header, tiles)] = (uint8_t)tiles;
    if (tiles != w.tiles && (tiles == ULB_TILES_KMAJOR || w.tiles == ULB_TILES_KMAJOR))
        relayout(&w, blob + ULB_HEADER_BYTES, tiles, out + ULB_HEADER_BYTES);
    else if (tiles != w.tiles)
        permute_tiles(&w, blob, tiles, out);
    seal(out, nbytes);
    return ULB_OK;
}

/* The view and header of a blob of any layout whose bytes match its checksum. */
static ulb_status checked_view(const uint8_t *blob, int64_t nbytes, ulb_weight *w, ulb_header *h) {
    const ulb_status st = any_weight_view(blob, nbytes, w);
    if (st != ULB_OK) return st;
    ulb_blob_header(blob, nbytes, h);
    return checksum_ok(blob, nbytes, h) ? ULB_OK : ULB_ERR_CHECKSUM;
}

static ulb_status body_values_ok(const ulb_weight *w, unsigned max_code);

ulb_status ulb_unpack(const uint8_t *blob, int64_t nbytes, uint8_t *codes, float *scales) {
    ulb_weight w;
    ulb_header h;
    ulb_status st = checked_view(blob, nbytes, &w, &h);
    if (st != ULB_OK) return st;
    const unsigned max_code = (unsigned)ulb_format_get(h.format)->max_code;
    /* Base 3: every digit is in range, but a byte pack cannot write must not load either. */
    if (w.bits == ULB_BASE3_BITS && (st = body_values_ok(&w, max_code)) != ULB_OK) return st;
    const ulb_layout L = ulb_weight_layout(&w);
    for (int64_t m = 0; m < w.M; m++) {
        for (int64_t k = 0; k < w.K; k++) {
            const unsigned c = ulb_code_get(w.panels, &L, m, k);
            if (c > max_code) return ULB_ERR_CODE;
            codes[m * w.K + k] = (uint8_t)c;
        }
        for (int64_t g = 0; g < w.n_groups; g++) {
            scales[m * w.n_groups + g] = ulb_scale_get(w.panels, &L, m, g);
            if (!isfinite(scales[m * w.n_groups + g])) return ULB_ERR_SCALE;
        }
    }
    return ULB_OK;
}

/* Bit 0 of each `bits`-wide field of w (bits a power of two) is set where
 * the whole field is ones: the AND of the field's halves, then quarters, ... */
static inline uint64_t all_ones_fields(uint64_t w, int bits) {
    for (int s = 1; s < bits; s <<= 1) w &= w >> s;
    return w;
}

/* Whether a word-aligned run of n bytes (a multiple of 8) holds a field of
 * all ones; inlined with `bits` a constant, the loop vectorises. */
static inline int any_all_ones(const uint8_t *p, int64_t n, int bits) {
    uint64_t field_lsb = 0, bad = 0;
    for (int j = 0; j < 64; j += bits) field_lsb |= 1ull << j;
    for (int64_t i = 0; i < n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, sizeof w);
        bad |= all_ones_fields(w, bits);
    }
    return (bad & field_lsb) != 0;
}

/* Whether n bytes (a multiple of 8: whole tiles, or KMAJOR's words) of codes
 * `bits` wide hold none above max_code (base 3: only canonical bytes). Where only the all-ones code is
 * invalid (ternary's 3, int8's 255), 8 bytes at a time; other limits through
 * a table of the bytes that hold a code out of range; a width whose every
 * code is valid needs no look. */
static int codes_in_range(const uint8_t *p, int64_t n, int bits, unsigned max_code) {
    if (bits == ULB_BASE3_BITS) {
        unsigned bad = 0;
        for (int64_t i = 0; i < n; i++) bad |= !ulb_base3_canonical(p[i]);
        return !bad;
    }
    const unsigned mask = (1u << bits) - 1u;
    if (max_code >= mask) return 1;
    if (max_code == mask - 1) {
        switch (bits) {
        case 1: return !any_all_ones(p, n, 1);
        case 2: return !any_all_ones(p, n, 2);
        case 4: return !any_all_ones(p, n, 4);
        default: return !any_all_ones(p, n, 8);
        }
    }
    uint8_t holds_bad[256];
    for (unsigned v = 0; v < 256; v++) {
        holds_bad[v] = 0;
        for (int j = 0; j < 8; j += bits) holds_bad[v] |= ((v >> j) & mask) > max_code;
    }
    unsigned bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= holds_bad[p[i]];
    return !bad;
}

/* Whether n fp32 scales at p are finite (padding rows hold zeros). */
static int scales_finite(const uint8_t *p, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, p + 4 * i, sizeof u);
        bad |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return !bad;
}

/* Every code and scale of a validated blob's body as ulb_pack makes them,
 * region by region: KMAJOR's scales then its code words; else each group of
 * each panel, its scales then its tiles. */
static ulb_status body_values_ok(const ulb_weight *w, unsigned max_code) {
    if (w->tiles == ULB_TILES_KMAJOR) {
        const int64_t scale_bytes = w->n_groups * w->M_pad * 4;
        if (!scales_finite(w->panels, w->n_groups * w->M_pad)) return ULB_ERR_SCALE;
        return codes_in_range(w->panels + scale_bytes, w->ksteps * w->M_pad * 4, w->bits, max_code) ? ULB_OK
                                                                                                      : ULB_ERR_CODE;
    }
    for (int64_t p = 0; p < ulb_weight_npanels(w); p++) {
        const int nt = ulb_panel_ntiles(w->M_pad, p);
        for (int64_t g = 0; g < w->n_groups; g++) {
            const uint8_t *base = ulb_group_base(w, p, nt, g);
            if (!scales_finite(base, nt * ULB_TILE)) return ULB_ERR_SCALE;
            if (!codes_in_range(base + nt * ULB_TILE_SCALE_BYTES, ulb_group_steps(w, g) * nt * ULB_TILE_BYTES,
                                w->bits, max_code))
                return ULB_ERR_CODE;
        }
    }
    return ULB_OK;
}

ulb_status ulb_blob_verify(const uint8_t *blob, int64_t nbytes, int *checked) {
    ulb_weight w;
    ulb_header h;
    ulb_status st = checked_view(blob, nbytes, &w, &h);
    if (st != ULB_OK) return st;
    st = body_values_ok(&w, (unsigned)ulb_format_get(h.format)->max_code);
    if (st == ULB_OK && checked) *checked = h.version >= 3;
    return st;
}
