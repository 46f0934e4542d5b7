#!/usr/bin/env bash
# The whole test suite: installs what it needs, checks formatting and lints, then runs every
# test (unit, integration, end-to-end with the real torpor binary and real runsc sandboxes).
# Usage: sudo bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"

export CARGO_TERM_COLOR=never
# Two cores: two test threads keep end-to-end tests (each a daemon with sandboxes) from starving.
export RUST_TEST_THREADS=${RUST_TEST_THREADS:-2}

# A clean build of the workspace takes ~GiB of disk; a full disk shows up as a linker crash
# (SIGBUS), so say how much there is before building.
echo "== disk: $(df -h --output=avail . | tail -1 | tr -d ' ') available for $(pwd)/target"
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== deploy/k8s manifests" && bash deploy/k8s/validate.sh  # kubernetes-validate + the CRDs' schemas
echo "== cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
# PostgreSQL tests (the state store's, cluster mode's) start their own server from the binaries
# deps.sh installed, and must not skip here.
export TORPOR_TEST_POSTGRES=required
echo "== cargo test (workspace but torpor-control)"
# Built once, then run two binaries at a time (scripts/run_tests.py): one after another, each
# binary's last tests left a test thread idle, and the whole run took ~1.6x as long. The last
# run's durations order the next (longest first; a clean clone uses the checked-in ones).
# cluster_mode (each test a database, two controllers and workers) runs one test at a time
# beside the other lane, so that at most three tests share the two cores.
mkdir -p target
cargo test --workspace --exclude torpor-control --no-run --quiet --message-format=json \
  > target/test-artifacts.json
python3 scripts/run_tests.py --lanes "${TORPOR_TEST_LANES:-2}" --log-dir target/test-logs \
  --times target/test-durations.json --seed-times scripts/test-durations.json \
  --one-thread torpor::cluster_mode -- --quiet < target/test-artifacts.json 2>&1 \
  | tee /tmp/torpor-test.log
cargo test --workspace --exclude torpor-control --doc --quiet 2>&1 | tee -a /tmp/torpor-test.log

# torpor-control's tests run as an unprivileged user: the control plane's logic is tested
# against the fake node, without root, runsc or cgroups. Built here (as root), then run as
# `nobody` from copies in a fresh 0755 directory under /tmp: the clone may sit under a
# directory `nobody` cannot enter (`/root`, mode 0700). The test binaries must therefore
# read nothing from the source tree (fixtures are compiled in).
echo "== cargo test -p torpor-control (unprivileged)"
# (The PostgreSQL state store's tests start their server as `nobody` here.)
control_bins=$(cargo test -p torpor-control --no-run --quiet --message-format=json \
  | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["profile"]["test"] and m.get("executable"):
        print(m["executable"])')
[ -n "$control_bins" ] || { echo "no torpor-control test binaries" >&2; exit 1; }
control_run=$(mktemp -d /tmp/torpor-control-tests.XXXXXX)
trap 'rm -rf "$control_run"' EXIT
chmod 0755 "$control_run"
mkdir -m 0700 "$control_run/home"
as_user=()
if [ "$(id -u)" = 0 ]; then
  chown nobody:"$(id -gn nobody)" "$control_run/home"
  as_user=(setpriv --reuid=nobody --regid="$(id -gn nobody)" --clear-groups)
fi
for bin in $control_bins; do
  install -m 0755 "$bin" "$control_run/"
  (cd "$control_run/home" && HOME="$control_run/home" TMPDIR="$control_run/home" \
    "${as_user[@]}" "$control_run/$(basename "$bin")" --quiet) 2>&1 | tee -a /tmp/torpor-test.log
done
# Doc examples only compile and run code from the docs; rustdoc needs the toolchain.
cargo test -p torpor-control --doc --quiet 2>&1 | tee -a /tmp/torpor-test.log
