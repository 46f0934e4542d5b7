#!/usr/bin/env bash
# The Kafka tests (cargo feature `kafka`), kept out of scripts/test.sh because their broker,
# tansu (a Kafka-compatible broker in Rust), is built from source: ~20 min on 2 cores the first
# time. Installs tansu idempotently into /opt/tansu (features `dynostore,libsql`, as in the project's services recipe; the tests use memory storage),
# then runs the feature-gated tests, which start and stop their own broker on a free port.
# Usage: sudo bash scripts/test-kafka.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TERM_COLOR=never
export RUST_TEST_THREADS=${RUST_TEST_THREADS:-2}

TANSU_VERSION=0.6.0
TANSU_ROOT=${TANSU_ROOT:-/opt/tansu}
if ! "$TANSU_ROOT/bin/tansu" --version 2>/dev/null | grep -q "$TANSU_VERSION"; then
  echo "== installing tansu $TANSU_VERSION into $TANSU_ROOT (takes a while)"
  nice -n 19 cargo install tansu --version "$TANSU_VERSION" --locked --features dynostore,libsql \
    --root "$TANSU_ROOT"
fi
export TANSU="$TANSU_ROOT/bin/tansu"

echo "== cargo build -p torpor --features kafka"
cargo build -p torpor --features kafka
echo "== kafka tests"
cargo test -p torpor-triggers --features kafka
cargo test -p torpor --features kafka --test pools_kafka
