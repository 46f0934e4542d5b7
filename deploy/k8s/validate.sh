#!/usr/bin/env bash
# Validates deploy/k8s (deploy/k8s/validate.py) in a venv under target/ holding PyPI's
# kubernetes-validate; the venv is made once and reused (idempotent, ~5 s the first time).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV="$ROOT/target/k8s-validate-venv"
if ! "$VENV/bin/python" -c 'import kubernetes_validate, jsonschema, yaml' 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "kubernetes-validate==1.37.0"
fi
exec "$VENV/bin/python" "$ROOT/deploy/k8s/validate.py"
