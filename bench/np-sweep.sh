#!/bin/sh
# SPDX-License-Identifier: MIT
# np-sweep.sh — `moe-ep bench` at several rank counts, in one table:
#   bench/np-sweep.sh "1 2 4" [bench flags ...]   (default flags: --preset laptop --waves 1,4)
# Each rank count runs `mpirun -np N moe-ep bench --csv FILE` with the same
# flags, so the tokens per rank stay and the layer grows with N (weak
# scaling). Every figure keeps its in-run anchors, measured at that N (peak:
# against that run's FMA peak limit, the fastest its cores ran). With more
# ranks than cores the ranks share cores: compare the efficiencies, not the
# times, across such rows.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/.." && pwd)
. "$top/tests/mpi/mpi-env.sh"
counts=${1:-"1 2 4"}
[ $# -gt 0 ] && shift
[ $# -gt 0 ] || set -- --preset laptop --waves 1,4
csv=$(mktemp)
trap 'rm -f "$csv"' EXIT
echo "moe-ep bench at np = $counts, flags: $*"
printf '%4s %4s %-13s %10s %10s %8s %6s %6s %6s %9s\n' np W waves "layer ms" tokens/s ceiling peak gemm a2a "RSS ratio"
for np in $counts; do
  rm -f "$csv"
  if ! mpirun -np "$np" "$top/moe-ep" bench "$@" --csv "$csv" >/dev/null; then
    echo "np-sweep: the bench at np = $np failed" >&2
    exit 1
  fi
  # waves,kind,layer_ms,...,tokens_per_s(6),...,gemm_efficiency(8),...,a2a_efficiency(10),...,
  # rss_ratio(13),of_ceiling(14),...,of_fma_peak(23)
  awk -F, -v np="$np" 'NR > 1 { a2a = $10 == "nan" ? "-" : sprintf("%.2f", $10)
    printf "%4d %4d %-13s %10.2f %10.0f %7.0f%% %5.0f%% %6.2f %6s %9.2f\n",
    np, $1, $2, $3, $6, 100 * $14, 100 * $23, $8, a2a, $13 }' "$csv"
done
