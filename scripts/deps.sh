#!/usr/bin/env bash
# Installs what torpor and its tests need on Debian 12, idempotently. Run as root.
#   runsc (gVisor)        the sandbox runtime
#   python3               the `host` template's agents and the demo use it
#   moto_server           the S3-compatible server the snapshot-store tests start
#   e2b (Python SDK)      the E2B-compatibility tests drive torpor with the official SDK
#   nodejs, npm, e2b (npm) the same tests with the official JavaScript SDK
#   redis-server, nats-server, rabbitmq-server   brokers for the pool and trigger tests
#   prometheus (promtool) the observability tests: rules, alerts, a real scrape
#   postgresql            the PostgreSQL state store's tests start a private server from its binaries
#   chromium              the observability test renders the cost report in a real browser
#   python3-venv          deploy/k8s/validate.sh makes a venv with PyPI's kubernetes-validate
#   a Rust toolchain      to build torpor (rustup, when cargo is missing)
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
  echo "deps.sh: run as root (gVisor needs it): sudo bash $0" >&2
  exit 1
fi

need_apt=()
command -v runsc >/dev/null 2>&1 || need_apt+=(runsc)
command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
command -v pip3 >/dev/null 2>&1 || python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need_apt+=(python3-venv)
command -v ldd >/dev/null 2>&1 || need_apt+=(libc-bin)
command -v curl >/dev/null 2>&1 || need_apt+=(curl)
command -v node >/dev/null 2>&1 || need_apt+=(nodejs)
command -v npm >/dev/null 2>&1 || need_apt+=(npm)
command -v nft >/dev/null 2>&1 || need_apt+=(nftables)
command -v cc >/dev/null 2>&1 || need_apt+=(gcc)
# Brokers the pool/trigger tests start on their own ports (nothing starts on install here).
need_brokers=()
command -v redis-server >/dev/null 2>&1 || need_brokers+=(redis-server)
command -v nats-server >/dev/null 2>&1 || need_brokers+=(nats-server)
[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || need_brokers+=(rabbitmq-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "deps.sh: installing ${need_apt[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
if [ ${#need_brokers[@]} -gt 0 ]; then
  echo "deps.sh: installing ${need_brokers[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  [ ${#need_apt[@]} -gt 0 ] || apt-get update -qq
  # In some containers adduser's chfn fails under PAM after the system user was made; a second
  # configure pass then succeeds (the user exists).
  apt-get install -y -qq "${need_brokers[@]}" >/dev/null 2>&1 || dpkg --configure -a >/dev/null
fi

# The server binaries (initdb, postgres) under /usr/lib/postgresql/<version>/bin; the tests start
# their own server on a free loopback port (crates/torpor-control/src/store/pg_testing.rs).
if ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; then
  echo "deps.sh: installing postgresql (the PostgreSQL state store's tests)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq postgresql >/dev/null
fi

if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  echo "deps.sh: installing prometheus (and promtool)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

if ! command -v chromium >/dev/null 2>&1; then
  echo "deps.sh: installing chromium (the report's rendering test)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq chromium >/dev/null
fi

if ! command -v moto_server >/dev/null 2>&1; then
  echo "deps.sh: installing moto (S3-compatible test server)" >&2
  python3 -m pip install -q "moto[server]" 2>/dev/null \
    || python3 -m pip install -q --break-system-packages "moto[server]"
fi

if ! python3 -c "import e2b" >/dev/null 2>&1; then
  echo "deps.sh: installing the e2b Python SDK (E2B-compatibility tests)" >&2
  python3 -m pip install -q e2b 2>/dev/null \
    || python3 -m pip install -q --break-system-packages e2b
fi

e2b_js_dir="$(cd "$(dirname "$0")/.." && pwd)/crates/torpor/tests/e2b_sdk/js"
if [ ! -f "$e2b_js_dir/node_modules/e2b/package.json" ]; then
  echo "deps.sh: installing the e2b JavaScript SDK into $e2b_js_dir" >&2
  (cd "$e2b_js_dir" && npm install --no-audit --no-fund --silent)
fi

if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "deps.sh: installing a Rust toolchain with rustup" >&2
  curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal -c clippy -c rustfmt
  export PATH="$HOME/.cargo/bin:$PATH"
fi
# (no `| head`: with pipefail, runsc's SIGPIPE would fail the script)
runsc_version=$(runsc --version)
echo "${runsc_version%%$'\n'*}" >&2
