#!/usr/bin/env bash
# Installs what the project needs on a fresh machine: uv (through pip if it is
# missing), the Python 3.13 virtual environment and the locked dependencies.
# Sourced by scripts/demo.sh and scripts/test.sh; defines the `uv_run` function.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if command -v uv >/dev/null 2>&1 && uv --version >/dev/null 2>&1; then
  UV=(uv)
elif python3 -m uv --version >/dev/null 2>&1; then
  UV=(python3 -m uv)
else
  echo "bootstrap: installing uv with pip" >&2
  python3 -m pip install --quiet uv
  UV=(python3 -m uv)
fi
"${UV[@]}" sync --locked --all-extras --quiet

uv_run() {
  "${UV[@]}" run --locked --no-sync "$@"
}
