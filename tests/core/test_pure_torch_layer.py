"""The pure-torch layer (planning, scoring, selection, rewriting) runs where
only torch is installed, as on a lent GPU, and benchmarks/gpu_kernels.py
runs end to end (here on CPU, at a small size)."""

import json
import subprocess
import sys

from benchmarks import gpu_kernels


def test_planner_imports_and_plans_without_vllm(tmp_path):
    script = (
        "import sys; sys.modules['vllm'] = None\n"  # any `import vllm...` fails
        "from benchmarks.gpu_kernels import main\n"
        "main(['--device', 'cpu', '--batch', '2', '--context', '1024', '--repeats', '1',"
        " '--out', sys.argv[1]])\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "results.json").read_text())["same_kept_blocks_as_cpu"]


def test_gpu_kernel_script_agrees_with_cpu(tmp_path):
    gpu_kernels.main(["--device", "cpu", "--batch", "2", "--context", "2048", "--repeats", "1",
                      "--out", str(tmp_path)])
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["same_kept_blocks_as_cpu"]
    assert result["max_chunk_score_diff_vs_cpu"] < 1e-2
    assert (tmp_path / "results.md").exists() and (tmp_path / "results.png").exists()
