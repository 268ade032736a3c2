#!/usr/bin/env bash
# Make (once) the short-window EAGLE-3 head for Qwen2.5-Coder-1.5B-Instruct:
# set up the environment (speculators, vLLM's head library, included), fetch
# the target, then run the recipe (python -m benchmarks.eagle_head ARGS).
# The head lands in ~/.cache/vllm-specextend/heads/<name>/ with eagle_head.json
# (times, tokens, loss curve, held-out acceptance). About 70 min on a 2-core
# AVX-512 BF16 machine. Interrupted? Run it again: hidden states and training
# resume where they stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${SPECEXTEND_VENV:-.venv}/bin/python" -m benchmarks.eagle_head "$@"
