# SPDX-License-Identifier: MIT
"""Print `NP ARGS...` that regenerate a golden set from its manifest's config.

    /usr/bin/python3 tests/golden/regenerate-args.py data/golden/NAME/manifest.json
"""
import json
import sys

config = json.load(open(sys.argv[1]))["config"]
ranks = config.pop("ranks")
args = []
for key, value in config.items():
    if key in ("preset", "check", "iters") or value == "":
        continue  # the preset's values are all listed; a check changes nothing written
    args.append("--%s=%s" % (key, value))
print(ranks, " ".join(args))
