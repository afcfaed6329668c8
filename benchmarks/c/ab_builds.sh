#!/usr/bin/env bash
# Builds the kernel library twice, from two git revisions (or "." for the
# working tree) and/or with two sets of compiler flags, renames every symbol
# of build A to A_* and of build B to B_*, and links both into ab_linear.c,
# which times them against each other in one process. Then runs it on each
# shape given.
#   bash benchmarks/c/ab_builds.sh REV_A REV_B [shape ...]
#   CFLAGS_A="" CFLAGS_B="-falign-loops=64" bash benchmarks/c/ab_builds.sh . .
# A shape is "M K format threads rounds" (default "2048 2048 2 1 16");
# AB_BF16=1 in the environment times bf16 activations and output.
set -euo pipefail
cd "$(dirname "$0")/../.."
rev_a=${1:?usage: ab_builds.sh REV_A REV_B [shape ...]}
rev_b=${2:?usage: ab_builds.sh REV_A REV_B [shape ...]}
shift 2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

build() { # build PREFIX REV FLAGS
  local p=$1 rev=$2 flags=$3 src=$out/src_$1
  if [ "$rev" = . ]; then
    src=$PWD
  else
    mkdir -p "$src" && git archive "$rev" kernels | tar -x -C "$src"
  fi
  mkdir -p "$out/obj_$p"
  for f in "$src"/kernels/src/*.c "$src"/kernels/ref/*.c "$src"/kernels/x86/*.c; do
    # shellcheck disable=SC2086  # flags are words
    gcc -O3 -std=c11 -D_GNU_SOURCE -ffp-contract=off -fPIC $flags -I"$src/kernels/include" \
      -c "$f" -o "$out/obj_$p/$(basename "$f" .c).o"
  done
  ld -r "$out"/obj_"$p"/*.o -o "$out/lib_$p.o"
  nm --defined-only -g "$out/lib_$p.o" | awk -v p="$p" '{print $3" "p"_"$3}' > "$out/syms_$p"
  objcopy --redefine-syms="$out/syms_$p" "$out/lib_$p.o" "$out/lib_${p}_renamed.o"
}

build A "$rev_a" "${CFLAGS_A:-}"
build B "$rev_b" "${CFLAGS_B:-}"
gcc -O3 -std=c11 -D_GNU_SOURCE -Ikernels/include benchmarks/c/ab_linear.c "$out/lib_A_renamed.o" \
  "$out/lib_B_renamed.o" -lm -lpthread -o "$out/ab_linear"
echo "A = $rev_a ${CFLAGS_A:-}, B = $rev_b ${CFLAGS_B:-}"
if [ $# -eq 0 ]; then set -- "2048 2048 2 1 16"; fi
for shape in "$@"; do
  # shellcheck disable=SC2086  # a shape is five words
  "$out/ab_linear" $shape
done
