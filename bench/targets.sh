#!/bin/sh
# SPDX-License-Identifier: MIT
# targets.sh — the performance targets of docs/performance.md on this
# machine, in rounds: each round runs five benches in turn, so that the
# machine's drift falls on all of them alike, and every figure is a ratio
# against the same run's anchors (the FMA peak's limit, the layer's GEMM on
# each core) or against the same round's baseline. Prints each target's
# median and range over the rounds, and whether the median meets it.
#
#   bench/targets.sh [--rounds R] [--preset NAME] [--keep DIR | --from DIR]
#
# R rounds (default 3, 1 to 100) of, with T and E the preset's tokens per
# rank and experts (default laptop: 512 and 64):
#   base   mpirun -np 2 moe-ep bench --preset NAME --waves 1,4
#   few    the same with --experts 4E --waves 1 (the same FLOPs, a quarter
#          of the rows an expert)
#   many   the same with --tokens 16T --waves 1 --iters 2
#   step   the same with --waves 1 --iters 5 --backward (a training step)
#   np8    mpirun -np 8 moe-ep bench --preset NAME --tokens T/4 --waves 1,4
#          (the same 2T tokens on four times the ranks)
# --keep DIR keeps each bench's output and CSV there (DIR/ROUND-NAME.txt,
# .csv); --from DIR runs nothing and reads them back (the first R rounds
# there, by default all). Exit 0 when every bench ran, 1 when one failed
# (its output shown), 2 on a bad flag; the targets' verdicts are printed,
# not the exit.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/.." && pwd)

usage() {
  echo "usage: bench/targets.sh [--rounds R] [--preset NAME] [--keep DIR | --from DIR]" >&2
  exit 2
}
rounds="" preset=laptop keep="" from=""
while [ $# -gt 0 ]; do
  case $1 in
    --rounds) [ $# -ge 2 ] || usage; rounds=$2; shift 2 ;;
    --preset) [ $# -ge 2 ] || usage; preset=$2; shift 2 ;;
    --keep) [ $# -ge 2 ] || usage; keep=$2; shift 2 ;;
    --from) [ $# -ge 2 ] || usage; from=$2; shift 2 ;;
    -h|--help) sed -n '3,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "targets: unknown flag '$1'" >&2; usage ;;
  esac
done
if [ -n "$keep" ] && [ -n "$from" ]; then
  echo "targets: --keep and --from: one or the other" >&2
  exit 2
fi
if [ -n "$from" ] && [ -z "$rounds" ]; then
  rounds=$(find "$from" -maxdepth 1 -name '*-base.csv' 2>/dev/null | wc -l)
  if [ "$rounds" -eq 0 ]; then
    echo "targets: --from: no rounds in '$from' (ROUND-base.csv and the others, from --keep)" >&2
    exit 2
  fi
fi
rounds=${rounds:-3}
case $rounds in
  ''|*[!0-9]*) echo "targets: --rounds must be a whole number in [1..100], got '$rounds'" >&2; exit 2 ;;
esac
if [ "$rounds" -lt 1 ] || [ "$rounds" -gt 100 ]; then
  echo "targets: --rounds must be in [1..100], got $rounds" >&2
  exit 2
fi
if [ -n "$from" ] && [ -f "$from/preset" ]; then # the kept run's, not --preset's
  read -r preset T E <"$from/preset"
else
  conf=$top/data/presets/$preset.conf
  [ -f "$preset" ] && conf=$preset
  if [ ! -f "$conf" ]; then
    echo "targets: --preset: no preset '$preset' (data/presets/NAME.conf, or a path to a .conf)" >&2
    exit 2
  fi
  setting() { # NAME DEFAULT: the preset's value (moe-ep's default where it has none)
    v=$(sed -n "s/^[[:space:]]*$1[[:space:]]*=[[:space:]]*\([0-9]*\).*/\1/p" "$conf" | tail -n 1)
    echo "${v:-$2}"
  }
  T=$(setting tokens 256) E=$(setting experts 8)
fi
if [ $((T % 4)) -ne 0 ]; then
  echo "targets: --preset: the np 8 bench needs the preset's tokens per rank ($T) divisible by 4" >&2
  exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
dir=$work
[ -n "$keep" ] && mkdir -p "$keep" && dir=$keep && echo "$preset $T $E" >"$keep/preset"
[ -n "$from" ] && dir=$from
. "$top/tests/mpi/mpi-env.sh"

# bench ROUND NAME NP FLAGS...: one bench, its output and CSV in $dir
bench() {
  r=$1 name=$2 np=$3
  shift 3
  echo "targets: round $r of $rounds: $name (mpirun -np $np moe-ep bench --preset $preset $*)" >&2
  if ! mpirun -np "$np" "$top/moe-ep" bench --preset "$preset" "$@" --csv "$dir/$r-$name.csv" \
       >"$dir/$r-$name.txt" 2>&1; then
    cat "$dir/$r-$name.txt" >&2
    echo "targets: the $name bench of round $r failed" >&2
    exit 1
  fi
}
# col ROUND NAME W COLUMN: that CSV column of the row of W
col() {
  if [ ! -f "$dir/$1-$2.csv" ]; then
    echo "targets: no $dir/$1-$2.csv" >&2
    exit 2
  fi
  awk -F, -v w="$3" -v c="$4" 'NR == 1 { for (i = 1; i <= NF; i++) at[$i] = i; next }
    $1 == w { print c in at ? $(at[c]) : "nan" }' "$dir/$1-$2.csv"
}

