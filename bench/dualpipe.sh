#!/bin/sh
# SPDX-License-Identifier: MIT
# dualpipe.sh — DualPipe's pairing at the layer against waves, in the two
# regimes of the seed notes: `moe-ep bench --backward --schedule dualpipe`
# (pairs of micro-batches: serial, waves only, DualPipe only, both) at a
# large and a small batch per rank, under an NVLink-like and an
# InfiniBand-like link (docs/link-model.md: B = C / RATIO per rank, C the
# measured expert FLOP/s).
#   bench/dualpipe.sh [NP [FLAGS...]]      (default: 2 ranks, the laptop preset)
# The ratios are this layer's: F = its expert FLOPs per byte moved (the
# report of `run --link` prints it; 1379 at laptop), IB-like = 3.22 F (the
# seed's 19,780 / 6144: at most 31 % of the forward's all-to-alls hidden),
# NVLink-like = 3.22 F / 18 (900 GB/s against 50).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/.." && pwd)
. "$top/tests/mpi/mpi-env.sh"
np=${1:-2}
[ $# -gt 0 ] && shift
F=${DUALPIPE_F:-1379}
nvlink=$(echo "$F * 3.22 / 18" | bc)
ib=$(echo "$F * 3.22" | bc)
for tokens in 512 64; do
  for link in "NVLink-like cb=$nvlink" "IB-like cb=$ib"; do
    name=${link% *}
    echo "== T = $tokens per rank, $name link (--link ${link#* })"
    mpirun -np "$np" "$top/moe-ep" bench --preset laptop --tokens "$tokens" --backward \
      --schedule dualpipe --waves 1,4 --iters 3 --warmup 1 --link "${link#* }" "$@" 2>/dev/null |
      sed -n '/^   W/,$p'
  done
done
