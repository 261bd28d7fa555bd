# SPDX-License-Identifier: MIT
"""The data and the layer of moe-ep, in numpy, for the peer implementations.

The tokens and weights follow docs/data.md (Philox4x32-10, the same values as
moe-ep for the same seed), so a peer's output can be checked against a dense
float64 reference on the same data. This file holds no MPI and no torch.
"""
import numpy as np

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
MASK = np.uint64(0xFFFFFFFF)
TOKENS, GATE, EXPERT_W1, EXPERT_W2, GRAD_OUTPUT = 1, 2, 3, 4, 10


def philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on arrays of counters (uint32), one key."""
    c = [np.asarray(v, dtype=np.uint32) for v in (c0, c1, c2, c3)]
    k = [np.uint32(k0), np.uint32(k1)]
    for r in range(10):
        if r:
            k = [np.uint32((int(k[0]) + int(W0)) & 0xFFFFFFFF), np.uint32((int(k[1]) + int(W1)) & 0xFFFFFFFF)]
        p0 = c[0].astype(np.uint64) * M0
        p1 = c[2].astype(np.uint64) * M1
        hi0, lo0 = (p0 >> np.uint64(32)).astype(np.uint32), (p0 & MASK).astype(np.uint32)
        hi1, lo1 = (p1 >> np.uint64(32)).astype(np.uint32), (p1 & MASK).astype(np.uint32)
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0]
    return c


def synth(seed, tensor, entity, first, count, scale):
    """Elements first .. first+count-1 of (tensor, entity), as float32."""
    index = np.arange(first, first + count, dtype=np.uint64)
    block = index >> np.uint64(2)
    words = philox((block & MASK).astype(np.uint32), (block >> np.uint64(32)).astype(np.uint32),
                   np.full(count, tensor, np.uint32), np.full(count, entity, np.uint32),
                   seed & 0xFFFFFFFF, seed >> 32)
    lane = (index & np.uint64(3)).astype(np.int64)
    word = np.choose(lane, words)
    unit = ((word >> np.uint32(8)).astype(np.int64) - 8388608).astype(np.float32) * np.float32(2.0 ** -23)
    return unit * np.float32(scale)


def weight_scale(fan_in):
    return np.float32(1.0 / np.sqrt(float(fan_in)))


def tokens(seed, first_token, count, d):
    return synth(seed, TOKENS, 0, first_token * d, count * d, 1.0).reshape(count, d)


def grad_output(seed, first_token, count, d):
    """The upstream gradient dy of `moe-ep run --backward` (tensor 10)."""
    return synth(seed, GRAD_OUTPUT, 0, first_token * d, count * d, 1.0).reshape(count, d)


def gate(seed, experts, d):
    return synth(seed, GATE, 0, 0, experts * d, weight_scale(d)).reshape(experts, d)


def expert(seed, e, d, f):
    w1 = synth(seed, EXPERT_W1, e, 0, 2 * f * d, weight_scale(d)).reshape(2 * f, d)
    w2 = synth(seed, EXPERT_W2, e, 0, d * f, weight_scale(f)).reshape(d, f)
    return w1, w2


def route(x, g, k):
    """Softmax top-k, renormalised, ties to the lower id (moe-ep's softmax router)."""
    logits = (x.astype(np.float64) @ g.T.astype(np.float64)).astype(np.float32)
    z = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    scores = (z / z.sum(axis=1, keepdims=True)).astype(np.float32)
    ids = np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int32)
    top = np.take_along_axis(scores, ids, axis=1).astype(np.float64)
    return ids, (top / top.sum(axis=1, keepdims=True)).astype(np.float32)


def ffn(x, w1, w2):
    """SwiGLU in the dtype of its inputs."""
    h = x @ w1.T
    f = w1.shape[0] // 2
    g, u = h[:, :f], h[:, f:]
    return (g / (1 + np.exp(-g)) * u) @ w2.T


def dense_reference(seed, x, ids, weights, d, f):
    """float64: every expert a token chose, times its weight, summed."""
    y = np.zeros(x.shape, np.float64)
    for i in range(x.shape[0]):
        for s in range(ids.shape[1]):
            w1, w2 = expert(seed, int(ids[i, s]), d, f)
            y[i] += weights[i, s] * ffn(x[i:i + 1].astype(np.float64), w1.astype(np.float64), w2.astype(np.float64))[0]
    return y


def check(name, seed, x, ids, weights, y, d, f, n=4):
    """Compare the first n tokens with the dense reference; returns the relative error."""
    ref = dense_reference(seed, x[:n], ids[:n], weights[:n], d, f)
    err = np.abs(y[:n].astype(np.float64) - ref).max() / np.sqrt((ref ** 2).mean())
    print("%s: %d tokens against the dense float64 reference: max |diff| / rms = %.2e" % (name, n, err))
    return err
