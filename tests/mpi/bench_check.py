# SPDX-License-Identifier: MIT
"""Check the figures `moe-ep bench` prints against each other, not its labels.

    bench_check.py waves CSV SVG OUTPUT   the W sweep (tests/mpi/np2_bench.case)
    bench_check.py ll OUTPUT              the latency table and its crossover line
    bench_check.py ll-link OUTPUT         the same, under --link: the rounds' latency
                                          shows as a difference between the paths' rows

Exit 0 when every figure agrees, 1 (naming the figure) when one does not.
"""
import csv
import re
import sys

failures = []


def check(ok, what):
    print("%-4s %s" % ("ok" if ok else "FAIL", what))
    if not ok:
        failures.append(what)


def near(a, b, rel, absolute=0.0):
    return abs(a - b) <= rel * max(abs(a), abs(b)) + absolute


def kernel_line(text):
    """The FMA peak's limit no less than the peak of all ranks at once at any
    width, nor than the probes' median; the layer's GEMM on each rank's
    core: the slowest no faster than the fastest, each percentage its rate
    over one rank's limit, the bound the slowest's, and the cores called
    different exactly when the slowest is under 0.9 of the fastest (printed
    to 0.1 GFLOP/s: that much either way). Without an FMA peak (no x86 FMA)
    the line has no percentages."""
    line = re.search(r"fp32 FMA peak.*$", text, re.M).group(0)
    peak = "not measured" not in line
    if peak:
        limit = re.search(r"all ranks at once: ([\d.]+) \(one rank ([\d.]+); the probes' median ([\d.]+)\)$",
                          line)
        together = [float(t) for t in re.findall(r"-bit [\d.]+ / ([\d.]+)", line)]
        check(limit is not None and together and float(limit.group(1)) >= max(together),
              "the peak columns' limit is no less than the FMA peak of all ranks at once")
        check(limit is not None and float(limit.group(3)) <= float(limit.group(1)),
              "the probes' median is no more than the limit")
        rank_limit = float(limit.group(2)) if limit else float("nan")
    pct = r" \((\d+) % of a core's FMA peak\)" if peak else r"()"
    pct2 = r" \((\d+) %\)" if peak else r"()"
    bound = r"; so peak stays under about (\d+) %" if peak else r"()"
    m = re.search(r"each rank's core, all at once: .*: slowest rank (\d+) ([\d.]+) GFLOP/s" + pct +
                  r", fastest rank (\d+) ([\d.]+)" + pct2 + r"(.*?)" + bound + "$", text, re.M)
    check(m is not None, "the anchors give the layer's GEMM on each rank's core")
    if m is None:
        return None
    least, most = float(m.group(2)), float(m.group(5))
    check(least <= most, "slowest %.1f <= fastest %.1f GFLOP/s" % (least, most))
    check(m.group(1) != m.group(4) or least == most, "the slowest and the fastest are two ranks")
    if peak:
        least_pct, most_pct = int(m.group(3)), int(m.group(6))
        # each percentage, rounded to 1, and each rate, to 0.1, gives an
        # interval for the peak they were divided by: the two must meet
        def peak_range(rate, pct):
            return (100 * (rate - 0.05) / (pct + 0.5),
                    100 * (rate + 0.05) / (pct - 0.5) if pct > 0.5 else float("inf"))
        (lo1, hi1), (lo2, hi2) = peak_range(least, least_pct), peak_range(most, most_pct)
        # the limit is printed to 0.1: that much either way
        check(least_pct <= most_pct and max(lo1, lo2, rank_limit - 0.05) <= min(hi1, hi2, rank_limit + 0.05),
              "%d %% and %d %% are the two rates over one rank's limit, %.1f GFLOP/s"
              % (least_pct, most_pct, rank_limit))
        check(int(m.group(8)) == least_pct, "the bound is the slowest core's %d %%" % least_pct)
    differ = "cores differ" in m.group(7)
    ratio = least / most
    check(differ == (ratio < 0.9) or abs(ratio - 0.9) < 0.1 / most + 0.001,
          "the cores are called different (%s) exactly when %.1f / %.1f < 0.9" % (differ, least, most))
    return (rank_limit, least / rank_limit) if peak else None


