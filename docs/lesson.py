# SPDX-License-Identifier: MIT
"""The load-balance lesson in one table: v3-mini at 8 ranks with a hot expert, and each cure.

    /usr/bin/python3 docs/lesson.py [--write] [--repeat N] [--builddir DIR] [--mpirun CMD]
    /usr/bin/python3 docs/lesson.py --quick      v3-mini's 32 tokens at 4 ranks, one run a row (a smoke test)

Runs `moe-ep run --check` once per row (N times, default 3, for the
expert time's median; everything else is the same in every run) and
prints a Markdown table; --write puts it in docs/routing.md between the lines
`<!-- lesson.py: begin -->` and `<!-- lesson.py: end -->`. The columns:

  experts max/mean    the busiest expert's pairs over the mean: the
                      logical experts' computed pairs (after drops), or
                      with copies each physical expert's
  ranks max/mean      the busiest rank's computed pairs over the mean
  slowest experts     the experts stage of the slowest rank, ms (the
                      median over the runs of the median over --iters)
  all-to-all          dispatch + combine bytes of one forward, all ranks
  dropped             the (token, expert) pairs the capacity dropped
  output error        max |y - the dense truth of the layer without
                      drops| (for rows without drops, the truth's own
                      check)
"""
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import learn  # noqa: E402  (the environment and the launcher of the docs' commands)

BASE = "mpirun -np 8 ./moe-ep run --preset v3-mini --skew hot:0=+2 --ranks-per-node 4 --iters 5 --check"
QUICK = "mpirun -np 4 ./moe-ep run --preset v3-mini --tokens 32 --skew hot:0=+2 --ranks-per-node 2 --iters 1 --check"
ROWS = [
    ("nothing", ""),
    ("capacity 1.0", "--capacity-factor 1"),
    ("capacity 1.25", "--capacity-factor 1.25"),
    ("bias update, 10 steps", "--steps 10 --bias-update 0.01"),
    ("bias update, 50 steps", "--steps 50 --bias-update 0.01"),
    ("8 redundant experts", "--redundant-experts 8"),
    ("16 redundant experts", "--redundant-experts 16"),
    ("bias, 50 steps + 8 redundant", "--steps 50 --bias-update 0.01 --redundant-experts 8"),
]
BEGIN, END = "<!-- lesson.py: begin -->", "<!-- lesson.py: end -->"


def find(pattern, text, default=None):
    m = re.search(pattern, text, re.M)
    if m:
        return m.group(1)
    if default is None:
        sys.exit("lesson.py: the report lacks /%s/" % pattern)
    return default


def figures(report):
    """The row's figures from one report."""
    f = {"check": find(r"^check: (PASS|FAIL)", report)}
    f["experts"] = float(find(r"tokens per expert .* imbalance ([\d.]+)", report))
    f["experts"] = float(find(r"tokens per physical expert .* imbalance ([\d.]+)", report, f["experts"]))
    f["experts"] = float(find(r"pairs per expert [\d.]+ routed, ([\d.]+) computed", report, f["experts"]))
    f["ranks"] = float(find(r"expert pairs computed per rank .* imbalance ([\d.]+)", report))
    header = report.split("\n").index(next(l for l in report.split("\n") if re.match(r"\s+route\s+plan", l)))
    names = report.split("\n")[header].split()
    f["experts_ms"] = float(report.split("\n")[header + 1].split()[names.index("experts")])
    f["dispatch"] = find(r"^traffic\s+dispatch ([\d.]+ \S+)", report)
    f["combine"] = find(r"^\s+combine\s+([\d.]+ \S+)", report)
    f["dropped"] = find(r"dropped (\d+ of \d+ pairs \([\d.]+%\))", report, "0")
    f["drop_share"] = find(r"dropped \d+ of \d+ pairs \(([\d.]+%)\)", report, "")
    f["error"] = float(find(r"against the truth of every pair max \|diff\| ([\d.e+-]+)", report,
                            find(r"^check: \S+ max_abs=([\d.e+-]+)", report)))
    f["error_rms"] = find(r"max \|diff\| [\d.e+-]+ = ([\d.e+-]+) x rms \(the cost of the drops", report, "")
    f["copies"] = find(r"memory: the copies' weights, ([\d.]+ \S+) in all", report, "")
    f["steps"] = find(r"^steps\s+(\d+) steps", report, "")
    return f


def costs(f):
    said = []
    if f["steps"]:
        said.append("%s training steps" % f["steps"])
    if f["copies"]:
        said.append("%s of copies" % f["copies"])
    if f["drop_share"]:
        said.append("%s of the pairs lost: the output moves %.1f x its rms"
                    % (f["drop_share"], float(f["error_rms"])))
    return "; ".join(said) or "nothing (the slowest rank sets the time)"


def table(quick, repeat, builddir, mpirun):
    env = learn.environment()
    lines = ["| | experts max/mean | ranks max/mean | slowest experts | all-to-all (dispatch + combine) "
             "| dropped | output error | what it costs |",
             "|---|---|---|---|---|---|---|---|"]
    for name, flags in ROWS:
        if quick:
            flags = flags.replace("--steps 50", "--steps 3").replace("--steps 10", "--steps 2")
            name = name.replace("50 steps", "3 steps").replace("10 steps", "2 steps")
        command = "%s %s" % (QUICK if quick else BASE, flags)
        runs = []
        for n in range(repeat):
            print("lesson.py: %s (%d/%d)" % (command, n + 1, repeat), file=sys.stderr)
            runs.append(figures(learn.run(command, builddir, env, mpirun)))
        f = runs[0]
        if any(r["check"] != "PASS" for r in runs):
            sys.exit("lesson.py: '%s' failed its check" % command)
        ms = statistics.median(r["experts_ms"] for r in runs)
        lines.append("| %s (`%s`) | %.2f | %.2f | %.1f ms | %s + %s | %s | %.2e | %s |"
                     % (name, flags or "none", f["experts"], f["ranks"], ms, f["dispatch"],
                        f["combine"], f["dropped"], f["error"], costs(f)))
    return "\n".join(lines)


def main(argv):
    builddir = argv[argv.index("--builddir") + 1] if "--builddir" in argv else os.path.join(HERE, "..")
    mpirun = argv[argv.index("--mpirun") + 1] if "--mpirun" in argv else None
    quick = "--quick" in argv
    repeat = int(argv[argv.index("--repeat") + 1]) if "--repeat" in argv else 1 if quick else 3
    text = table(quick, repeat, builddir, mpirun)
    if "--write" not in argv:
        print(text)
        return 0
    readme = os.path.join(HERE, "routing.md")
    old = open(readme).read()
    if BEGIN not in old or END not in old:
        sys.exit("lesson.py: docs/routing.md lacks the lines %s and %s" % (BEGIN, END))
    head, rest = old.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    command = BASE.replace("mpirun -np 8 ./moe-ep", "moe-ep").replace(" --check", "")
    block = ("%s\n`mpirun -np 8 %s` with the flags of each row, `--check`, %d runs a row "
             "(written by `docs/lesson.py --write`):\n\n%s\n%s"
             % (BEGIN, command.replace("moe-ep run", "./moe-ep run"), repeat, text, END))
    open(readme, "w").write(head + block + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
