"""`vllm serve` with SpecExtend: the OpenAI API on localhost, tiny models.

One target-only server and one SpecExtend server get the same concurrent mix
of long and short, streamed and plain, completion and chat requests (some
streams dropped by the client mid-way); greedy outputs must be identical.
"""

import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from benchmarks.serve import free_port, running_server
from tests.engine_utils import SMALL_CACHE, corpus_prompts

pytestmark = pytest.mark.engine

# `vllm serve` exactly as documented: the console script of the environment
# scripts/setup_env.sh builds (see scripts/alias_vllm_metadata.py).
SERVE = [str(Path(sys.executable).parent / "vllm"), "serve"]
MAX_TOKENS = 32


def serve_args(target, draft=None, spec_extend=None, port=0) -> list[str]:
    args = [*SERVE, str(target), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "8192", "--block-size", "32", "--enforce-eager",
            "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5",
            "--kv-cache-memory-bytes", str(384 << 20), "--seed", "0"]
    if draft is not None:
        args += ["--speculative-config", json.dumps(
            {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})]
    if spec_extend is not None:
        args += ["--additional-config", json.dumps({"spec_extend": spec_extend})]
    return args


@contextlib.contextmanager
def server(target, draft=None, spec_extend=None):
    port = free_port()
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"specextend-serve-{port}.log"
    with running_server(serve_args(target, draft, spec_extend, port), port, log_path,
                        timeout_s=240, env={"VLLM_LOG_STATS_INTERVAL": "1"}) as running:
        yield running


def completion(base, prompt_ids, stream=False, abort_after=None):
    body = {"model": "tiny", "prompt": prompt_ids, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        return requests.post(f"{base}/v1/completions", json=body, timeout=300).json()[
            "choices"][0]["text"]
    text, chunks = "", 0
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            text += json.loads(line[6:])["choices"][0]["text"]
            chunks += 1
            if abort_after is not None and chunks >= abort_after:
                return None  # the client drops the stream
    return text


def chat(base, content, stream=False):
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        return requests.post(f"{base}/v1/chat/completions", json=body, timeout=300).json()[
            "choices"][0]["message"]["content"]
    text = ""
    with requests.post(f"{base}/v1/chat/completions", json=body, stream=True,
                       timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    return text


def request_mix(target):
    prompts = corpus_prompts(target, [120, 1500, 4000, 6500, 300, 3000])
    from transformers import AutoTokenizer

    from tests.tiny_models import corpus_text

    tokenizer = AutoTokenizer.from_pretrained(target)
    chat_text = tokenizer.decode(tokenizer(corpus_text(40_000)[20_000:])["input_ids"][:2500])
    return [
        ("completion", prompts[0], False, None),
        ("completion", prompts[1], True, None),
        ("completion", prompts[2], False, None),
        ("completion", prompts[3], True, None),
        ("completion", prompts[4], True, 3),  # aborted mid-stream
        ("completion", prompts[5], True, 5),  # aborted mid-stream
        ("chat", chat_text, False, None),
        ("chat", chat_text[:400], True, None),
    ]


def run_mix(base, mix):
    def one(item):
        kind, prompt, stream, abort_after = item
        if kind == "chat":
            return chat(base, prompt, stream)
        return completion(base, prompt, stream, abort_after)

    with concurrent.futures.ThreadPoolExecutor(len(mix)) as pool:
        results = list(pool.map(one, mix))
    # After the aborts, the server still answers.
    results.append(completion(base, mix[2][1]))
    return results


@pytest.fixture(scope="module")
def served_reference(target_model):
    """The request mix and what a target-only server answers to it."""
    mix = request_mix(target_model)
    with server(target_model) as (base, _):
        return mix, run_mix(base, mix)


def test_served_outputs_equal_target_only_server(served_reference, target_model, draft_model):
    mix, reference = served_reference
    with server(target_model, draft_model, SMALL_CACHE) as (base, log):
        served = run_mix(base, mix)
        time.sleep(3)  # retrieval figures refresh with vLLM's stats log (1 s here)
        metrics = prometheus_values(requests.get(f"{base}/metrics", timeout=10).text)
        log.seek(0)
        assert "SpecExtend: scoring with the target's last attention layer" in log.read()
    assert served == reference
    assert all(r for r, item in zip(reference, mix + [None]) if item is None or item[3] is None)
    assert metrics["vllm:spec_decode_num_drafts_total"] > 0
    assert metrics["vllm:spec_extend_retrievals_total"] > 0
    assert 0 < metrics["vllm:spec_extend_kept_fraction"] < 0.5
    assert metrics["vllm:spec_extend_kept_tokens_total"] < metrics[
        "vllm:spec_extend_context_tokens_total"]
    assert metrics["vllm:spec_extend_mean_acceptance_length"] >= 1
    assert metrics["vllm:spec_extend_finished_requests_total"] > 0
    assert metrics["vllm:spec_extend_request_kept_fraction_count"] == metrics[
        "vllm:spec_extend_finished_requests_total"]


def test_served_goodput_control_outputs_equal_target_only_server(served_reference, target_model,
                                                                 draft_model):
    """Mutation: ``GoodputController.plan`` pausing every request (draft
    lengths all 0, still counted as decided) fails the drafted-tokens check."""
    mix, reference = served_reference
    with server(target_model, draft_model,
                {**SMALL_CACHE, "speculation_control": "goodput",
                 "goodput_warm_up": "immediate"}) as (base, _):
        served = run_mix(base, mix)
        time.sleep(3)
        metrics = prometheus_values(requests.get(f"{base}/metrics", timeout=10).text)
    assert served == reference
    decided = (metrics["vllm:spec_extend_control_drafted_request_steps_total"]
               + metrics["vllm:spec_extend_control_paused_request_steps_total"])
    assert decided > len(mix) * MAX_TOKENS / 4
    # Requests drafted and drafts were accepted (vLLM's own counters). On a
    # CPU, drafting rarely pays and the choice rests on measured step times:
    # two runs drafted at 2 and 28 of ~230 request steps (6 and 64 drafts,
    # 3 and 7 accepted).
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] >= 3
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] >= 1


def prometheus_values(text: str) -> dict[str, float]:
    """Unlabelled view of a /metrics page: name -> value of its first sample."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            values.setdefault(name, float(line.rsplit(" ", 1)[-1]))
    return values


def test_bad_additional_config_stops_the_server_with_the_key(target_model, draft_model):
    result = subprocess.run(
        serve_args(target_model, draft_model, {"top_k": 4}, port=free_port()),
        capture_output=True, text=True, timeout=240,
    )
    assert result.returncode != 0
    assert "unknown spec_extend option(s) ['top_k']" in result.stdout + result.stderr
