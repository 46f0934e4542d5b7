#!/usr/bin/env bash
# Runs the tests that unpack images written by real tools (umoci), installing umoci from
# Debian when it is missing. No network is needed once umoci is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v umoci >/dev/null; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "umoci is missing; install it (apt-get install umoci) and run again" >&2
        exit 1
    fi
    apt-get install -y -qq umoci
fi
cargo test --test real_tools -- --ignored
