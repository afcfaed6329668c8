#!/usr/bin/env bash
# Sweeps the microkernels' software-prefetch distance (ULB_PREFETCH_1BIT and
# ULB_PREFETCH_2BIT in kernels/src/internal.h, both set to each distance):
# each distance is built as build B and timed against the committed defaults
# (build A) in one process by ab_builds.sh, since separate processes see
# different DRAM speeds on a shared VM. ULB_SWEEP_DISTS="0 8192" picks the
# distances; AB_BF16=1 times bf16 activations.
# Usage: bash benchmarks/c/prefetch_sweep.sh [M K format threads rounds]
set -euo pipefail
cd "$(dirname "$0")/../.."
shape="${*:-14336 4096 2 1 12}"
read -r -a dists <<< "${ULB_SWEEP_DISTS:-0 4096 8192 16384 32768}"
for d in "${dists[@]}"; do
  printf 'prefetch %6d: ' "$d"
  CFLAGS_B="-DULB_PREFETCH_1BIT=$d -DULB_PREFETCH_2BIT=$d" bash benchmarks/c/ab_builds.sh . . "$shape" | tail -n 1
done
