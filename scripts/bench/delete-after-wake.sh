#!/bin/bash
# Delete latency of sandboxes that were woken from Parked (restored by runsc) against the same
# deletes of sandboxes that never slept (the baseline, same run). Each sandbox holds 64 MiB in
# /dev/shm, as in the cluster benchmark's lifecycle rows; deletes go 4 at a time.
#
#   bash scripts/bench/delete-after-wake.sh            (as root; release build of torpor)
#   TORPOR_BIN=target/debug/torpor N=20 ROUNDS=3 bash scripts/bench/delete-after-wake.sh
#
# Prints a table and one JSON line ({"bench":"delete_after_wake",...}).
set -euo pipefail
BIN=${TORPOR_BIN:-target/release/torpor}
N=${N:-20}
ROUNDS=${ROUNDS:-3}
[ -x "$BIN" ] || { echo "no torpor binary at $BIN (cargo build --release -p torpor)" >&2; exit 2; }
DIR=$(mktemp -d /tmp/torpor-bench-delete-XXXXXX)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
U=http://127.0.0.1:$PORT
"$BIN" up --listen 127.0.0.1:$PORT --data-dir "$DIR/data" --workers $((N + 4)) --memory-budget 16G 2> "$DIR/daemon.log" &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 1 240); do [ -f "$DIR/data/admin-token" ] && curl -sf $U/healthz >/dev/null && break; sleep 0.5; done
H="Authorization: Bearer $(cat "$DIR/data/admin-token")"
for _ in $(seq 1 240); do curl -sf -H "$H" $U/v1/templates/host >/dev/null && break; sleep 0.5; done
post() { curl -sf -XPOST -H "$H" -H 'content-type: application/json' -d "$2" "$U$1"; }
FILL='{"cmd":["sh","-c","mkdir -p /dev/shm && dd if=/dev/urandom of=/dev/shm/blob bs=1M count=64 status=none"]}'
make() { # N sandboxes holding 64 MiB; "woken": parked then woken by an exec, 4 at a time
  ids=()
  for _ in $(seq 1 "$N"); do
    ids+=("$(post /v1/sandboxes '{"template":"host"}' | python3 -c 'import sys,json; print(json.load(sys.stdin)["id"])')")
  done
  for id in "${ids[@]}"; do post "/v1/sandboxes/$id/exec" "$FILL" >/dev/null; done
  if [ "$1" = woken ]; then
    printf '%s\n' "${ids[@]}" | xargs -P 4 -I{} curl -sf -o /dev/null -XPOST -H "$H" -H 'content-type: application/json' -d '{"tier":"parked"}' $U/v1/sandboxes/{}/suspend
    printf '%s\n' "${ids[@]}" | xargs -P 4 -I{} curl -sf -o /dev/null -XPOST -H "$H" -H 'content-type: application/json' -d '{"cmd":["true"]}' $U/v1/sandboxes/{}/exec
  fi
}
delete_all() { # prints one time in seconds per delete
  printf '%s\n' "${ids[@]}" | xargs -P 4 -I{} curl -s -o /dev/null -w '%{http_code} %{time_total}\n' -XDELETE -H "$H" $U/v1/sandboxes/{} \
    | awk '$1 != 204 { print "delete answered " $1 > "/dev/stderr"; exit 1 } { print $2 }'
}
: > "$DIR/never" ; : > "$DIR/woken"
for _ in $(seq 1 "$ROUNDS"); do
  make never; delete_all >> "$DIR/never"
  make woken; delete_all >> "$DIR/woken"
done
python3 - "$DIR/never" "$DIR/woken" <<'PY'
import json, sys
def stats(path):
    v = sorted(float(x) * 1000 for x in open(path))
    q = lambda p: v[min(len(v) - 1, int(p * len(v)))]
    return {"n": len(v), "p50_ms": q(0.5), "p95_ms": q(0.95), "max_ms": v[-1],
            "over_1s": sum(1 for x in v if x > 1000)}
never, woken = stats(sys.argv[1]), stats(sys.argv[2])
print(f"{'delete, 4 at a time (64 MiB each)':40} {'n':>4} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'> 1 s':>6}")
for name, s in [("baseline: never slept", never), ("woken from Parked", woken)]:
    print(f"{name:40} {s['n']:>4} {s['p50_ms']:>8.1f} {s['p95_ms']:>8.1f} {s['max_ms']:>8.1f} {s['over_1s']:>6}")
print(json.dumps({"bench": "delete_after_wake", "never_slept": never, "woken": woken}))
PY
