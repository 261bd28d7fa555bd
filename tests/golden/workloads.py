#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""workloads.py SET... — regenerate each set's --workload routing in numpy
from docs/data.md §6 alone (with the Philox mapping of §2) and require the
dump's router.topk_ids and router.topk_weights byte for byte. Exit 1 on any
difference."""
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench", "peers"))
import moe_data  # noqa: E402  (docs/data.md's Philox mapping in numpy)
import st  # noqa: E402

DRAW, WEIGHT, HOT = 11, 12, 13


def word(seed, tensor, entity, index):
    """§2's words of elements index (an array) of (tensor, entity)."""
    index = np.asarray(index, dtype=np.uint64)
    block = index >> np.uint64(2)
    words = moe_data.philox((block & moe_data.MASK).astype(np.uint32),
                            (block >> np.uint64(32)).astype(np.uint32),
                            np.full(index.size, tensor, np.uint32),
                            np.full(index.size, entity, np.uint32), seed & 0xFFFFFFFF, seed >> 32)
    return np.choose((index & np.uint64(3)).astype(np.int64), words).astype(np.uint64)


def blocks(E, G):
    """Each rank's experts, contiguous, the first E mod G ranks one more."""
    first, out = 0, []
    for r in range(G):
        n = E // G + (1 if r < E % G else 0)
        out.append(list(range(first, first + n)))
        first += n
    return out


def heat(name, seed, step, E, G):
    n = max(1, E // 8)
    ranks = blocks(E, G)
    hot = []
    if name == "hot-experts" or (name == "burst" and step % 4 == 3):
        w = word(seed, HOT, 0, np.arange(E))
        hot = sorted(range(E), key=lambda e: (int(w[e]), e))[:n]
    elif name in ("hot-rank", "rotating"):
        rho = 0 if name == "hot-rank" else (step // 3) % G
        hot = ranks[rho][:n]
    elif name == "spread-hot":
        q = 0
        while len(hot) < n:
            for r in range(G):
                if len(hot) < n and q < len(ranks[r]):
                    hot.append(ranks[r][q])
            q += 1
    if name == "zero-rank":
        if G == 1:
            return [0 if e >= (E + 1) // 2 else 1 for e in range(E)]
        upper = {e for r in range((G + 1) // 2, G) for e in ranks[r]}
        return [0 if e in upper else 1 for e in range(E)]
    if 0 < len(hot) < E:
        h = [len(hot)] * E
        for e in hot:
            h[e] = 3 * (E - len(hot))
        return h
    return [1] * E


def route(name, seed, step, E, G, T, k):
    ids = np.zeros((G * T, k), np.int32)
    weights = np.zeros((G * T, k), np.float32)
    h = heat(name, seed, step, E, G)
    g = np.arange(G * T, dtype=np.uint64)
    index = (g[:, None] * np.uint64(k) + np.arange(k, dtype=np.uint64)[None, :]).ravel()
    u = word(seed, DRAW, step, index).reshape(G * T, k)
    nw = (np.uint64(1) + (word(seed, WEIGHT, step, index) >> np.uint64(28))).reshape(G * T, k)
    for t in range(G * T):
        r, i = divmod(t, T)
        if name == "ragged" and i >= -(-T * (r + 1) // G):
            ids[t] = -1
            continue
        taken = []
        for j in range(k):
            if name == "balanced":
                ids[t, j] = (t * k + j) % E
                continue
            left = sum(h[e] for e in range(E) if e not in taken)
            target = (int(u[t, j]) * left) >> 32
            running = 0
            for e in range(E):
                if e in taken:
                    continue
                running += h[e]
                if running > target:
                    break
            taken.append(e)
            ids[t, j] = e
        weights[t] = nw[t].astype(np.float32) / np.float32(int(nw[t].sum()))
    return ids, weights


def main(sets):
    bad = 0
    for path in sets:
        cfg = json.load(open(os.path.join(path, "manifest.json")))["config"]
        name, step = cfg["workload"], int(cfg["workload-step"])
        got, _ = st.load(os.path.join(path, "router.safetensors"))
        ids, weights = route(name, int(cfg["seed"]), step, int(cfg["experts"]),
                             int(cfg["ranks"]), int(cfg["tokens"]), int(cfg["topk"]))
        same = (np.array_equal(got["router.topk_ids"], ids) and
                got["router.topk_weights"].tobytes() == weights.tobytes())
        print("%s  %s (%s) step %d: %s" % ("ok  " if same else "FAIL", name, os.path.basename(path), step,
                                      "ids and weights as docs/data.md §6 draws them" if same
                                      else "the dump differs from docs/data.md §6"))
        bad += not same
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
