#!/usr/bin/env bash
# Set up the environment if needed, then benchmark SpecExtend against stock
# vLLM on the real Qwen2.5-Coder 1.5B/0.5B pair (fetched and converted once).
# Without arguments: the main job, batches of 1, 4 and 8 long passages at 1K,
# 4K and 8K tokens (target alone, stock draft_model, cmr, streaming, cmr under
# vLLM's K-by-batch-size schedule, and cmr with goodput control), then its
# step-cost model. Results: benchmarks/results-local/batch (untracked; the
# published run is benchmarks/results/batch).
# With arguments: `python -m benchmarks ARGS` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY="${SPECEXTEND_VENV:-.venv}/bin/python"
if [ "$#" -gt 0 ]; then
  exec "$PY" -m benchmarks "$@"
fi
OUT=benchmarks/results-local/batch
"$PY" -m benchmarks --batch-sizes 1 4 8 --lengths 1024 4096 8192 --max-tokens 48 \
  --configs target draft_model cmr streaming cmr_k_by_batch goodput --kv-cache-gib 4 \
  --out "$OUT"
exec "$PY" -m benchmarks.cost_model --results "$OUT"
