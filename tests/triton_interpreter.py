"""Running Triton kernels without a GPU: a test module's kernel cases run
under Triton's interpreter in ONE worker process (``python -m MODULE OUT``),
because TRITON_INTERPRET=1 only takes effect when set before triton is first
imported, and setting it in the test process would turn every other Triton
kernel of the run (vLLM's included) into interpreted ones. With CUDA the same
cases run in the test process, on the device (``DEVICES``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICES = ["cpu-interpreter", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]


def interpreted_results(module: str, out: Path, seed: int | None = None):
    """What ``module``'s ``__main__`` worker saved to ``out``, run under the
    interpreter (``seed``: passed as SPECEXTEND_TEST_SEED)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    if seed is not None:
        env["SPECEXTEND_TEST_SEED"] = str(seed)
    result = subprocess.run([sys.executable, "-m", module, str(out)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out)