def waves(text, csv_path, svg_path):
    header = re.search(r"G=(\d+) ranks · T=(\d+)", text)
    ranks, tokens = int(header.group(1)), int(header.group(2))
    anchor = float(re.search(r"^anchors\s+sgemm of the experts' FLOPs \(routed and shared\): ([\d.]+) ms",
                             text, re.M).group(1))
    rows = {}
    for m in re.finditer(r"^\s+(\d+) (expert slots|token chunks)\s+([\d.]+)\s+([\d.]+)-([\d.]+)\s+(\d+)\s+(\d+)\s+(\d+)%",
                         text, re.M):
        w, med, lo, hi = int(m.group(1)), float(m.group(3)), float(m.group(4)), float(m.group(5))
        per_s, per_rank, ceiling = int(m.group(6)), int(m.group(7)), int(m.group(8))
        rows[w] = med
        check(lo <= med <= hi, "W=%d: min %.2f <= median %.2f <= max %.2f ms" % (w, lo, med, hi))
        # the median is printed to 0.01 ms: the rate may be off by that much
        check(near(per_s, ranks * tokens / (med / 1e3), 0.0051 / med + 0.001),
              "W=%d: %d tokens/s is G T / the median layer (%d * %d / %.2f ms)" % (w, per_s, ranks, tokens, med))
        check(near(per_rank * ranks, per_s, 0.001, 2), "W=%d: per rank %d is tokens/s / G" % (w, per_rank))
        check(near(ceiling, 100 * anchor / med, 0.0051 / med + 0.0051 / anchor, 0.5),
              "W=%d: ceiling %d%% is the sgemm anchor %.2f ms / the layer %.2f ms" % (w, ceiling, anchor, med))
    check(len(rows) >= 1, "the table has %d rows" % len(rows))
    with open(csv_path) as f:
        table = list(csv.DictReader(f))
    check(sorted(int(r["waves"]) for r in table) == sorted(rows), "the CSV has one row per W of the table")
    for r in table:
        w = int(r["waves"])
        if w in rows:
            check(near(float(r["layer_ms"]), rows[w], 0.0, 0.006),
                  "W=%d: the CSV's layer_ms %s is the table's %.2f" % (w, r["layer_ms"], rows[w]))
            check(near(float(r["of_ceiling"]), anchor / float(r["layer_ms"]), 0.0051 / anchor + 0.001, 0.001),
                  "W=%d: the CSV's of_ceiling %s is the anchor / layer_ms" % (w, r["of_ceiling"]))
    kernel = kernel_line(text)
    if kernel:  # the run's anchors in every CSV row: the CSV's rounding, and the
        # rate and the limit the line prints to 0.1 GFLOP/s each
        rank_limit, gemm_of_peak = kernel
        for r in table:
            check(near(float(r["rank_fma_limit_gflops"]), rank_limit, 0.0, 0.051),
                  "W=%s: the CSV's rank_fma_limit_gflops %s is the line's one rank %.1f"
                  % (r["waves"], r["rank_fma_limit_gflops"], rank_limit))
            check(near(float(r["layer_gemm_of_fma_peak"]), gemm_of_peak, 0.0, 0.0006 + 0.1 / rank_limit),
                  "W=%s: the CSV's layer_gemm_of_fma_peak %s is the slowest rank's GEMM over that"
                  % (r["waves"], r["layer_gemm_of_fma_peak"]))
    svg = open(svg_path).read()
    check(svg.startswith("<svg") or "<svg" in svg[:200], "the plot is an SVG")
    check(svg.count("<circle") + svg.count("<rect") + svg.count("<polyline") >= len(rows),
          "the plot draws at least one mark per W")