values=$work/values
: >"$values"
r=1
while [ "$r" -le "$rounds" ]; do
  if [ -z "$from" ]; then
    bench "$r" base 2 --waves 1,4
    bench "$r" few 2 --experts $((4 * E)) --waves 1
    bench "$r" many 2 --tokens $((16 * T)) --waves 1 --iters 2
    bench "$r" step 2 --waves 1 --iters 5 --backward
    bench "$r" np8 8 --tokens $((T / 4)) --waves 1,4
  fi
  base1=$(col "$r" base 1 layer_ms) base4=$(col "$r" base 4 layer_ms)
  limit=$(col "$r" step 1 rank_fma_limit_gflops)
  awk -v base1="$base1" -v base4="$base4" -v few="$(col "$r" few 1 layer_ms)" \
      -v many="$(col "$r" many 1 layer_ms)" -v np8_1="$(col "$r" np8 1 layer_ms)" \
      -v np8_4="$(col "$r" np8 4 layer_ms)" -v limit="$limit" \
      -v layer="$(col "$r" base 1 of_fma_peak)" -v experts="$(col "$r" base 1 experts_of_fma_peak)" \
      -v gemm="$(col "$r" base 1 layer_gemm_of_fma_peak)" -v fwd="$(col "$r" step 1 expert_gflops)" \
      -v dgrad="$(col "$r" step 1 dgrad_gflops)" -v wgrad="$(col "$r" step 1 wgrad_gflops)" 'BEGIN {
    print "layer", layer; print "experts", experts; print "gemm", gemm
    print "few", few / base1; print "many", many / 16 / base1
    if (limit ~ /^[0-9.]+$/ && limit > 0) {  # else no FMA peak measured: nan
      print "fwd", fwd / 2 / limit; print "dgrad", dgrad / limit; print "wgrad", wgrad / limit
    } else { print "fwd nan"; print "dgrad nan"; print "wgrad nan" }
    print "np8_1", (np8_1 - base1) / 6; print "np8_4", (np8_4 - base4) / 6 }' >>"$values"
  r=$((r + 1))
done

# The machine, from the first base bench's header and anchors.
first=$dir/1-base.txt cpu="" gemm=""
if [ -f "$first" ]; then
  cpu=$(sed -n 's/.*fp32 FMA peak on \(.*\) (OpenBLAS kernel \([^)]*\)), GFLOP.*/\1, OpenBLAS kernel \2/p' "$first")
  gemm=$(sed -n 's/.* · gemm \([^·]*\) · .*/\1/p' "$first" | head -n 1)
fi
echo "moe-ep targets: $rounds round(s) of the $preset preset (T = $T, E = $E) on ${cpu:-this CPU}; gemm ${gemm:-?}"
echo "each figure: the median over the rounds (their range); the layer's figures of the FMA peak's limit"
# row KEY GOAL-OP GOAL FORMAT TEXT: the median, range and verdict of KEY
row() {
  sort -g -k2 "$values" | awk -v key="$1" -v op="$2" -v goal="$3" -v fmt="$4" -v text="$5" '
    $1 == key && $2 !~ /nan/ { v[n++] = $2 }
    END {
      if (n == 0) { printf "%-58s %s\n", text, "not measured here"; exit }
      med = n % 2 ? v[(n - 1) / 2] : (v[n / 2 - 1] + v[n / 2]) / 2
      met = op == ">=" ? med >= goal : op == "<=" ? med <= goal : -1
      printf "%-58s %2s %-6s " fmt " (" fmt " to " fmt ")%s\n", text, op, op == "" ? "" : goal,
             med, v[0], v[n - 1], met < 0 ? "" : met ? "  met" : "  not met"
    }'
}
row layer ">=" 0.82 "%.2f" "3. the layer, np 2, W = 1"
row experts "" "" "%.2f" "   its experts stage"
row gemm "" "" "%.2f" "   its GEMM on the slowest rank's core (the anchor)"
row few "<=" 1.15 "%.2f" "4. $((4 * E)) experts against $E, the same FLOPs (x)"
row many "<=" 1.05 "%.2f" "   T = $((16 * T)) a rank against T = $T, per token (x)"
row fwd ">=" 0.75 "%.2f" "5. a training step's forward GEMMs, of one rank's limit"
row dgrad ">=" 0.75 "%.2f" "   its data gradient's GEMMs"
row wgrad ">=" 0.75 "%.2f" "   its weight gradient's GEMMs"
row np8_1 "<=" 1 "%.2f" "6. np 8 against np 2, ms a rank more, W = 1"
row np8_4 "<=" 1 "%.2f" "   W = 4"
