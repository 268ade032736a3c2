#!/usr/bin/env bash
# Set up the environment if needed, then benchmark SpecExtend against stock
# vLLM on the real Qwen2.5-Coder 1.5B/0.5B pair (fetched and converted once).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${SPECEXTEND_VENV:-.venv}/bin/python" -m benchmarks "$@"
