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
# Built once, then run by scripts/run_tests.py: one binary at a time by default (as `cargo test`
# runs them; each binary's output kept in target/test-logs/, a summary of the slowest and the
# failures). TORPOR_TEST_LANES=2 runs two at a time, longest first (the last run's durations, a
# clean clone the checked-in ones), cluster_mode then one test at a time beside the other lane:
# ~17 instead of ~22 minutes here, but at that load some end-to-end tests still fail now and
# then on their timing (docs/ARCHITECTURE.md, "Running the tests").
lanes=${TORPOR_TEST_LANES:-1}
one_thread=()
[ "$lanes" -gt 1 ] && one_thread=(--one-thread torpor::cluster_mode)
mkdir -p target
cargo test --workspace --exclude torpor-control --no-run --quiet --message-format=json \
  > target/test-artifacts.json
python3 scripts/run_tests.py --lanes "$lanes" --log-dir target/test-logs \
  --times target/test-durations.json --seed-times scripts/test-durations.json \
  "${one_thread[@]}" -- --quiet < target/test-artifacts.json 2>&1 \
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
