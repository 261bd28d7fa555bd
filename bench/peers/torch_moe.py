# SPDX-License-Identifier: MIT
"""The moe-ep layer (softmax top-k, one all-to-all out and back) in PyTorch
with the gloo backend on 127.0.0.1: a peer for `moe-ep bench`.

    /usr/bin/python3 bench/peers/torch_moe.py NP T d f E k ITERS [train]
Spawns NP processes; prints the median layer time and tokens/s from rank 0,
after checking a few tokens against the dense float64 reference. With
`train`, a training step as `moe-ep bench --backward` times it: the forward
with differentiable all-to-alls (torch.distributed.nn), autograd's backward
for moe-ep's synthetic dy (tensor 10 of docs/data.md), and the gate's
gradient summed over ranks; a few tokens' dx are checked against float64
autograd on the dense layer.
"""
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_data as md


def dense_dx(seed, x, ids, dy, g, d, f):
    """float64 autograd on the dense layer: dx of the rows of x (their ids
    as the EP run chose them) for the loss <dy, y>."""
    x = torch.from_numpy(x).double().requires_grad_()
    g = torch.from_numpy(g).double()
    scores = torch.softmax(x @ g.T, dim=1)
    top = torch.gather(scores, 1, torch.from_numpy(ids).long())
    weights = top / top.sum(dim=1, keepdim=True)
    y = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for s in range(ids.shape[1]):
            w1, w2 = (torch.from_numpy(w).double() for w in md.expert(seed, int(ids[i, s]), d, f))
            h = x[i:i + 1] @ w1.T
            o = (torch.nn.functional.silu(h[:, :f]) * h[:, f:]) @ w2.T
            y = y.index_add(0, torch.tensor([i]), weights[i, s] * o)
    (y * torch.from_numpy(dy).double()).sum().backward()
    return x.grad.numpy()


def worker(r, G, T, d, f, E, k, iters, port, train=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=G)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // G))
    seed, per = 1, E // G
    x = torch.from_numpy(md.tokens(seed, r * T, T, d))
    g = torch.from_numpy(md.gate(seed, E, d))
    local = [tuple(torch.from_numpy(w).requires_grad_(train) for w in md.expert(seed, r * per + e, d, f))
             for e in range(per)]
    if train:
        from torch.distributed.nn.functional import all_to_all_single
        x.requires_grad_()
        g.requires_grad_()
        dy = torch.from_numpy(md.grad_output(seed, r * T, T, d))

    def ffn(rows, w1, w2):
        h = rows @ w1.T
        a, b = h[:, :f], h[:, f:]
        return (torch.nn.functional.silu(a) * b) @ w2.T

    def forward():
        scores = torch.softmax(x.double() @ g.double().T, dim=1).float()
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
        if train:
            recv = all_to_all_single(recv, rows, recv_counts.tolist(), send_counts.tolist())
        else:
            dist.all_to_all_single(recv, rows, recv_counts.tolist(), send_counts.tolist())
        recv_ids = torch.empty(int(recv_counts.sum()), dtype=ids.dtype)
        dist.all_to_all_single(recv_ids, ids.flatten()[order].contiguous(), recv_counts.tolist(), send_counts.tolist())
        out = torch.empty(recv.shape)  # autograd records the writes (CopySlices)
        for e in range(per):
            sel = torch.nonzero(recv_ids == r * per + e).flatten()
            if sel.numel():
                out[sel] = ffn(recv[sel], *local[e])
        back = torch.empty(rows.shape)
        if train:
            back = all_to_all_single(back, out, send_counts.tolist(), recv_counts.tolist())
        else:
            dist.all_to_all_single(back, out, send_counts.tolist(), recv_counts.tolist())
        y = torch.zeros_like(x)
        y.index_add_(0, tok, back * weights.flatten()[order][:, None])
        return y, ids, weights

    def step():
        """Forward, then (train) the gradients of <dy, y>; the gate's summed over ranks."""
        if not train:
            return forward()
        for w in [x, g] + [w for pair in local for w in pair]:
            w.grad = None
        y, ids, weights = forward()
        (y * dy).sum().backward()
        dist.all_reduce(g.grad)
        return y, ids, weights

    y, ids, weights = step()
    if r == 0:
        md.check("torch", seed, x.detach().numpy(), ids.numpy(), weights.detach().numpy(),
                 y.detach().numpy(), d, f)
        if train:
            n = 4
            ref = dense_dx(seed, x.detach().numpy()[:n], ids.numpy()[:n], dy.numpy()[:n],
                           g.detach().numpy(), d, f)
            err = np.abs(x.grad.numpy()[:n] - ref).max() / np.sqrt((ref ** 2).mean())
            print("torch: dx of %d tokens against float64 autograd on the dense layer: "
                  "max |diff| / rms = %.2e" % (n, err))
    times = []
    for _ in range(iters):
        dist.barrier()
        t = time.perf_counter()
        step()
        spent = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        times.append(float(spent))
    if r == 0:
        m = float(np.median(times))
        print("torch: median %s %.1f ms, %.0f tokens/s" % ("training step" if train else "layer",
                                                            1e3 * m, G * T / m))
    dist.destroy_process_group()


if __name__ == "__main__":
    G, T, d, f, E, k, iters = (int(v) for v in sys.argv[1:8])
    train = sys.argv[8:9] == ["train"]
    mp.spawn(worker, args=(G, T, d, f, E, k, iters, 29500 + os.getpid() % 1000, train), nprocs=G)
