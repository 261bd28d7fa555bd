# SPDX-License-Identifier: MIT
"""A port of the expert-parallel MoE layer in torch, written from
docs/golden.md alone the way a GPU engineer writes one (whole-tensor ops,
one GEMM per expert, autograd for the training step), checked against
golden sets with moe-ep verify.

    PYTHONPATH=python MOE_EP_LIBRARY=.libs/libmoe-ep.so \\
        python3 examples/torch_port.py [--bf16-gemm] data/golden/*/

For each set it reads the inputs (tokens, gate, experts) and the manifest's
config, computes every stage — the gate, DeepEP's layout counts, each
rank's dispatched rows (FP8 with the set's recipe, or bf16), each rank's
expert outputs and, with the reduced combine, the sums it sends home, the
layer output, and with --backward every gradient through autograd — and
requires verify to check each of those stages. It runs on CUDA unchanged
when there is one (TF32 off: the contract is fp32 GEMMs), else on the CPU.
What the port takes from the set rather than computing: the inputs, and
the pairs a capacity dropped (layout.kept_ids) or sent to a copy
(layout.physical_ids, layout.replica_of), which are policies of the
balancer, not of the layer (docs/load-balance.md).

--bf16-gemm rounds the first GEMM's output to bf16 before the activation,
as a bf16 grouped GEMM writes it: a rounding that a set made without
--gemm-out-dtype bf16 does not make, which verify fails at the experts
stage (docs/golden.md, "The precision a port must keep").

Exit 0 when the port passes every set, 1 when one fails, 77 without torch.
"""
import json
import os
import sys

try:
    import torch
except ImportError:
    print("SKIP: torch is not installed")
    sys.exit(77)

import moe_ep
from moe_ep import safetensors

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
F32 = torch.float32
BF16_GEMM = False  # --bf16-gemm


def load(golden):
    """The manifest's config and every tensor of the set, as torch tensors."""
    manifest = json.load(open(os.path.join(golden, "manifest.json")))
    tensors = {}
    for stage in ("inputs", "layout", "backward"):
        path = os.path.join(golden, stage + ".safetensors")
        if stage in manifest["stages"] and os.path.exists(path):
            for name, array in safetensors.load(path)[0].items():
                tensors[name] = torch.from_numpy(array.copy()).to(DEVICE)
    return manifest["config"], tensors


def bf16(v):
    """v rounded to bfloat16 (nearest even), held in fp32."""
    return v.to(torch.bfloat16).to(F32)


def e4m3(v):
    """v rounded to E4M3 (nearest even, saturating at 448), in fp32."""
    v = v.clamp(-448.0, 448.0)
    if hasattr(torch, "float8_e4m3fn"):
        return v.to(torch.float8_e4m3fn).to(F32)
    a = v.abs()  # torch < 2.1 has no float8: the quantum of |v|'s binade
    _, e = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))
    quantum = torch.ldexp(torch.ones_like(a), (e - 1).clamp(min=-6) - 3)
    return torch.copysign(torch.round(a / quantum) * quantum, v)


def pow2_at_least(s):
    """The smallest power of two >= s (a UE8M0 scale)."""
    m, e = torch.frexp(s)
    return torch.ldexp(torch.ones_like(s), torch.where(m == 0.5, e - 1, e))


