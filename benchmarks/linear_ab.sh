#!/usr/bin/env bash
# The AVX2 float prefill of another tree (A: a `git worktree` of an earlier commit, or any checkout) against this
# one's (B), one layer at a time, in one binary that calls them in turn (benchmarks/linear_ab.cpp):
#
#   git worktree add /tmp/base HEAD~1
#   bash benchmarks/linear_ab.sh /tmp/base                   # GPT-2 large and xl's four layer shapes, 128 rows
#   bash benchmarks/linear_ab.sh /tmp/base 1280 5120 16      # one shape, 16 rows
#
# Each tree's csrc/linear_avx2.cpp, linear_impl.h, act_impl.h and vec_avx2.h are copied, B's into namespace avx2b,
# and built with this tree's linear.h (so the trees must agree on LinearArgs). Runs on core 1 (taskset) with
# COPIES, REPS and RUN from the environment (linear_ab.cpp). Not part of the package or CI.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
other=${1:?usage: linear_ab.sh OTHER_TREE [K N [rows]]}
shift
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/A" "$work/B"
for f in linear_avx2.cpp linear_impl.h act_impl.h vec_avx2.h; do
  sed '/#pragma once/d' "$other/src/gpt2ffn/csrc/$f" > "$work/A/$f"
  sed -e '/#pragma once/d' -e 's/namespace avx2 {/namespace avx2b {/' -e 's/#define ISA avx2$/#define ISA avx2b/' \
    "$here/../src/gpt2ffn/csrc/$f" > "$work/B/$f"
done
g++ -O3 -ffp-contract=off -I"$work" -I"$here" -I"$here/../src/gpt2ffn/csrc" -o "$work/linear_ab" "$here/linear_ab.cpp"
if [ $# -gt 0 ]; then
  taskset -c 1 "$work/linear_ab" "$@"
else
  for shape in "1280 3840" "1280 1280" "1280 5120" "5120 1280" "1600 4800" "1600 1600" "1600 6400" "6400 1600"; do
    taskset -c 1 "$work/linear_ab" $shape
  done
fi
