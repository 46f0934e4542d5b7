#!/usr/bin/env bash
# Installs what is missing, builds torpor, installs it as /usr/local/bin/torpor and runs the
# demo: a fleet of agents put to sleep and woken with their state checked.
# Usage: sudo bash scripts/setup.sh [demo options]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release --quiet -p torpor
install -m 0755 target/release/torpor /usr/local/bin/torpor
install -m 0755 target/release/torpor-shim /usr/local/bin/torpor-shim
echo "installed /usr/local/bin/torpor; running: torpor demo $*" >&2
exec /usr/local/bin/torpor demo "$@"