def fp8_dispatch(x, recipe, ue8m0):
    """Rows x (n, d) as they arrive in FP8 (or an activation re-quantised):
    one scale per block of 128 of a row, computed as the recipe's code
    computes it (golden.md section 7), dequantised (value times scale, in
    fp32)."""
    n, d = x.shape
    blocks = -(-d // 128)
    xb = torch.nn.functional.pad(x, (0, blocks * 128 - d)).view(n, blocks, 128)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    a = amax.clamp(min=1e-4)
    one = torch.ones_like(a)
    if recipe == "moe":
        s = torch.where(amax > 0, amax / 448.0, one)
        if ue8m0:
            s = torch.where(amax > 0, pow2_at_least(s).clamp(min=2.0 ** -126), s)
        q = e4m3(xb / s)
    elif recipe == "deepep":
        s = a * torch.tensor(1.0 / 448.0, dtype=F32, device=x.device)
        if ue8m0:
            s = pow2_at_least(s)
            q = e4m3(xb * (one / s))
        else:
            q = e4m3(xb * (448.0 / a))
    else:
        s = a / 448.0
        if ue8m0:
            s = pow2_at_least(s)
        q = e4m3(xb * (one / s)) if recipe == "deepgemm" else e4m3(xb / s)
    return (q * s).view(n, blocks * 128)[:, :d]


def route(x, cfg, t):
    """router.*: logits, scores, selection, the top-k ids and weights."""
    logits = x @ t["gate.weight"].T
    z = logits + t["router.skew"] if "router.skew" in t else logits
    v3, bias = cfg["router"] == "deepseek-v3", t.get("gate.bias")
    sigmoid = v3 and bias is not None
    scores = torch.sigmoid(z) if sigmoid else torch.softmax(z, dim=-1)
    selection = scores + bias if bias is not None else scores
    groups, keep, k = int(cfg["groups"]), int(cfg["topk-groups"]), int(cfg["topk"])
    masked = selection.detach()
    if v3 and groups > 1:  # keep the best groups, every other group's experts at -inf
        member = masked.view(masked.shape[0], groups, -1)
        score = member.topk(2, dim=-1).values.sum(-1) if bias is not None else member.amax(-1)
        best = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :keep]
        kept = torch.zeros_like(score, dtype=torch.bool).scatter_(1, best, True)
        masked = member.masked_fill(~kept[:, :, None], float("-inf")).view_as(masked)
    ids = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]  # ties: lower id
    weights = scores.gather(1, ids)
    if cfg["norm-topk"] == "true" or sigmoid or (cfg["norm-topk"] == "auto" and not v3):
        weights = (weights.double() / weights.double().sum(-1, keepdim=True)).to(F32)
    weights = weights * torch.tensor(float(cfg["route-scale"]), dtype=F32, device=x.device)
    if cfg["topk-weights-dtype"] == "bf16":  # DeepSeek-V3's weights.type_as(x)
        weights = bf16(weights)
    return {"router.logits": logits, "router.scores": scores, "router.selection": selection,
            "router.topk_ids": ids, "router.topk_weights": weights}


def owners(experts, ranks):
    """The rank of each expert: contiguous blocks, the first E mod G ranks
    one expert more."""
    b, extra = divmod(experts, ranks)
    sizes = [b + (r < extra) for r in range(ranks)]
    return torch.repeat_interleave(torch.arange(ranks, device=DEVICE), torch.tensor(sizes, device=DEVICE))


def swiglu_ffn(x, w1, w2, scale=None, cfg=None):
    """SwiGLU: W1 rows [0, f) gate, [f, 2f) up, in fp32; with cfg, a routed
    expert's rounding points as a DeepGEMM pipeline has them: the GEMM
    outputs in bf16 (gemm-out-dtype), the activation re-quantised to FP8
    per block of 128 of a row, or to bf16 (act-dtype)."""
    cfg = cfg or {}
    gemm_bf16 = cfg.get("gemm-out-dtype") == "bf16"
    h = x @ w1.T
    gate, up = (bf16(h) if BF16_GEMM or gemm_bf16 else h).chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    if scale is not None:  # the gate weight before L2
        act = act * scale[:, None]
    if cfg.get("act-dtype") == "fp8":
        act = fp8_dispatch(act, cfg["fp8-recipe"], cfg["fp8-scale"] == "ue8m0")
    elif cfg.get("act-dtype") == "bf16":
        act = bf16(act)
    y = act @ w2.T
    return bf16(y) if gemm_bf16 else y


