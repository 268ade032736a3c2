#!/usr/bin/env bash
# Serve a target with a draft model and SpecExtend on http://127.0.0.1:8000
# (OpenAI API), in the Python environment where vLLM and vllm-specextend are
# installed. Then: python examples/openai_client.py
#
#   bash examples/serve.sh                              # Qwen2.5-Coder 1.5B + 0.5B draft, cmr
#   SPEC_EXTEND='{"speculation_control": "goodput"}' bash examples/serve.sh
#   bash examples/serve.sh --max-model-len 32768        # more `vllm serve` arguments
#
# Environment: TARGET, DRAFT, METHOD (draft_model, eagle, eagle3), K, SPEC_EXTEND (JSON),
# PORT, SERVED_NAME.
set -euo pipefail
TARGET="${TARGET:-Qwen/Qwen2.5-Coder-1.5B-Instruct}"
DRAFT="${DRAFT:-Qwen/Qwen2.5-Coder-0.5B-Instruct}"
METHOD="${METHOD:-draft_model}"   # eagle / eagle3: DRAFT is the head
K="${K:-4}"
DEFAULT_OPTIONS='{}'  # SpecExtend's defaults: cmr
SPEC_EXTEND="${SPEC_EXTEND:-$DEFAULT_OPTIONS}"
exec vllm serve "$TARGET" --served-model-name "${SERVED_NAME:-qwen-coder}" \
  --host 127.0.0.1 --port "${PORT:-8000}" \
  --speculative-config "{\"method\": \"$METHOD\", \"model\": \"$DRAFT\", \"num_speculative_tokens\": $K}" \
  --additional-config "{\"spec_extend\": $SPEC_EXTEND}" \
  "$@"