def latency_rows(text):
    rows = []
    read = re.search(r"^weights .* / ([\d.]+) GB/s, its memory read rate", text, re.M)
    check(read is not None, "the weights line names the memory read rate")
    rate = float(read.group(1)) * 1e9 if read else float("nan")
    for m in re.finditer(r"^\s*(\d+)\s+(\d+), (\d+)\s+(\d+), (\d+)\s+(\d+), (\d+)\s+([\d.]+)\s+([\d.]+), (\d+)$",
                         text, re.M):
        t, normal, put, get, ratio = int(m.group(1)), int(m.group(2)), int(m.group(4)), int(m.group(6)), float(m.group(8))
        mib, bound = float(m.group(9)), int(m.group(10))
        # the MiB to 0.1, the rate to 0.1 GB/s, the bound to 1 us
        want = mib * 1048576 / rate * 1e6
        check(abs(bound - want) <= 0.06 * 1048576 / rate * 1e6 + want * 0.05 / (rate * 1e-9) + 1,
              "T=%d: weights bound %d us is %.1f MiB / %.1f GB/s" % (t, bound, mib, rate * 1e-9))
        for p, name in ((2, "normal"), (4, "put"), (6, "get")):
            med, p99 = int(m.group(p)), int(m.group(p + 1))
            check(med <= p99 + 1, "T=%d %s: median %d <= p99 %d us" % (t, name, med, p99))
        best = min(put, get)
        # the cells are rounded to 1 us, the ratio to 0.01
        check(abs(ratio - normal / best) <= (normal + 1) / max(best - 1, 1) - normal / best + 0.006,
              "T=%d: ratio %.2f is normal %d / best low-latency %d" % (t, ratio, normal, best))
        rows.append((t, normal, put, get, ratio))
    return rows


def ll(text):
    rows = latency_rows(text)
    check(len(rows) >= 2, "the latency table has %d rows" % len(rows))
    # the crossover, from the printed ratios: the first T from which on the
    # normal path is the faster at every larger T
    crossover = len(rows)
    for n, row in enumerate(rows):
        if row[4] >= 1.0:
            crossover = len(rows)
        elif crossover == len(rows):
            crossover = n
    line = re.search(r"^crossover (.*)$", text, re.M).group(1)
    if crossover == 0:
        want = "none here: the normal path is the faster at every T"
    elif crossover < len(rows):
        want = "the normal path is the faster from T = %d tokens per rank" % rows[crossover][0]
    else:
        want = "none here: the low-latency path is the faster at the largest T"
    # a ratio printed as 1.00 may hide either side of one: accept both readings there
    ambiguous = any(abs(r[4] - 1.0) < 0.006 for r in rows)
    check(line.startswith(want) or ambiguous, "crossover line '%s' follows from the ratios (%s)" % (line, want))
    return rows


def ll_link(text):
    rows = ll(text)
    link = re.search(r"inter-node [\d.]+ GB/s \+ (\d+) us", text)
    check(link is not None, "the link line names the inter-node latency")
    latency = int(link.group(1))
    for t, normal, put, get, _ in rows:
        # normal: one more round than a put (the count exchange); get: a pull, one more round a stage
        check(normal - put >= 0.8 * latency,
              "T=%d: normal %d - put %d us >= 0.8 x the %d us round the count exchange adds" % (t, normal, put, latency))
        check(get - put >= 0.8 * latency,
              "T=%d: get %d - put %d us >= 0.8 x the %d us round a pull adds" % (t, get, put, latency))


def main(argv):
    if len(argv) < 3 or argv[1] not in ("waves", "ll", "ll-link"):
        sys.exit(__doc__)
    text = open(argv[-1]).read()
    if argv[1] == "waves":
        waves(text, argv[2], argv[3])
    elif argv[1] == "ll":
        ll(text)
    else:
        ll_link(text)
    print("bench_check: %s" % ("every figure agrees" if not failures else "%d figures disagree" % len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
