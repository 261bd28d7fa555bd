# SPDX-License-Identifier: MIT
"""python3 -m moe_ep verify [--require STAGE,...|all] [--allow-unknown] [--]
GOLDEN_DIR CANDIDATE.safetensors — as `moe-ep verify`: the per-tensor table,
then PASS or the first failing stage; exit 0 all within contract, 1 some not
(or a required stage missing), 2 files that cannot be read or a tensor name
the set does not hold."""
import sys

from . import verify


def main(argv):
    args, require, allow_unknown = argv[1:], (), False
    while args and args[0].startswith("--"):
        if args[0] == "--":  # the paths follow, even ones that begin with --
            args = args[1:]
            break
        if args[0] == "--allow-unknown":
            allow_unknown, args = True, args[1:]
        elif args[0] == "--require" and len(args) > 1:
            require, args = args[1], args[2:]
        else:
            break
    if argv[:1] != ["verify"] or len(args) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        result = verify(args[0], args[1], require, allow_unknown)
    except ValueError as e:
        print("moe_ep: %s" % e, file=sys.stderr)
        return 2
    sys.stdout.write(result.table)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
