#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ (or the ones named) for SECONDS each (default 30):
# the decoders of untrusted input (API and E2B bodies, Connect envelopes, pool specs, agent
# frames, snapshot headers, uploaded archives) on libFuzzer-generated input, starting from the
# seeds in fuzz/seeds/TARGET and the corpus it keeps in fuzz/corpus/TARGET (not in git).
# A crash, a failed assertion or a leak stops that target; its input is left in
# fuzz/artifacts/TARGET/ (replay: cargo +nightly fuzz run TARGET fuzz/artifacts/TARGET/FILE),
# the other targets still run, and the script exits non-zero naming the targets that failed.
# The same entry points run for a fixed number of cases in `cargo test` (proptests), which is
# what CI runs every time; this script is for longer runs.
# Needs the nightly toolchain and cargo-fuzz (installed here when missing, ~1 min).
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TERM_COLOR=never

seconds=${1:-30}
shift || true
case $seconds in
  '' | *[!0-9]*) echo "usage: scripts/fuzz.sh [SECONDS] [TARGET...]" >&2; exit 2 ;;
esac

rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
cargo +nightly fuzz --version >/dev/null 2>&1 || cargo install cargo-fuzz --locked

# rustix 0.37 (lapin -> async-io 1 -> rustix 0.37, the last of its line) turns on
# `rustc_attrs` when it sees a nightly compiler, and its linux_raw backend no longer builds
# with current nightlies; its libc backend does. cargo-fuzz adds its own flags to these.
export RUSTFLAGS="${RUSTFLAGS:-} --cfg rustix_use_libc"

if [ $# -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo +nightly fuzz list)
fi

echo "== building the fuzz targets"
cargo +nightly fuzz build

failed=()
for t in "${targets[@]}"; do
  echo "== $t for ${seconds}s"
  mkdir -p "fuzz/corpus/$t"
  seeds=()
  [ -d "fuzz/seeds/$t" ] && seeds=("fuzz/seeds/$t")
  if ! cargo +nightly fuzz run "$t" "fuzz/corpus/$t" "${seeds[@]}" -- \
    -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=2048 -timeout=10 -print_final_stats=1; then
    failed+=("$t")
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: failed: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
  exit 1
fi
echo "fuzz: ${#targets[@]} targets ran ${seconds}s each without a failure"
