#!/usr/bin/env bash
# Set up the environment if needed, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${SPECEXTEND_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider tests "$@"
