/* The API's macros as values, for callers that cannot read the header. */
#include "internal.h"

void ulb_constants_get(ulb_constants *out) {
    *out = (ulb_constants){
        .max_m = ULB_MAX_M,
        .max_k = ULB_MAX_K,
        .max_threads = ULB_MAX_THREADS,
        .panel_rows = ULB_PANEL_ROWS,
        .isa_count = ULB_ISA_COUNT,
        .tiles_count = ULB_TILES_COUNT,
        .tiles_preferred = ULB_TILES_PREFERRED,
        .lut1_off = ULB_LUT1_OFF,
        .lut1_on = ULB_LUT1_ON,
        .lut1_auto = ULB_LUT1_AUTO,
        .prefetch_auto = ULB_PREFETCH_AUTO,
        .prefetch_max = ULB_PREFETCH_MAX,
        .probe_max_streams = ULB_PROBE_MAX_STREAMS,
        .slowdown_max = ULB_SLOWDOWN_MAX,
        .base3_bits = ULB_BASE3_BITS,
    };
}

size_t ulb_constants_size(void) { return sizeof(ulb_constants); }
