#!/bin/sh
# SPDX-License-Identifier: MIT
# consumer.sh PREFIX LIBDIR — build tests/install/consumer.c against the
# moe-ep installed in PREFIX with nothing but `pkg-config --cflags --libs
# moe-ep` and the MPI compiler wrapper, and run it under mpirun -np 2.
set -e
prefix=$1 libdir=$2
srcdir=${MOE_EP_SRCDIR:-$(dirname "$0")/../..}
work=$(mktemp -d "${TMPDIR:-/tmp}/moe-ep-consumer.XXXXXX")
trap 'rm -rf "$work"' EXIT
export PKG_CONFIG_PATH="$libdir/pkgconfig"
flags="$(pkg-config --cflags --libs moe-ep)"
echo "consumer: ${MPICC:-mpicc} consumer.c $flags"
# the rpath finds the library where it was installed, without LD_LIBRARY_PATH
${MPICC:-mpicc} -std=c11 -Wall -Werror -o "$work/consumer" "$srcdir/tests/install/consumer.c" $flags \
  -Wl,-rpath,"$libdir"
. "$srcdir/tests/mpi/mpi-env.sh"
${MPIEXEC:-mpirun} -np 2 "$work/consumer" "$work/set" 2>&1 || { echo "consumer: FAIL"; exit 1; }
[ -f "$work/set/manifest.json" ] || { echo "consumer: FAIL: no golden set in $work/set"; exit 1; }
echo "consumer: PASS"
