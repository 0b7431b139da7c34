#!/bin/bash
# Instructions per request of the uvicorn server itself, over HTTP, under callgrind:
#
#     bench/http_instructions.sh VARIANT SCENARIO      # e.g. bare new, goblin-memory replay
#
# Starts bench/serve.py VARIANT (FastAPI, in bench/.venv) under valgrind --tool=callgrind on a
# free loopback port, warms it up with wrk for 5 s, zeroes the counts, drives it for 15 s
# (wrk -c16, bench/scenario.lua), dumps the counts, and prints them over the requests
# served meanwhile; then stops the server by its PID. Redis variants are not handled (use
# instructions.py for those). Needs valgrind, wrk and curl.
set -euo pipefail
cd "$(dirname "$0")"
variant=$1
scenario=$2
port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
PYTHONPATH=.. valgrind --tool=callgrind --callgrind-out-file="$out/callgrind.%p" \
    .venv/bin/python serve.py "$variant" --port "$port" --app fastapi >"$out/server.log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null || true; rm -rf "$out"' EXIT
url=http://127.0.0.1:$port
for _ in $(seq 1 120); do curl -s -o /dev/null "$url/__stats" && break; sleep 1; done
prefix=run
if [ "$scenario" = replay ]; then
    prefix=replay
    for i in $(seq 0 49); do
        curl -s -o /dev/null -X POST -H 'Content-Type: application/json' \
            -H "Idempotency-Key: replay-$i" -d '{"sku":"A-1","qty":2}' "$url/orders"
    done
fi
wrk -t1 -c16 -d5s -s scenario.lua "$url/orders" -- "$scenario" "warm-$prefix" 50 >/dev/null
callgrind_control -z "$server" >/dev/null
wrk -t1 -c16 -d15s -s scenario.lua "$url/orders" -- "$scenario" "$prefix" 50 |
    sed -n 's/^BENCH //p' >"$out/wrk.json"
callgrind_control -d "$server" >/dev/null
sleep 1
total=$(callgrind_annotate "$out"/callgrind.*.1 | sed -n 's/^ *\([0-9,]*\) .*PROGRAM TOTALS.*/\1/p' | tr -d ,)
collector=$(callgrind_annotate --inclusive=yes "$out"/callgrind.*.1 |
    sed -n 's/^ *\([0-9,]*\) .*:gc_collect_main \[.*/\1/p' | head -1 | tr -d ,)
python3 - "$variant" "$scenario" "$total" "${collector:-0}" "$out/wrk.json" <<'PY'
import json, sys
variant, scenario, total, collector, path = sys.argv[1:]
requests = json.load(open(path))["requests"] + 16  # and the 16 in flight when wrk stopped
print(f"{variant} {scenario}: {int(total) / requests:,.0f} instructions per request "
      f"({int(collector) / requests:,.0f} in the collector), {requests} requests")
PY
