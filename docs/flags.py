# SPDX-License-Identifier: MIT
"""Write docs/flags.md from the flag table, or check that it is current.

    /usr/bin/python3 docs/flags.py --write [--builddir DIR]   rewrite docs/flags.md
    /usr/bin/python3 docs/flags.py --check [--builddir DIR]   exit 1 when it is stale

The table is src/core/flags.c's flag table as `moe-ep COMMAND --help`
prints it, one row per flag: its argument, what it does, its range and
default, and the commands that take it. A flag whose text differs between
commands gets a row per text. tests/docs/flags runs --check.
"""
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
COMMANDS = ("run", "bench", "explain", "plan")
LINE = re.compile(r"^  (--[a-z0-9-]+)( \S+)?\s{2,}(.*)$")
DEFAULT = re.compile(r"\s*\(default ([^()]*)\)$")
RANGE = re.compile(r"\s*([\[(][^\[\]()]*\.\.[^\[\]()]*[\])])$")

HEADER = """# Flags

Every flag of every command, generated from the flag table
(src/core/flags.c) as `moe-ep COMMAND --help` prints it:
`/usr/bin/python3 docs/flags.py --write` rewrites this page, and
tests/docs/flags fails when it is stale. A range `[a..b]` includes both
ends, `(a..b]` not a. `moe-ep verify` takes no flags: `moe-ep verify
GOLDEN_DIR CANDIDATE.safetensors` (docs/golden.md).

| flag | meaning | range | default | commands |
|---|---|---|---|---|
"""


def cell(text):
    return text.replace("|", "\\|")


def rows(builddir):
    table = {}  # (flag, argument, meaning, range, default) -> [commands]
    order = []
    for command in COMMANDS:
        help_text = subprocess.run([os.path.join(builddir, "moe-ep"), command, "--help"], check=True,
                                   stdout=subprocess.PIPE, text=True).stdout
        for line in help_text.split("\n"):
            m = LINE.match(line)
            if not m or m.group(1) == "--help":
                continue
            meaning, default, bounds = m.group(3), "", ""
            d = DEFAULT.search(meaning)
            if d:
                default, meaning = d.group(1), meaning[: d.start()]
            r = RANGE.search(meaning)
            if r:
                bounds, meaning = r.group(1), meaning[: r.start()]
            key = (m.group(1), (m.group(2) or "").strip(), meaning.strip(), bounds, default)
            if key not in table:
                table[key] = []
                order.append(key)
            table[key].append(command)
    return [(key, table[key]) for key in order]


def render(builddir):
    out = [HEADER]
    for (flag, argument, meaning, bounds, default), commands in rows(builddir):
        name = "`%s%s`" % (flag, " " + argument if argument else "")
        out.append("| %s | %s | %s | %s | %s |\n" % (cell(name), cell(meaning), cell(bounds), cell(default),
                                                    " ".join(commands)))
    return "".join(out)


def main(argv):
    mode = argv[1] if len(argv) > 1 else ""
    if mode not in ("--write", "--check"):
        sys.exit(__doc__)
    builddir = argv[argv.index("--builddir") + 1] if "--builddir" in argv else os.path.join(HERE, "..")
    path = os.path.join(HERE, "flags.md")
    text = render(builddir)
    if mode == "--write":
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        print("flags.py: docs/flags.md written (%d rows)" % text.count("\n| `"))
        return 0
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    if old == text:
        print("flags.py: docs/flags.md is current (%d rows)" % text.count("\n| `"))
        return 0
    old_lines, new_lines = old.split("\n"), text.split("\n")
    for n, (a, b) in enumerate(zip(old_lines, new_lines)):
        if a != b:
            print("STALE: docs/flags.md line %d\n  doc: %s\n  now: %s" % (n + 1, a, b))
            break
    else:
        print("STALE: docs/flags.md has %d lines, the flag table gives %d" % (len(old_lines), len(new_lines)))
    print("flags.py: refresh with: /usr/bin/python3 docs/flags.py --write")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
