# SPDX-License-Identifier: MIT
# tier.sh — the test tier, sourced by the test scripts.
#
# `make check` (the README's `./run check`) runs the fast tier,
# MOE_EP_TIER=fast: every feature and every path at least once, within five
# minutes on two cores. `make check-full` runs the full tier: every row of
# every table. A script run by hand, with no MOE_EP_TIER, runs the full tier.
tier=${MOE_EP_TIER:-full}
case $tier in
  fast|full) ;;
  *) echo "MOE_EP_TIER must be fast or full, got '$tier'" >&2; exit 99 ;;
esac

# full CMD...: run CMD in the full tier only (a success in the fast tier).
full() { [ "$tier" != full ] || "$@"; }

# tier_row ROW: a table row that begins with 'full ' belongs to the full
# tier only. Prints ROW without that word when this tier runs it; fails
# when it does not.
tier_row() {
  case $1 in
    'full '*) [ "$tier" = full ] && echo "${1#full }" ;;
    *) echo "$1" ;;
  esac
}
