# SPDX-License-Identifier: MIT
"""The moe-ep layer (softmax top-k, one all-to-all out and back) with mpi4py
and numpy, as a user would write it: a peer for `moe-ep bench`.

    mpirun -np 2 /usr/bin/python3 bench/peers/mpi4py_moe.py T d f E k ITERS
Prints the median layer time and tokens/s from rank 0, after checking a few
tokens against the dense float64 reference.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

import moe_data as md


def main():
    T, d, f, E, k, iters = (int(v) for v in sys.argv[1:7])
    comm = MPI.COMM_WORLD
    r, G = comm.Get_rank(), comm.Get_size()
    seed = 1
    per = E // G
    assert per * G == E, "E must be a multiple of the ranks here"
    x = md.tokens(seed, r * T, T, d)
    g = md.gate(seed, E, d)
    local = [md.expert(seed, r * per + e, d, f) for e in range(per)]

    def forward():
        ids, weights = md.route(x, g, k)
        owner = ids // per
        # dispatch: one row per (token, expert), grouped by destination
        order = np.argsort(owner.ravel(), kind="stable")
        tok = (order // k).astype(np.int64)
        send_counts = np.bincount(owner.ravel(), minlength=G)
        rows = x[tok]
        send_ids = ids.ravel()[order].astype(np.int32)
        recv_counts = np.empty(G, np.int64)
        comm.Alltoall(send_counts, recv_counts)
        recv = np.empty((recv_counts.sum(), d), np.float32)
        recv_ids = np.empty(recv_counts.sum(), np.int32)
        comm.Alltoallv([rows, send_counts * d, MPI.FLOAT], [recv, recv_counts * d, MPI.FLOAT])
        comm.Alltoallv([send_ids, send_counts, MPI.INT], [recv_ids, recv_counts, MPI.INT])
        out = np.empty_like(recv)
        for e in range(per):
            sel = np.nonzero(recv_ids == r * per + e)[0]
            if sel.size:
                out[sel] = md.ffn(recv[sel], *local[e])
        back = np.empty_like(rows)
        comm.Alltoallv([out, recv_counts * d, MPI.FLOAT], [back, send_counts * d, MPI.FLOAT])
        y = np.zeros_like(x)
        np.add.at(y, tok, back * weights.ravel()[order][:, None])
        return y, ids, weights

    y, ids, weights = forward()
    if r == 0:
        md.check("mpi4py", seed, x, ids, weights, y, d, f)
    times = []
    for _ in range(iters):
        comm.Barrier()
        t = time.perf_counter()
        forward()
        times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
    if r == 0:
        m = float(np.median(times))
        print("mpi4py: median layer %.1f ms, %.0f tokens/s" % (1e3 * m, G * T / m))


if __name__ == "__main__":
    main()
