# SPDX-License-Identifier: MIT
"""Check `moe-ep explain`'s printed walk against the golden set of the same run.

    /usr/bin/python3 tests/mpi/explain_check.py WALK.txt GOLDEN_DIR TOKENS

Every number the walk prints is looked up in the dump (numpy and the
safetensors reader of tests/golden, no C code of moe-ep): values printed with
%.6g must agree to 6 significant digits, those with %.4g to 4; ids, ranks,
receive rows and row counts exactly. The shared experts' outputs, which the
set does not hold, are recomputed in float64 from its weights. The
two-stage dispatch's lines: each node's relay is the rank of the home's
local index there, it forwards to the node's ranks holding the token's
experts, the rows crossing the inter-node tier are one per other node
(the flat dispatch's one per other node's rank), and each node's sum is
the set's relay sum; the low-latency lines: each pair's buffer slot holds
the token in the set's masked layout. Exit 0 when all agree; the last line
says how many numbers were compared.
"""
import json
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "golden"))
import st  # noqa: E402
from recompute import expert_ranks, ffn  # noqa: E402

compared = 0
errors = []


def values(text):
    inner = text[text.index("[") + 1 : text.index("]")]
    return [float(v) for v in inner.split(",") if v.strip() != "..."]


def near(what, printed, exact, digits):
    global compared
    printed = np.atleast_1d(np.asarray(printed, dtype=np.float64))
    exact = np.atleast_1d(np.asarray(exact, dtype=np.float64))[: len(printed)]
    compared += len(printed)
    bound = 0.6 * 10.0 ** (1 - digits) * np.abs(exact) + 1e-30
    if len(printed) != len(exact) or np.any(np.abs(printed - exact) > bound):
        errors.append("%s: printed %s, the dump has %s" % (what, printed.tolist(), exact.tolist()))


def same(what, printed, exact):
    global compared
    compared += 1
    if printed != exact:
        errors.append("%s: printed %s, the dump has %s" % (what, printed, exact))


