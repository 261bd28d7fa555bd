"""The moe-ep layer (softmax top-k, one all-to-all out and back) in PyTorch
with the gloo backend on 127.0.0.1: a peer for `moe-ep bench`.

    /usr/bin/python3 bench/peers/torch_moe.py NP T d f E k ITERS
Spawns NP processes; prints the median layer time and tokens/s from rank 0,
after checking a few tokens against the dense float64 reference.
"""
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_data as md


def worker(r, G, T, d, f, E, k, iters, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=G)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // G))
    seed, per = 1, E // G
    x = torch.from_numpy(md.tokens(seed, r * T, T, d))
    g = torch.from_numpy(md.gate(seed, E, d))
    local = [tuple(torch.from_numpy(w) for w in md.expert(seed, r * per + e, d, f)) for e in range(per)]

    def ffn(rows, w1, w2):
        h = rows @ w1.T
        a, b = h[:, :f], h[:, f:]
        return (torch.nn.functional.silu(a) * b) @ w2.T

    def forward():
        scores = torch.softmax((x.double() @ g.double().T).float().double(), dim=1).float()
        weights, ids = torch.topk(scores, k, dim=1)
        weights = weights / weights.sum(dim=1, keepdim=True)
        owner = (ids // per).flatten()
        order = torch.argsort(owner, stable=True)
        tok = order // k
        send_counts = torch.bincount(owner, minlength=G)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        rows = x[tok]
        recv = torch.empty(int(recv_counts.sum()), d)
        dist.all_to_all_single(recv, rows, recv_counts.tolist(), send_counts.tolist())
        recv_ids = torch.empty(int(recv_counts.sum()), dtype=ids.dtype)
        dist.all_to_all_single(recv_ids, ids.flatten()[order].contiguous(), recv_counts.tolist(), send_counts.tolist())
        out = torch.empty_like(recv)
        for e in range(per):
            sel = torch.nonzero(recv_ids == r * per + e).flatten()
            if sel.numel():
                out[sel] = ffn(recv[sel], *local[e])
        back = torch.empty_like(rows)
        dist.all_to_all_single(back, out, send_counts.tolist(), recv_counts.tolist())
        y = torch.zeros_like(x)
        y.index_add_(0, tok, back * weights.flatten()[order][:, None])
        return y, ids, weights

    y, ids, weights = forward()
    if r == 0:
        md.check("torch", seed, x.numpy(), ids.numpy(), weights.numpy(), y.numpy(), d, f)
    times = []
    for _ in range(iters):
        dist.barrier()
        t = time.perf_counter()
        forward()
        spent = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        times.append(float(spent))
    if r == 0:
        m = float(np.median(times))
        print("torch: median layer %.1f ms, %.0f tokens/s" % (1e3 * m, G * T / m))
    dist.destroy_process_group()


if __name__ == "__main__":
    G, T, d, f, E, k, iters = (int(v) for v in sys.argv[1:8])
    mp.spawn(worker, args=(G, T, d, f, E, k, iters, 29500 + os.getpid() % 1000), nprocs=G)
