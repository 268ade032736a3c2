#!/usr/bin/env bash
# Serve the Qwen2.5-Coder 1.5B target with its 0.5B draft and SpecExtend on
# http://127.0.0.1:8000 (OpenAI API). Then, from the repo root, run:
# .venv/bin/python -m examples.openai_client
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
TARGET=$($PY -c "from benchmarks.real_models import resolve_model as r; print(r('qwen2.5-coder-1.5b'))")
DRAFT=$($PY -c "from benchmarks.real_models import resolve_model as r; print(r('qwen2.5-coder-0.5b'))")
exec .venv/bin/vllm serve "$TARGET" --served-model-name qwen-coder \
  --host 127.0.0.1 --port 8000 --max-model-len 16384 --enforce-eager \
  --gpu-memory-utilization 0.5 --kv-cache-memory-bytes 2147483648 \
  --speculative-config "{\"method\":\"draft_model\",\"model\":\"$DRAFT\",\"num_speculative_tokens\":4}" \
  --additional-config '{"spec_extend":{"mode":"cmr"}}'
