#!/usr/bin/env bash
# On a CUDA machine without a matching vLLM build, from the project root, after
# stage.sh ran on a machine with the project's .venv and .vgpu/ was copied here:
#     bash tests/gpu/standin/run.sh python3 -m pytest tests/gpu
# Installs the staged tree into a temporary site folder (once), then runs the
# command with vLLM's Python tree and the stand-in ops importable.
set -euo pipefail
SITE=${SPECEXTEND_STANDIN_SITE:-/tmp/vllm-standin-site}
if [ ! -f "$SITE/.staged" ]; then
  mkdir -p "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .vgpu/whl/*.whl 2>&1 | grep -v "^WARNING: Target directory" | tail -3 || true
  tar xJf .vgpu/vllm_py.tar.xz -C "$SITE"
  # Without the package's dist-info vLLM never loads the plugin: every engine runs stock.
  cp -r .vgpu/vllm_specextend-*.dist-info "$SITE/"
  root=$(cat .vgpu/tiny-models.root); mkdir -p "$root"; tar xf .vgpu/tiny-models.tar -C "$root"
  touch "$SITE/.staged"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" SPECEXTEND_GPU_STANDIN=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0
python3 -c "
from importlib.metadata import entry_points
names = [e.value for e in entry_points(group='vllm.general_plugins')]
assert 'vllm_specextend:register' in names, f'SpecExtend is not a vLLM plugin here: {names}'"
exec "$@"
