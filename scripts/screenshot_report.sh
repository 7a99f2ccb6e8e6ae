#!/usr/bin/env bash
# Run the demo (./scripts/demo: ~5 minutes on 2 cores; a finished run only samples again), write its
# report (shardwise report) and render report.html in headless Chromium to docs/images/report.png,
# the picture in the README. Debian/Ubuntu: apt-get install -y chromium.
#   ./scripts/screenshot_report.sh                 the English demo in runs/demo
#   SHARDWISE_DEMO_DIR=runs/x ./scripts/screenshot_report.sh --set train.max_steps=50
# Further arguments go to the demo's `shardwise train`. CHROMIUM names the browser (default: the first of
# chromium, chromium-browser, google-chrome on PATH); SCREENSHOT the output (default docs/images/report.png).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
run_dir="${SHARDWISE_DEMO_DIR:-runs/demo}"
out="${SCREENSHOT:-docs/images/report.png}"
browser="${CHROMIUM:-}"
if [[ -z $browser ]]; then
  for b in chromium chromium-browser google-chrome; do
    if command -v "$b" >/dev/null 2>&1; then browser=$b; break; fi
  done
fi
if [[ -z $browser ]]; then
  echo "screenshot_report: no Chromium found; install it (Debian: apt-get install -y chromium) or set CHROMIUM" >&2
  exit 1
fi
SHARDWISE_EXTRAS="${SHARDWISE_EXTRAS:+$SHARDWISE_EXTRAS,}report" SHARDWISE_DEMO_DIR="$run_dir" ./scripts/demo "$@"
.venv/bin/shardwise report "$run_dir" --out "$run_dir/report"
mkdir -p "$(dirname "$out")"
page="$(realpath "$run_dir/report/report.html")"
# --no-sandbox: Chromium refuses to start as root without it (containers, CI).
"$browser" --headless --disable-gpu --no-sandbox --hide-scrollbars --window-size=1280,2000 \
  --screenshot="$(realpath "$out")" "file://$page" 2>/dev/null
test -s "$out"
echo "screenshot: $out"
