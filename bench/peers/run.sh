#!/bin/sh
# SPDX-License-Identifier: MIT
# run.sh — moe-ep against its peers (mpi4py + numpy, PyTorch + gloo) on one
# workload, each timed its own way (median of its forwards) and each checked
# on a few tokens against the dense float64 reference:
#   bench/peers/run.sh [T d f E k ITERS]        (default: the issue's workload)
#   bench/peers/run.sh T d f E k ITERS train    training steps: moe-ep bench
#                                               --backward against PyTorch autograd
# Needs python3-numpy, python3-mpi4py, python3-torch (apt-get install
# --no-install-recommends); not part of make check.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
. "$top/tests/mpi/mpi-env.sh"
T=${1:-4096} d=${2:-1024} f=${3:-512} E=${4:-16} k=${5:-4} iters=${6:-5} mode=${7:-forward}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
echo "workload: 2 ranks, T=$T per rank, d=$d f=$f E=$E k=$k, softmax top-$k, fp32, one BLAS thread per rank, $mode"
if [ "$mode" = train ]; then
  ours=$(mpirun -np 2 "$top/moe-ep" bench --backward --tokens "$T" --hidden "$d" --ffn "$f" \
    --experts "$E" --topk "$k" --shared-experts 0 --waves 1,4 --iters "$iters" 2>/dev/null)
  echo "$ours"
  # the training table: tokens/s is its 5th column
  best=$(echo "$ours" | awk '$1 ~ /^[0-9]+$/ && NF > 10 { if ($5 > b) b = $5 } END { print b }')
  (cd "$here" && /usr/bin/python3 torch_moe.py 2 "$T" "$d" "$f" "$E" "$k" "$iters" train) | tee "$top/.peer-torch.txt"
  t=$(sed -n 's/.*ms, \([0-9]*\) tokens.*/\1/p' "$top/.peer-torch.txt")
  rm -f "$top/.peer-torch.txt"
  echo "training tokens/s: moe-ep $best, torch $t; moe-ep / torch = $(echo "scale=2; $best / $t" | bc)"
  exit 0
fi
ours=$(mpirun -np 2 "$top/moe-ep" bench --tokens "$T" --hidden "$d" --ffn "$f" --experts "$E" \
  --topk "$k" --shared-experts 0 --waves 1,4 --iters "$iters" 2>/dev/null)
echo "$ours"
best=$(echo "$ours" | awk '$2 == "expert" || $2 == "token" { if ($6 > b) b = $6 } END { print b }')
(cd "$here" && mpirun -np 2 /usr/bin/python3 mpi4py_moe.py "$T" "$d" "$f" "$E" "$k" "$iters") | tee "$top/.peer-mpi4py.txt"
(cd "$here" && /usr/bin/python3 torch_moe.py 2 "$T" "$d" "$f" "$E" "$k" "$iters") | tee "$top/.peer-torch.txt"
m=$(sed -n 's/.*ms, \([0-9]*\) tokens.*/\1/p' "$top/.peer-mpi4py.txt")
t=$(sed -n 's/.*ms, \([0-9]*\) tokens.*/\1/p' "$top/.peer-torch.txt")
rm -f "$top/.peer-mpi4py.txt" "$top/.peer-torch.txt"
echo "tokens/s: moe-ep $best, mpi4py $m, torch $t; moe-ep / mpi4py = $(echo "scale=2; $best / $m" | bc), moe-ep / torch = $(echo "scale=2; $best / $t" | bc)"
