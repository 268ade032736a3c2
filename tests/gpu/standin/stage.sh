#!/usr/bin/env bash
# Stage vLLM's Python tree, with the stand-in ops, for a CUDA machine whose torch
# is not the one vLLM was built for (run from the project root, after
# scripts/setup_env.sh):   bash tests/gpu/standin/stage.sh
# Writes .vgpu/ (git-ignored, about 35 MB; run.sh installs it there):
#   vllm_py.tar.xz  vLLM's Python tree from .venv with the stand-in ops (stage_tree.py)
#   whl/            the cp312 wheels vLLM imports that such a machine lacks (wheels.txt)
#   tiny-models.tar the GPU tests' tiny models, built here
#   vllm_specextend-*.dist-info  the package's entry point, which vLLM's plugin loader reads
# and checks, on this CPU, that the CUDA path's modules import with the stand-in
# (import_check.py).
set -euo pipefail
proj=$(pwd); here=$(cd "$(dirname "$0")" && pwd)
venv=${SPECEXTEND_VENV:-$proj/.venv}
sp=$(echo "$venv"/lib/python3*/site-packages); tmp=$(mktemp -d)
rm -rf .vgpu; mkdir -p .vgpu/whl "$tmp/tree"
echo "[stage] vLLM's Python tree"
"$venv/bin/python" "$here/stage_tree.py" "$sp" "$tmp/tree"
(cd "$tmp/tree" && tar cJf "$proj/.vgpu/vllm_py.tar.xz" .)
echo "[stage] wheels"
plat=""; for n in 17 24 26 27 28 31 34 35; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $plat --platform manylinux2014_x86_64 -d .vgpu/whl -r "$here/wheels.txt"
echo "[stage] the plugin's entry point (the package itself runs from the checkout)"
cp -r "$sp"/vllm_specextend-*.dist-info .vgpu/
echo "[stage] tiny models"
models=$("$venv/bin/python" -c "
from tests.gpu.test_gpu_engine import CONFIGS, drafting
from tests.tiny_models import cache_root
paths = {p for c in CONFIGS for p in drafting(c[2]) if p is not None}
print(cache_root()); print(*sorted(p.name for p in paths))")
root=$(echo "$models" | head -1)
tokenizers=$(cd "$root" && ls -d tokenizer-* )
(cd "$root" && tar cf "$proj/.vgpu/tiny-models.tar" $tokenizers $(echo "$models" | tail -1))
echo "$root" > .vgpu/tiny-models.root
echo "[stage] import check (CPU, CUDA as vLLM's platform)"
check=$(mktemp -d); tar xJf .vgpu/vllm_py.tar.xz -C "$check"
# vLLM turns Triton off without a GPU driver; the check needs its GPU modules.
echo "HAS_TRITON = True" >> "$check/vllm/triton_utils/importing.py"
PYTHONPATH="$check:$proj" "$venv/bin/python" "$here/import_check.py" 2>&1 | grep -v "^\[standin\]"
rm -rf "$check" "$tmp"; du -sh .vgpu
