"""The pure-torch layer (planning, scoring, selection, rewriting) runs where
only torch is installed, as on a lent GPU, and benchmarks/gpu_kernels.py's
chunk scores agree with the float32 dense reference (tests/dense_reference.py),
not with another run of the same code.

Mutations that fail it (each tried): the torch path's softmax scale doubled
in retrieval/kernels/scoring.py (max relative error 0.14, 0 of 2 rows keep the dense
blocks); the causal mask dropped there (error 0.07); the plan's dense check
reading each row's scores from the next slot (errors far above 1e-2).
On CUDA it checks the Triton path too, and that scoring makes no host sync."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vllm_specextend

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]


def run_without_vllm(module: str, device: str, out, *args: str) -> None:
    """``module``'s ``main`` in a process where any ``import vllm...`` fails."""
    script = (
        "import sys; sys.modules['vllm'] = None\n"
        f"from {module} import main\n"
        "main(['--device', sys.argv[2], '--out', sys.argv[1], *sys.argv[3:]])\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(out), device, *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("device", DEVICES)
def test_gpu_kernel_script_runs_without_vllm_and_matches_the_dense_reference(device, tmp_path):
    # The baseline: another folder's package (here this one's, through a
    # link), measured in a second process beside this checkout's.
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "vllm_specextend").symlink_to(
        Path(vllm_specextend.__file__).parent, target_is_directory=True)
    run_without_vllm("benchmarks.gpu_kernels", device, tmp_path / "out",
                     "--grid", "2x512,1x768+2x300-500@1024", "--repeats", "1",
                     "--baseline", str(tmp_path / "base"))
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert result["baseline"]["package"] == str(tmp_path / "base" / "vllm_specextend")
    uniform, mixed = result["sizes"]
    assert mixed["max_model_len"] == 1024 and mixed["rows"] == 3 and mixed["longest"] == 768
    ours = {"torch", "triton"} if device == "cuda" else {"torch"}
    assert set(uniform["paths"]) == set(mixed["paths"]) == ours | {f"{p}@base" for p in ours}
    for size in (uniform, mixed):
        for path, measured in size["paths"].items():
            # Every row retrieves; its chunk scores against a float32 dense
            # softmax (the torch path rounds logits to bf16: 5e-4 measured).
            assert measured["plan_rows_checked"] == size["rows"], (path, measured)
            assert measured["plan_max_rel_error_vs_dense"] < 1e-2, (path, measured)
    for path, measured in uniform["paths"].items():
        # The torch path rounds logits to bf16 (measured: 2e-4 relative).
        assert measured["max_rel_error_vs_dense"] < 1e-2, (path, measured)
        assert measured["rows_keeping_the_dense_blocks"] == 1.0, (path, measured)
        if device == "cuda":
            assert measured["sync_sites"]["chunk_attention_sums"] == [], measured["sync_sites"]
            assert measured["sync_sites"]["plan"] == [], measured["sync_sites"]
    assert (tmp_path / "out" / "results.md").exists() and (tmp_path / "out" / "results.png").exists()


@pytest.mark.parametrize("device", DEVICES)
def test_catch_up_sync_script_runs_without_vllm(device, tmp_path):
    run_without_vllm("benchmarks.catch_up_syncs", device, tmp_path)
    found = json.loads((tmp_path / "catch-up-syncs.json").read_text())
    # Two paused steps skipped the head's forward; the next caught up their tokens.
    assert found["skipped_draft_forwards"] == 2
    assert found["catch_up_tokens"] == found["tokens_inserted"] > 0
    if device == "cuda":
        assert found["sync_sites"] == [], found["sync_sites"]
