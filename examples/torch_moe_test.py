# SPDX-License-Identifier: MIT
"""A torch MoE layer checked against moe-ep's dense truth, the way a
vLLM or SGLang kernel test checks a fused MoE: same weights, same tokens,
the layer's own top-k, then the output compared under moe-ep's tolerance
(moe_ep.check) instead of a hand-picked atol. Runs on CUDA when there is
one (TF32 off: the contract is fp32 GEMMs), else on the CPU.

    PYTHONPATH=python MOE_EP_LIBRARY=.libs/libmoe-ep.so python3 examples/torch_moe_test.py

Exit 0 when the layer passes, 1 when it does not, 77 without torch."""
import sys

import numpy as np

try:
    import torch
except ImportError:
    print("SKIP: torch is not installed")
    sys.exit(77)

import moe_ep


def torch_moe(x, w1, w2, gate, topk, shared_w1, shared_w2):
    """The layer under test: softmax router, top-k renormalised, SwiGLU
    experts (W1 rows [0, f) gate, [f, 2f) up), shared experts added."""
    f = w2.shape[-1]
    probs = torch.softmax(x @ gate.T, dim=-1)
    weights, ids = torch.topk(probs, topk, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    y = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        if rows.numel():
            h = x[rows] @ w1[e].T
            a = torch.nn.functional.silu(h[:, :f]) * h[:, f:]
            y.index_add_(0, rows, (a @ w2[e].T) * weights[rows, slots, None])
    for s in range(shared_w1.shape[0]):
        h = x @ shared_w1[s].T
        y += (torch.nn.functional.silu(h[:, :f]) * h[:, f:]) @ shared_w2[s].T
    return y, ids, weights


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = moe_ep.Config(preset="tiny", tokens=64, shared_experts=1, router="softmax")
    s = cfg.shape
    E, S = s["experts"], s["shared_experts"]
    w1, w2 = map(np.stack, zip(*[cfg.expert(e) for e in range(E)]))
    sw1, sw2 = map(np.stack, zip(*[cfg.expert(n, shared=True) for n in range(S)]))
    x = cfg.tokens(rank=0)
    t = lambda a: torch.from_numpy(a).to(device)
    y, ids, weights = torch_moe(t(x), t(w1), t(w2), t(cfg.gate()), s["topk"], t(sw1), t(sw2))
    result = moe_ep.check(y, x, ids.to(torch.int32), weights, cfg, w1=w1, w2=w2,
                          shared_w1=sw1, shared_w2=sw2)
    print("torch MoE on %s vs moe_ep.reference: %s (%.1f %% of the tolerance used)%s"
          % (device, "PASS" if result else "FAIL", 100 * result.used,
             "" if result else ": " + result.message))
    return 0 if result else 1


if __name__ == "__main__":
    sys.exit(main())