def main(walk_path, golden, tokens):
    t = {}
    for name in ("inputs", "router", "dispatch", "experts", "output", "layout"):
        t.update(st.load(os.path.join(golden, name + ".safetensors"))[0])
    config = json.load(open(os.path.join(golden, "manifest.json")))["config"]
    R = int(config["ranks-per-node"]) or int(config["ranks"])
    lines = open(walk_path).read().splitlines()
    head = re.match(r"moe-ep explain · G=(\d+) ranks · T=(\d+) tokens per rank · d=\d+ f=\d+ E=(\d+) k=(\d+)", lines[0])
    G, T, E, k = (int(v) for v in head.groups())
    owner = expert_ranks(E, G)
    ids_all, weights_all = t["router.topk_ids"], t["router.topk_weights"]
    counts = t["layout.send_counts"]
    received_pairs = np.bincount(owner[ids_all.ravel()], minlength=G)
    seen = []
    token = rank = section = None
    for line in lines[1:]:
        m = re.match(r"token (\d+): rank (\d+)'s token (\d+)", line)
        if m:
            token = int(m.group(1))
            seen.append(token)
            same("token %d's home rank" % token, int(m.group(2)), token // T)
            same("token %d's local id" % token, int(m.group(3)), token % T)
            slot = 0
            arrived = set()
            continue
        label, rest = line[2:13].strip(), line[13:]
        section = label or section
        where = "token %s, %s" % (token, section)
        if section == "two-stage":
            home = token // T
            m = re.match(r"\s*node (\d+)", rest)
            if m:
                n = int(m.group(1))
                want = sorted({int(owner[e]) for e in ids_all[token] if owner[e] // R == n})
                got = [int(v) for v in re.findall(r"(\d+)(?: \(itself\))?(?:,|$)", rest.split("NVLink to rank")[1])]
                same(where + " node %d's ranks" % n, got, want)
                relay = re.search(r"its relay, rank (\d+)", rest)
                if relay:
                    same(where + " node %d's relay" % n, int(relay.group(1)), n * R + home % R)
                continue
            m = re.match(r"\s*(\d+) rows? cross(?:es)? the inter-node tier \(the flat dispatch would send (\d+)\)", rest)
            far = {int(owner[e]) for e in ids_all[token] if owner[e] // R != home // R}
            same(where + " IB rows", int(m.group(1)), len({r // R for r in far}))
            same(where + " flat IB rows", int(m.group(2)), len(far))
            continue
        if section == "low-latency":
            m = re.match(r"\s*expert (\d+): its own row, .* rank (\d+)'s buffer of local expert (\d+), "
                         r"source block (\d+), slot (\d+) of (\d+)", rest)
            e, r, l, src, slot_at, N = (int(v) for v in m.groups())
            same(where + " expert %d's rank" % e, r, int(owner[e]))
            same(where + " expert %d's source block" % e, src, token // T)
            same(where + " expert %d's slot" % e, int(t["dispatch.rank%d.layout.src" % r][l, src * N + slot_at]), token)
            continue
        if label == "x":
            near(where, values(rest), t["tokens.x"][token], 6)
        elif label in ("logits", "scores"):
            v = [float(x) for x in re.findall(r"e\d+ (\S+)", rest)]
            near(where, v, t["router." + label][token], 4)
        elif re.match(r"expert \d+:", rest.strip()) and section == "top-k":
            m = re.match(r"\s*expert (\d+): logit (\S+), score (\S+), weight (\S+); on rank (\d+), node \d+", rest)
            e = int(m.group(1))
            same(where + " slot %d id" % slot, e, int(ids_all[token, slot]))
            near(where + " logit", float(m.group(2).rstrip(",")), t["router.logits"][token, e], 4)
            near(where + " score", float(m.group(3).rstrip(",")), t["router.scores"][token, e], 4)
            near(where + " weight", float(m.group(4).rstrip(";")), weights_all[token, slot], 6)
            same(where + " rank", int(m.group(5)), int(owner[e]))
            slot += 1
        elif label == "dispatch":
            m = re.match(r"\s*(\d+) pairs?, (\d+) rows?", rest)
            same(where + " pairs", int(m.group(1)), k)
            ranks = {int(owner[e]) for e in ids_all[token]}
            same(where + " rows", int(m.group(2)), k if "low-latency" in rest else len(ranks))
        elif label == "arrives" and "buffer slots" in rest:  # the low-latency mode
            rank = int(re.match(r"\s*rank (\d+)", rest).group(1))
            arrived.add(rank)
        elif label.startswith("node ") and label.endswith(" sum"):
            n = int(label.split()[1])
            row = int(np.nonzero(t["experts.node%d.token" % n] == token)[0][0])
            near(where, values(rest), t["experts.node%d.sum" % n][row], 6)
        elif label == "arrives":
            m = re.match(r"\s*rank (\d+)[^:]*: receive row (\d+) of (\d+)", rest)
            rank = int(m.group(1))
            arrived.add(rank)
            got = t["dispatch.rank%d.token" % rank]
            hits = np.nonzero(got == token)[0]
            same(where + " rank %d receive row" % rank, int(m.group(2)), int(hits[0]) if len(hits) else -1)
            same(where + " rank %d rows" % rank, int(m.group(3)), len(got))
        elif label.startswith("expert "):
            e = int(label.split()[1])
            pair = t["experts.rank%d.pair" % rank]
            p = np.nonzero((pair[:, 0] == token) & (pair[:, 1] == e))[0]
            if len(p) != 1:
                errors.append("%s: rank %d has no pair (%d, %d)" % (where, rank, token, e))
                continue
            near(where + " on rank %d" % rank, values(rest), t["experts.rank%d.out" % rank][p[0]], 6)
        elif label == "back (sum)":
            row = int(np.nonzero(t["dispatch.rank%d.token" % rank] == token)[0][0])
            near(where + " on rank %d" % rank, values(rest), t["experts.rank%d.sum" % rank][row], 6)
        elif label.startswith("shared "):
            s = int(label.split()[1])
            x = t["tokens.x"][token].astype(np.float64)
            exact = ffn(x[None, :], t["shared.w1"][s].astype(np.float64), t["shared.w2"][s].astype(np.float64))[0]
            near(where, values(rest), exact, 4)
        elif label in ("y", "truth"):
            near(where, values(rest), t["output." + label][token], 6)
            if label == "y":
                expected = {int(owner[e]) for e in ids_all[token]}
                same("token %d's ranks" % token, sorted(arrived), sorted(expected))
        elif line.startswith("  from "):
            cells = line.split()
            src = int(cells[1])
            pairs = np.bincount(owner[ids_all[src * T : (src + 1) * T].ravel()], minlength=G)
            for dst, cell in enumerate(cells[2:]):
                rows, carried = (int(v) for v in cell.split("/"))
                same("rows from %d to %d" % (src, dst), rows, int(counts[src, dst]))
                same("pairs from %d to %d" % (src, dst), carried, int(pairs[dst]))
        elif line.startswith("  rank "):
            cells = line.split()
            r = int(cells[1])
            sent_pairs = ids_all[r * T : (r + 1) * T].size
            for what, cell, rows, carried in (("sent by", cells[2], counts[r, :].sum(), sent_pairs),
                                              ("received by", cells[3], counts[:, r].sum(), received_pairs[r])):
                printed_rows, printed_pairs = (int(v) for v in cell.split("/"))
                same("rows %s %d" % (what, r), printed_rows, int(rows))
                same("pairs %s %d" % (what, r), printed_pairs, int(carried))
    same("tokens walked", seen, [int(v) for v in tokens.split(",")])
    for e in errors[:20]:
        print("FAIL:", e)
    print("%d numbers compared with the dump, %d differ" % (compared, len(errors)))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
