# SPDX-License-Identifier: MIT
"""Fill the command outputs of docs/learn.md and the other docs, or check that they are current.

    /usr/bin/python3 docs/learn.py --write [--stale] [--builddir DIR] [--mpirun CMD]   rewrite the outputs
    /usr/bin/python3 docs/learn.py --check [--builddir DIR] [--mpirun CMD] [--only DOC] exit 1 when one is stale

--only DOC (learn.md, plan.md, load-balance.md, demo.md, routing.md, diagnosis.md, README.md) checks or writes
that document alone.

--write --stale rewrites only the outputs --check calls stale, so that the
figures of the others stay those the text around them quotes.

Each step of docs/learn.md (and each generated example of the other docs) marks
its command with a comment,

    <!-- learn: mpirun -np 4 ./moe-ep run --preset tiny | sed -n '/^routing/,/^traffic/p' -->

and the fenced block right after it holds `$ COMMAND` and what it printed.
The command runs in the build directory (where ./moe-ep is) with the
environment of tests/mpi/mpi-env.sh, its `mpirun` replaced by --mpirun
(the launcher the build was configured with, for an MPICH build). With `learn:` the output must match
exactly: routing, counts, bytes and values do not depend on the machine
(the packed GEMMs and the fixed-order truth give the same bits everywhere).
With `learn timed:` the output holds times, or figures of --check's BLAS
truth (its last bits follow the BLAS kernel); --check compares it with
every number on such a line replaced by "#" (TIMED says which lines), the
lines that name the machine left out (MACHINE), and every other line
exactly.
"""
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = [os.path.join(HERE, name) for name in ("learn.md", "plan.md", "load-balance.md", "demo.md", "routing.md",
                                               "diagnosis.md",
                                               os.path.join("..", "README.md"))]
MARK = re.compile(r"^<!-- learn( timed)?: (.*) -->$")
TIMED = re.compile(r"\d ?(ms|s|us|µs)\b|GFLOP/s|GB/s|tokens/s|peak resident|estimated up front|overlap|"
                   r"in MPI_Test|not computing|speed-up|ceiling|token chunks|expert slots|worst element|max_abs|^\s*[\d.\s]+$|\d+\.\d+x\b|"
                   r"^    W[0-7] [a-z-]+ +[\d.]+ ")
# Lines that name the machine (its cores, vector units, BLAS kernel), or the slow-rank verdict (whose
# words the timings decide): left out of a timed block's comparison.
MACHINE = re.compile(r"^machine |· gemm packed \(|OpenBLAS kernel|^verdict ")
NUMBER = re.compile(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?%?")


def environment():
    env = dict(os.environ)
    script = os.path.join(HERE, "..", "tests", "mpi", "mpi-env.sh")
    out = subprocess.run(["sh", "-c", ". '%s' && env -0" % script], capture_output=True, check=True)
    for item in out.stdout.split(b"\0"):
        if b"=" in item:
            key, value = item.split(b"=", 1)
            env[key.decode()] = value.decode()
    return env


def run(command, builddir, env, mpirun):
    if mpirun and command.startswith("mpirun "):
        command = mpirun + command[len("mpirun"):]
    done = subprocess.run(["sh", "-c", command], cwd=builddir, env=env, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        sys.exit("learn.py: '%s' failed (exit %d):\n%s" % (command, done.returncode, done.stderr))
    return done.stdout.rstrip("\n")


def masked(text):
    """Numbers on timed lines as "#", and their spacing (columns move with the widths) as one space."""
    return "\n".join("(machine)" if MACHINE.search(line)
                     else " ".join(NUMBER.sub("#", line).split()) if TIMED.search(line) else line
                     for line in text.split("\n"))


def steps(lines):
    """(index of the marker, timed, command, first and last line of its block)."""
    found = []
    for n, line in enumerate(lines):
        m = MARK.match(line)
        if not m:
            continue
        if n + 1 >= len(lines) or not lines[n + 1].startswith("```"):
            sys.exit("learn.py: line %d: a marker must be followed by a fenced block" % (n + 1))
        end = n + 2
        while end < len(lines) and lines[end] != "```":
            end += 1
        found.append((n, bool(m.group(1)), m.group(2), n + 1, end))
    return found


def main(argv):
    mode = argv[1] if len(argv) > 1 else ""
    builddir = argv[argv.index("--builddir") + 1] if "--builddir" in argv else os.path.join(HERE, "..")
    mpirun = argv[argv.index("--mpirun") + 1] if "--mpirun" in argv else None
    only_stale = mode == "--write" and "--stale" in argv
    only = argv[argv.index("--only") + 1] if "--only" in argv else None
    docs = [doc for doc in DOCS if only is None or os.path.basename(doc) == only]
    if not docs:
        sys.exit("learn.py: --only must name one of %s" % ", ".join(os.path.basename(d) for d in DOCS))
    if mode not in ("--write", "--check"):
        sys.exit(__doc__)
    env = environment()
    stale, count = [], 0
    for doc in docs:
        name = os.path.relpath(doc, os.path.join(HERE, ".."))
        lines = open(doc, encoding="utf-8").read().split("\n")
        found = steps(lines)
        count += len(found)
        for n, timed, command, first, last in reversed(found):
            output = run(command, builddir, env, mpirun)
            old = "\n".join(lines[first + 2 : last])
            current = (masked(old) == masked(output)) if timed else (old == output)
            if mode == "--write":
                if not (only_stale and current):
                    lines[first : last + 1] = ["```text", "$ " + command] + output.split("\n") + ["```"]
                    stale.append(None)
                continue
            if not current:
                stale.append(("%s line %d" % (name, n + 1), command, old, output))
        if mode == "--write":
            with open(doc, "w", encoding="utf-8") as f:
                f.write("\n".join(lines))
    if mode == "--write":
        print("learn.py: %d of %d outputs written" % (len(stale), count))
        return 0
    for where, command, old, new in reversed(stale):
        print("STALE: %s: %s" % (where, command))
        for a, b in zip(old.split("\n"), new.split("\n")):
            if (masked(a) != masked(b)) if TIMED.search(a) else a != b:
                print("  doc: %s\n  now: %s" % (a, b))
                break
    print("learn.py: %d of %d outputs current%s" % (count - len(stale), count,
          "" if not stale else "; refresh with: /usr/bin/python3 docs/learn.py --write"))
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
