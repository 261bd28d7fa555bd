#!/bin/sh
# SPDX-License-Identifier: MIT
# render-timeline.sh — render a --timeline SVG or a --report page to PNG in
# headless Chromium, to check that a browser draws it as intended.
#
#   docs/render-timeline.sh timeline.svg timeline.png
#   docs/render-timeline.sh report.html report.png [HEIGHT]   (1200 wide, HEIGHT tall: 2600)
#
# Needs Debian's chromium (apt-get install --no-install-recommends chromium).
# Exit 0 when the PNG was written, 1 otherwise.
set -eu
svg=$1
png=$2
command -v chromium >/dev/null || { echo "render-timeline: chromium not installed" >&2; exit 1; }
# The SVG's own size sets the window; a page is 1200 pixels wide.
case $svg in
  *.html) size=1200,${3:-2600} ;;
  *) size=$(sed -n 's/^<svg [^>]*width="\([0-9]*\)" height="\([0-9]*\)".*/\1,\2/p' "$svg" | head -n 1) ;;
esac
[ -n "$size" ] || { echo "render-timeline: no width/height in $svg" >&2; exit 1; }
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --hide-scrollbars --window-size="$size" \
  --screenshot="$(realpath -m "$png")" "file://$(realpath "$svg")" >/dev/null 2>&1
[ -s "$png" ] || { echo "render-timeline: chromium wrote no $png" >&2; exit 1; }
echo "render-timeline: $png ($size)"
