/* One ulb_linear call on one thread, for counting the instructions the
 * microkernels execute under an emulator (benchmarks/insn_per_weight.py runs
 * it under qemu-user with its execution log and sums the instructions inside
 * the kernel objects). The ISA comes from ULB_ISA, the lookup kernels'
 * setting from ULB_LUT1, as for any program.
 *   insn_count FORMAT TILES M K GROUP N     e.g. insn_count int2_sym vnni 1024 4096 0 1 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ulb/ulb.h"

static uint32_t rng = 12345;
static uint32_t rnd(void) { return (rng = rng * 1664525u + 1013904223u) >> 8; }

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s FORMAT vnni|lanes M K GROUP N\n", argv[0]);
        return 2;
    }
    const ulb_format_info *fi = NULL;
    for (int i = 0; i < ulb_format_count(); i++)
        if (!strcmp(ulb_format_at(i)->name, argv[1])) fi = ulb_format_at(i);
    int tiles = -1;
    for (int t = 0; t < ULB_TILES_COUNT; t++)
        if (!strcmp(ulb_tiles_name(t), argv[2])) tiles = t;
    const int64_t M = atoll(argv[3]), K = atoll(argv[4]), gs = atoll(argv[5]), N = atoll(argv[6]);
    if (!fi || tiles < 0 || M < 1 || K < 1 || N < 1) {
        fprintf(stderr, "insn_count: bad format, tile order or shape\n");
        return 2;
    }
    const int64_t nb = ulb_packed_nbytes(fi->id, M, K, gs);
    const int64_t G = gs <= 0 || gs >= K ? 1 : (K + gs - 1) / gs;
    uint8_t *codes = malloc(M * K), *blob = malloc(nb > 0 ? nb : 1);
    float *sc = malloc(M * G * sizeof(float)), *x = malloc(N * K * sizeof(float)), *y = malloc(N * M * sizeof(float));
    for (int64_t i = 0; i < M * K; i++) codes[i] = (uint8_t)(rnd() % (fi->max_code + 1));
    for (int64_t i = 0; i < M * G; i++) sc[i] = (rnd() % 1000 + 1) * 1e-3f;
    for (int64_t i = 0; i < N * K; i++) x[i] = ((int)(rnd() % 2001) - 1000) * 1e-3f;
    ulb_status st = nb < 0 ? (ulb_status)-nb : ulb_pack_tiles(fi->id, tiles, M, K, gs, codes, K, sc, blob, nb);
    if (st == ULB_OK) st = ulb_linear(blob, nb, N, x, ULB_DT_F32, K, 1, NULL, ULB_DT_F32, y, ULB_DT_F32, M, 1);
    if (st != ULB_OK) {
        fprintf(stderr, "insn_count: %s\n", ulb_status_str(st));
        return 1;
    }
    double sum = 0.0;
    for (int64_t i = 0; i < N * M; i++) sum += y[i];
    printf("isa %s checksum %.6g\n", ulb_isa_name(ulb_isa_active()), sum);
    free(codes); free(blob); free(sc); free(x); free(y);
    return 0;
}
