#!/usr/bin/env bash
# Sweeps the microkernels' software-prefetch distance (ULB_PREFETCH_1BIT and
# ULB_PREFETCH_2BIT in kernels/src/internal.h, both set to each distance):
# builds gemv_cold once per distance, then runs the builds in turn for a few
# passes so that DRAM drift spreads over all of them. ULB_SWEEP_DISTS="0 8192"
# picks the distances.
# Usage: bash benchmarks/c/prefetch_sweep.sh [M K format threads]
set -euo pipefail
cd "$(dirname "$0")/../.."
args=("${@:-14336 4096 2 1}")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
read -r -a dists <<< "${ULB_SWEEP_DISTS:-0 2048 4096 8192 12288 16384 32768}"
for d in "${dists[@]}"; do
  gcc -O3 -std=c11 -D_GNU_SOURCE -ffp-contract=off -DULB_PREFETCH_1BIT="$d" -DULB_PREFETCH_2BIT="$d" -Ikernels/include \
    kernels/src/*.c kernels/ref/*.c kernels/x86/*.c benchmarks/c/gemv_cold.c -lm -lpthread -o "$out/gemv_$d"
done
for pass in 1 2 3; do
  for d in "${dists[@]}"; do
    printf 'pass %d prefetch %6d: ' "$pass" "$d"
    "$out/gemv_$d" ${args[@]} 3
  done
done