def layer(cfg, t, x, params, out):
    """The forward from x through every rank to output.y; candidate tensors
    into out, the differentiable output returned."""
    G, k = int(cfg["ranks"]), int(cfg["topk"])
    router = route(x, cfg, {**t, "gate.weight": params["gate.weight"]})
    out.update(router)
    ids, weights = router["router.topk_ids"], router["router.topk_weights"]
    pairs = t.get("layout.physical_ids", t.get("layout.kept_ids", ids)).long()
    logical = t.get("layout.replica_of", torch.arange(params["experts.w1"].shape[0], device=DEVICE)).long()
    owner = owners(logical.shape[0], G)
    rank_of = torch.where(pairs >= 0, owner[pairs.clamp(min=0)], torch.full_like(pairs, -1))
    N = x.shape[0]
    in_rank = torch.stack([(rank_of == r).any(-1) for r in range(G)], dim=1)
    home = torch.arange(N, device=DEVICE) // (N // G)
    kept = ids.masked_fill(pairs < 0, -1).long()
    rpn = int(cfg["ranks-per-node"]) or G
    out.update({"layout.is_token_in_rank": in_rank,
                "layout.tokens_per_rank": in_rank.sum(0).int(),
                "layout.tokens_per_expert": torch.bincount(kept[kept >= 0], minlength=int(cfg["experts"])).int(),
                "layout.tokens_per_node": in_rank.view(N, -1, rpn).any(-1).sum(0).int(),
                "layout.send_counts": torch.stack([in_rank[home == r].sum(0) for r in range(G)]).int()})
    before_l2 = cfg["weight-at"] == "activation"
    reduced = cfg["combine"] == "reduced"
    y = torch.zeros_like(x)
    term = {}  # (rank, slot) -> that slot's term of each token, for the per-pair combine
    for r in range(G):
        tokens = in_rank[:, r].nonzero().squeeze(1)  # by source rank, then token
        rows = x[tokens]
        if cfg["dispatch-dtype"] == "fp8":
            rows = fp8_dispatch(rows, cfg["fp8-recipe"], cfg["fp8-scale"] == "ue8m0")
        elif cfg["dispatch-dtype"] == "bf16":
            rows = bf16(rows)
        out["dispatch.rank%d.x" % r], out["dispatch.rank%d.token" % r] = rows, tokens.int()
        local = rank_of[tokens] == r  # (rows, k): this rank's pairs, by row then slot
        row, slot = local.nonzero(as_tuple=True)
        expert = pairs[tokens[row], slot]
        result = torch.zeros(row.shape[0], x.shape[1], dtype=F32, device=DEVICE)
        for e in expert.unique().tolist():  # one GEMM per local expert
            at = (expert == e).nonzero().squeeze(1)
            w = weights[tokens[row[at]], slot[at]]
            result = result.index_put((at,), swiglu_ffn(rows[row[at]], params["experts.w1"][logical[e]],
                                                         params["experts.w2"][logical[e]],
                                                         w if before_l2 else None, cfg))
        if cfg["combine-dtype"] == "bf16" and not reduced:
            result = bf16(result)
        out["experts.rank%d.out" % r] = result
        out["experts.rank%d.pair" % r] = torch.stack([tokens[row], expert], 1).int()
        weighted = result if before_l2 else result * weights[tokens[row], slot][:, None]
        if reduced:  # each received row's pairs summed in slot order, rounded as it travels
            sums = torch.zeros_like(rows)
            for s in range(k):
                at = (slot == s).nonzero().squeeze(1)
                sums = sums.index_add(0, row[at], weighted[at])
            sums = bf16(sums) if cfg["combine-dtype"] == "bf16" else sums
            out["experts.rank%d.sum" % r] = sums
            y = y.index_add(0, tokens, sums)  # home adds the ranks' rows in rank order
        else:
            for s in range(k):
                at = (slot == s).nonzero().squeeze(1)
                term[(r, s)] = (tokens[row[at]], weighted[at])
    for s in range(k if not reduced else 0):  # home sums a token's terms in slot order
        for r in range(G):
            if (r, s) in term:
                y = y.index_add(0, *term[(r, s)])
    for s in range(params["shared.w1"].shape[0] if "shared.w1" in params else 0):
        y = y + swiglu_ffn(x, params["shared.w1"][s], params["shared.w2"][s])
    if cfg["output-dtype"] == "bf16":  # the output as DeepEP's combine hands it back
        y = y.to(torch.bfloat16)
    out["output.y"] = y
    return y


def port(golden):
    """The candidate tensors of one set, and the stages they cover."""
    cfg, t = load(golden)
    trains = cfg["backward"] == "true"
    names = ("experts.w1", "experts.w2", "shared.w1", "shared.w2", "gate.weight")
    params = {n: t[n].clone().requires_grad_(trains) for n in names if n in t}
    x = t["tokens.x"].clone().requires_grad_(trains)
    out = {}
    y = layer(cfg, t, x, params, out)
    stages = ["router", "layout", "dispatch", "experts", "output"]
    if trains:  # the training step: dL/dy = backward.dy, everything else autograd
        y.backward(t["backward.dy"])
        out.update({"backward.dx": x.grad, "backward.experts.dw1": params["experts.w1"].grad,
                    "backward.experts.dw2": params["experts.w2"].grad,
                    "backward.gate.dw": params["gate.weight"].grad})
        if "shared.w1" in params:
            out.update({"backward.shared.dw1": params["shared.w1"].grad,
                        "backward.shared.dw2": params["shared.w2"].grad})
        stages.append("backward")
    return {n: v.detach() for n, v in out.items()}, stages


def main(args):
    global BF16_GEMM
    BF16_GEMM = "--bf16-gemm" in args
    sets = [a for a in args if a != "--bf16-gemm"]
    if not sets or any(a.startswith("-") for a in sets):
        print(__doc__.strip())
        return 2
    failed = 0
    for golden in sets:
        candidate, stages = port(golden)
        result = moe_ep.verify(golden, candidate, require=stages)
        name = os.path.basename(os.path.normpath(golden))
        print("%-20s %s (%d tensors, on %s)" % (name, "PASS" if result.passed else "FAIL", len(candidate), DEVICE))
        if not result.passed:
            print(result.table)
            failed += 1
    print("torch port: %d of %d sets passed" % (len(sets) - failed, len(sets)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
