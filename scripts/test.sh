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

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== cargo test"
cargo test --workspace --quiet 2>&1 | tee /tmp/torpor-test.log
