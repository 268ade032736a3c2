#!/usr/bin/env bash
# Set up the environment if needed, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# One worker per core, up to 4 (each keeps to its core: tests/conftest.py);
# a test file runs in one worker, so the engines a module shares start once,
# in the order tests/conftest.py gives (the long modules first).
# --durations: the slowest tests, each time (tests/README.md says what they buy).
cores="$(nproc)"
workers="${SPECEXTEND_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
exec "${SPECEXTEND_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider \
  -n "$workers" --dist loadfile --no-loadscope-reorder --durations=25 tests "$@"
