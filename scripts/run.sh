#!/usr/bin/env bash
# Starts the demo upstream and the front Envoy with sluice (envoy/*.yaml,
# rendered with the chosen ports into a temporary directory), in the
# foreground; Ctrl-C stops both.
#
#   PORT=10000 ADMIN_PORT=9901 UPSTREAM_PORT=10001 UPSTREAM_ADMIN_PORT=9902 scripts/run.sh
#   HOST=native scripts/run.sh     # the native build (SLUICE_NATIVE: its file)
#
# Fails at once if a port is taken; says "running" only once the front
# Envoy answers through its own listener; if an Envoy exits, prints its last
# log lines and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
ENVOY=${ENVOY:-.venv/bin/envoy}
PORT=${PORT:-10000}
ADMIN_PORT=${ADMIN_PORT:-9901}
UPSTREAM_PORT=${UPSTREAM_PORT:-10001}
UPSTREAM_ADMIN_PORT=${UPSTREAM_ADMIN_PORT:-9902}
READY_S=${READY_S:-30}   # the most to wait for the front Envoy to answer
HOST=${HOST:-wasm}       # or native: the dynamic module (make build-native)
NATIVE=${SLUICE_NATIVE:-native/target/release/libsluice_native.so}

up='' front=''
tmp=$(mktemp -d "${TMPDIR:-/tmp}/sluice-run.XXXXXX")
cleanup() {
  trap - INT TERM EXIT
  set +e
  [ -z "$front" ] || kill "$front" 2>/dev/null
  [ -z "$up" ] || kill "$up" 2>/dev/null
  wait 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'cleanup; echo; echo "stopped"; exit 0' INT TERM

python3 scripts/demo.py render --out "$tmp" --port "$PORT" --admin-port "$ADMIN_PORT" \
  --upstream-port "$UPSTREAM_PORT" --upstream-admin-port "$UPSTREAM_ADMIN_PORT" \
  --host "$HOST" --native "$NATIVE" || exit 1

# A process that has exited but is not yet reaped still answers kill -0.
alive() { [ -e "/proc/$1" ] && awk '$3 == "Z" {exit 1}' "/proc/$1/stat" 2>/dev/null && kill -0 "$1" 2>/dev/null; }

fail() {  # message; then the last lines of each Envoy's log
  echo >&2
  echo "make run: $1" >&2
  for name in front upstream; do
    if [ -s "$tmp/$name.log" ]; then
      echo "--- last lines of the $name Envoy's log:" >&2
      tail -n 25 "$tmp/$name.log" >&2
    fi
  done
  exit 1
}

# Each Envoy's output goes to the terminal and to a log file. The base ids
# are the listener ports: two runs on different ports never share Envoy's
# hot-restart socket.
"$ENVOY" -c "$tmp/upstream.yaml" --base-id "$UPSTREAM_PORT" --concurrency 1 -l warn \
  > >(tee "$tmp/upstream.log") 2>&1 &
up=$!
"$ENVOY" -c "$tmp/envoy.yaml" --base-id "$PORT" --concurrency 2 -l info \
  --component-log-level wasm:info,dynamic_modules:info \
  > >(tee "$tmp/front.log") 2>&1 &
front=$!

# Ready when the front Envoy answers a request on its own listener with the
# upstream's 200 (not merely when something answers on the admin port).
deadline=$((SECONDS + READY_S))
while :; do
  alive "$front" || { wait "$front" && rc=0 || rc=$?; fail "the front Envoy exited (status $rc) before it was ready"; }
  alive "$up" || { wait "$up" && rc=0 || rc=$?; fail "the upstream Envoy exited (status $rc) before it was ready"; }
  python3 scripts/demo.py probe --port "$PORT" 2>"$tmp/probe" && break
  if [ "$SECONDS" -ge "$deadline" ]; then
    fail "the front Envoy did not answer on http://127.0.0.1:$PORT/ within ${READY_S}s (last try: $(cat "$tmp/probe"))"
  fi
  sleep 0.2
done

cat <<MSG

sluice is running in Envoy ($HOST build) on http://127.0.0.1:$PORT (admin: http://127.0.0.1:$ADMIN_PORT)
Each client address may send 10 requests at once, refilled at 1 per second.
Configuration: envoy/envoy.yaml and envoy/upstream.yaml with these ports, in $tmp

Try:
  for i in \$(seq 20); do curl -s -o /dev/null -w '%{http_code} ' http://127.0.0.1:$PORT/; done; echo
  curl -si http://127.0.0.1:$PORT/                 # a 429 with Retry-After and RateLimit headers
  curl -s http://127.0.0.1:$ADMIN_PORT/stats/prometheus | grep sluice_

Press Ctrl-C to stop.
MSG

# Until Ctrl-C, or until either Envoy exits on its own.
wait -n "$front" "$up" && rc=0 || rc=$?
if alive "$front"; then
  fail "the upstream Envoy exited (status $rc)"
fi
fail "the front Envoy exited (status $rc)"
