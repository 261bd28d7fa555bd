# SPDX-License-Identifier: MIT
"""python3 -m moe_ep verify GOLDEN_DIR CANDIDATE.safetensors — as `moe-ep
verify`: the per-tensor table, then PASS or the first failing stage; exit
0 all within contract, 1 some not, 2 files that cannot be read."""
import sys

from . import verify


def main(argv):
    if len(argv) != 3 or argv[0] != "verify":
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        result = verify(argv[1], argv[2])
    except ValueError as e:
        print("moe_ep: %s" % e, file=sys.stderr)
        return 2
    sys.stdout.write(result.table)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
