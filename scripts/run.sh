#!/usr/bin/env bash
# Starts the demo upstream and the front Envoy with sluice (envoy/*.yaml),
# in the foreground; Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
ENVOY=${ENVOY:-.venv/bin/envoy}

"$ENVOY" -c envoy/upstream.yaml --base-id 7101 --concurrency 1 -l warn &
up=$!
"$ENVOY" -c envoy/envoy.yaml --base-id 7102 --concurrency 2 -l info --component-log-level wasm:info &
front=$!
trap 'kill $front $up 2>/dev/null; wait 2>/dev/null; echo; echo "stopped"' INT TERM EXIT

for _ in $(seq 100); do
  python3 -c 'import urllib.request as u; u.urlopen("http://127.0.0.1:9901/ready", timeout=1)' 2>/dev/null && break
  sleep 0.1
done
cat <<'MSG'

sluice is running in Envoy on http://127.0.0.1:10000 (admin: http://127.0.0.1:9901)
Each client address may send 10 requests at once, refilled at 1 per second.

Try:
  for i in $(seq 20); do curl -s -o /dev/null -w '%{http_code} ' http://127.0.0.1:10000/; done; echo
  curl -si http://127.0.0.1:10000/                 # a 429 with Retry-After and RateLimit headers
  curl -s http://127.0.0.1:9901/stats/prometheus | grep sluice_

Press Ctrl-C to stop.
MSG
wait $front
