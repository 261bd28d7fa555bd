# SPDX-License-Identifier: MIT
"""Every numpy check of one golden set, in one process (numpy is imported
once, not once a check):

    /usr/bin/python3 tests/golden/check_set.py GOLDEN_DIR

For a set made with --backward, recompute_backward.py first (every
gradient); then recompute.py (the output, within tolerance, in float64),
exact.py (the expert outputs and the truth bit for bit) and layouts.py (the
layout tensors exactly). Stops at the first check that fails; exit 0 when
all pass.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact  # noqa: E402
import layouts  # noqa: E402
import recompute  # noqa: E402
import recompute_backward  # noqa: E402


def main(golden):
    with open(os.path.join(golden, "manifest.json")) as f:
        backward = json.load(f)["config"].get("backward") == "true"
    checks = [recompute_backward.main] if backward else []
    for check in checks + [recompute.main, exact.main, layouts.main]:
        if check(golden) != 0:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
