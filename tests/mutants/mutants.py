# SPDX-License-Identifier: MIT
"""make mutants: apply each mutant of tests/mutants/mutants.txt alone to a
scratch copy of the tree and run the fast tier on it, stopping at the first
test that fails (the mutant is killed) or passing them all (it survived).

    /usr/bin/python3 tests/mutants/mutants.py --srcdir DIR --tests "TESTS" [--only NAME,...]

The scratch copy is the tree's git files (tracked, and untracked ones git
does not ignore), configured and built once; the unmutated copy must pass
the fast tier first. Each mutant then costs one incremental build. Tests run
in the order that kills soonest: the unit tests, the golden sets (they
regenerate every shipped set byte for byte), the MPI cases, the rest.
Prints one line a mutant and the kill rate; exit 0 when at least 90 % are
killed, 1 otherwise, 2 when a mutant no longer applies or the copy fails.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

GOAL = 0.90


def parse(path):
    mutants, current = [], None
    for line in open(path, encoding="utf-8"):
        line = line.rstrip("\n")
        if not line.strip() or line.startswith("#"):
            continue
        key, _, value = line.partition(" ")
        value = value.strip().replace("\\n", "\n")
        if key == "mutant":
            current = {"name": value}
            mutants.append(current)
        elif key in ("file", "from", "to", "why") and current is not None:
            current[key] = value
        else:
            sys.exit("mutants.txt: unexpected line: %s" % line)
    for m in mutants:
        missing = [k for k in ("file", "from", "to", "why") if k not in m]
        if missing:
            sys.exit("mutants.txt: mutant %s lacks %s" % (m["name"], ", ".join(missing)))
    return mutants


def sh(command, cwd, log, env=None, timeout=None):
    with open(log, "a") as out:
        out.write("$ %s\n" % command)
        out.flush()
        try:
            return subprocess.run(command, shell=True, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            out.write("timeout after %s s\n" % timeout)
            return 124


def copy_tree(srcdir, dest):
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=srcdir, check=True, stdout=subprocess.PIPE).stdout.split(b"\0")
    for name in files:
        if not name:
            continue
        name = name.decode()
        source = os.path.join(srcdir, name)
        if not os.path.isfile(source):
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
        shutil.copy2(source, os.path.join(dest, name))


def ordered(tests):
    tests = [t for t in tests.split() if t]
    def rank(t):
        if "tests/unit/" in t:
            return 0
        if t.endswith("golden-sets"):
            return 1
        if t.endswith(".case"):
            return 2
        return 3
    return sorted(tests, key=rank)  # sorted is stable: the Makefile's order within a rank


def run_tier(tree, tests, log):
    """The first test that fails, or None when every one passes."""
    env = dict(os.environ, MOE_EP_BUILDDIR=tree, MOE_EP_SRCDIR=tree, MOE_EP_TIER="fast")
    for test in tests:
        if test.endswith(".case"):
            command = "tests/mpi/mpi-case %s" % test
        else:
            command = "./%s" % test
        rc = sh(command, tree, log, env=env, timeout=900)
        if rc not in (0, 77):
            return test
    return None


def build(tree, log):
    return sh("make -s -j%d && make -s -j%d check TESTS=" % (os.cpu_count() or 2, os.cpu_count() or 2),
              tree, log) == 0


def main(argv):
    srcdir = argv[argv.index("--srcdir") + 1] if "--srcdir" in argv else "."
    tests = argv[argv.index("--tests") + 1] if "--tests" in argv else sys.exit(__doc__)
    only = argv[argv.index("--only") + 1].split(",") if "--only" in argv else None
    srcdir = os.path.abspath(srcdir)
    mutants = parse(os.path.join(srcdir, "tests", "mutants", "mutants.txt"))
    if only:
        mutants = [m for m in mutants if m["name"] in only]
    stale = []
    for m in mutants:
        count = open(os.path.join(srcdir, m["file"]), encoding="utf-8").read().count(m["from"])
        if count != 1:
            stale.append("%s: its text occurs %d times in %s" % (m["name"], count, m["file"]))
    if stale:
        print("mutants: these no longer apply (the code moved; update tests/mutants/mutants.txt):")
        print("\n".join("  " + s for s in stale))
        return 2
    tests = ordered(tests)
    scratch = tempfile.mkdtemp(prefix="moe-ep-mutants.")
    tree = os.path.join(scratch, "tree")
    log = os.path.join(scratch, "log")
    print("mutants: %d mutants, a scratch copy in %s (its log: %s)" % (len(mutants), tree, log), flush=True)
    copy_tree(srcdir, tree)
    start = time.time()
    if (sh("autoreconf -fi && ./configure -q", tree, log) != 0 or not build(tree, log)):
        print("mutants: the scratch copy does not build; see %s" % log)
        return 2
    failed = run_tier(tree, tests, log)
    if failed:
        print("mutants: the unmutated copy fails %s; see %s" % (failed, log))
        return 2
    print("mutants: the unmutated copy passes the fast tier (%d tests, %.0f s)" % (len(tests), time.time() - start),
          flush=True)
    killed, rows = 0, []
    for m in mutants:
        path = os.path.join(tree, m["file"])
        original = open(path, encoding="utf-8").read()
        with open(path, "w", encoding="utf-8") as f:
            f.write(original.replace(m["from"], m["to"], 1))
        began = time.time()
        with open(log, "a") as f:
            f.write("\n==== mutant %s\n" % m["name"])
        if not build(tree, log):
            verdict, by = "killed", "the build"
        else:
            by = run_tier(tree, tests, log)
            verdict = "killed" if by else "SURVIVED"
        with open(path, "w", encoding="utf-8") as f:
            f.write(original)
        os.utime(path)  # newer than the mutant's objects: the next build recompiles it
        killed += verdict == "killed"
        line = "%-8s %-28s %-34s %4.0f s  %s" % (verdict, m["name"], (by or "-").replace("tests/", ""),
                                                time.time() - began, m["why"])
        rows.append(line)
        print(line, flush=True)
    build(tree, log)
    rate = killed / len(mutants) if mutants else 1.0
    print("mutants: %d of %d killed (%.1f %%; the goal is %.0f %%) in %.0f s" %
          (killed, len(mutants), 100 * rate, 100 * GOAL, time.time() - start))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0 if rate >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
