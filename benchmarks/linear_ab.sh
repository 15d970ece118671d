#!/usr/bin/env bash
# The AVX2 prefill kernels of another tree (A: a `git worktree` of an earlier commit, or any checkout) against this
# one's (B), one layer at a time, in one binary that calls them in turn (benchmarks/linear_ab.cpp): the float
# kernels (fp32 weights), or with --int8 the maddubs int8 tile (int8 weights and activations).
#
#   git worktree add /tmp/base HEAD~1
#   bash benchmarks/linear_ab.sh /tmp/base                   # GPT-2 large and xl's layer shapes, 128 rows
#   bash benchmarks/linear_ab.sh --int8 /tmp/base 1280 5120 16
#
# Each tree's build file and the headers it reads are copied, B's into namespace avx2b, each copy under an include
# guard of its own (g++ takes two files of the same bytes for one under #pragma once), and built with this tree's
# linear.h (so the trees must agree on LinearArgs). Runs on core 1 (taskset) with COPIES, REPS and RUN from the
# environment (linear_ab.cpp); KEEP=PATH keeps the binary there (e.g. for perf record). Not part of the package or CI.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
files="linear_avx2.cpp linear_impl.h act_impl.h vec_avx2.h" flag=""
if [ "${1:-}" = "--int8" ]; then
  files="qlinear_avx2.cpp qvec_avx2.h qlinear_impl.h act_impl.h vec_avx2.h" flag="-DAB_INT8"
  shift
fi
other=${1:?usage: linear_ab.sh [--int8] OTHER_TREE [K N [rows]]}
shift
work=$(mktemp -d)
trap '[ -n "${KEEP:-}" ] && cp "$work/ab" "$KEEP"; rm -rf "$work"' EXIT
mkdir "$work/A" "$work/B"
guard() { echo "#ifndef AB_$1_${2//./_}"; echo "#define AB_$1_${2//./_}"; sed '/#pragma once/d'; echo "#endif"; }
for f in $files; do
  guard A "$f" < "$other/src/gpt2ffn/csrc/$f" > "$work/A/$f"
  sed -e 's/namespace avx2 {/namespace avx2b {/' -e 's/gpt2ffn::avx2\b/gpt2ffn::avx2b/g' \
    -e 's/#define ISA avx2$/#define ISA avx2b/' "$here/../src/gpt2ffn/csrc/$f" | guard B "$f" > "$work/B/$f"
done
g++ -O3 -ffp-contract=off $flag -I"$work" -I"$here" -I"$here/../src/gpt2ffn/csrc" -o "$work/ab" "$here/linear_ab.cpp"
if [ $# -gt 0 ]; then
  taskset -c 1 "$work/ab" "$@"
else
  for shape in "1280 3840" "1280 1280" "1280 5120" "5120 1280" "1600 4800" "1600 1600" "1600 6400" "6400 1600"; do
    taskset -c 1 "$work/ab" $shape
  done
fi
