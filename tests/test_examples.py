"""The examples as a user runs them, outside the repository: examples/serve.sh
serves the tiny models with SpecExtend and examples/openai_client.py queries
it. (The offline example runs from the built wheel in test_packaging.py.)"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from benchmarks.serve import free_port, running_server
from tests.engine_utils import SMALL_CACHE

pytestmark = pytest.mark.engine

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_SERVE_ARGS = ["--dtype", "float32", "--block-size", "32", "--max-model-len", "8192",
                   "--enforce-eager", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.5",
                   "--kv-cache-memory-bytes", str(384 << 20), "--seed", "0"]


def test_client_example_queries_the_served_example(target_model, draft_model, tmp_path):
    # Copies of the examples, run from a folder without the repository on the path.
    for name in ("serve.sh", "openai_client.py"):
        shutil.copy(REPO_ROOT / "examples" / name, tmp_path / name)
    port = free_port()
    env = {"TARGET": str(target_model), "DRAFT": str(draft_model), "K": "3",
           "PORT": str(port), "SERVED_NAME": "tiny", "SPEC_EXTEND": json.dumps(SMALL_CACHE),
           "VLLM_LOG_STATS_INTERVAL": "1",
           # `vllm` from this environment, as after `pip install vllm`.
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    command = ["bash", str(tmp_path / "serve.sh"), *TINY_SERVE_ARGS]
    with running_server(command, port, tmp_path / "server.log", timeout_s=240,
                        env=env) as (base, _):
        client = subprocess.run(
            [sys.executable, str(tmp_path / "openai_client.py"), "--base-url", base,
             "--model", "tiny", "--records", "150", "--max-tokens", "24"],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""}, capture_output=True,
            text=True, timeout=300)
        time.sleep(3)  # SpecExtend's figures refresh with vLLM's stats log (1 s here)
        metrics = requests.get(f"{base}/metrics", timeout=10).text
    assert client.returncode == 0, client.stdout[-2000:] + client.stderr[-2000:]
    lines = client.stdout.splitlines()
    assert lines[0].startswith("completion: ") and len(lines[0]) > len("completion: ''")
    assert lines[1].startswith("chat: ")
    assert any(line.startswith("vllm:spec_extend_retrievals_total") for line in lines)
    retrievals = [float(line.rsplit(" ", 1)[-1]) for line in metrics.splitlines()
                  if line.startswith("vllm:spec_extend_retrievals_total")]
    assert retrievals and retrievals[0] > 0  # the example's long prompt was retrieved over
