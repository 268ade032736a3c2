"""Run a vLLM engine on tiny models and collect what the tests compare."""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Test-only: lets collective_rpc ship our inspection functions to the worker.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

DEFAULT_ENGINE_KWARGS: dict[str, Any] = dict(
    enforce_eager=True,
    dtype="float32",
    max_model_len=8192,
    block_size=32,
    max_num_seqs=8,
    gpu_memory_utilization=0.5,
    kv_cache_memory_bytes=384 << 20,
    disable_log_stats=False,
    seed=0,
)


@dataclass
class EngineRun:
    token_ids: list[list[int]]
    spec_decode: dict[str, Any]
    retrieval: dict[str, Any] | None
    request_spec_decode: list[Any]
    """Per request (first pass), vLLM's ``RequestSpecDecodeMetrics`` when the
    engine ran with ``per_request_spec_decode_metrics``, else None."""
    num_kv_blocks: int


def accepted_draft_tokens(request_metrics) -> int:
    """Draft tokens the target accepted for one request."""
    return sum(j * count for j, count in enumerate(request_metrics.histogram))


def retrieval_metrics(llm) -> dict[str, Any] | None:
    """SpecExtend's figures as ``LLM.get_metrics()`` reports them, by name
    without the ``vllm:spec_extend_`` prefix; None when there are none."""
    figures = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_extend_"):
            name = metric.name.removeprefix("vllm:spec_extend_")
            figures[name] = metric if hasattr(metric, "buckets") else metric.value
    return figures or None


def spec_decode_counters(llm) -> dict[str, Any]:
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_"):
            name = metric.name.removeprefix("vllm:spec_decode_")
            counters[name] = getattr(metric, "values", None) or metric.value
    return counters


@contextlib.contextmanager
def engine(target: Path, draft: Path | None = None, k: int = 3,
           spec_extend: dict | None = None, draft_window: int | None = None,
           speculative_config_extra: dict | None = None, **overrides):
    """An ``LLM``; ``draft_window`` caps the draft's window (speculative
    ``max_model_len``), which makes SpecExtend draft at compact positions;
    ``speculative_config_extra`` adds other speculative options."""
    from vllm import LLM

    kwargs = {**DEFAULT_ENGINE_KWARGS, **overrides}
    if draft is not None:
        kwargs["speculative_config"] = {
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": k,
        }
        if draft_window is not None:
            kwargs["speculative_config"]["max_model_len"] = draft_window
        kwargs["speculative_config"].update(speculative_config_extra or {})
    if spec_extend is not None:
        kwargs["additional_config"] = {"spec_extend": spec_extend}
    llm = LLM(model=str(target), **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def run_engine(
    target: Path,
    prompts: list[list[int]],
    max_tokens: int,
    draft: Path | None = None,
    k: int = 3,
    spec_extend: dict | None = None,
    repeat: int = 1,
    draft_window: int | None = None,
    **overrides,
) -> EngineRun:
    """Greedy outputs of ``prompts``, generated ``repeat`` times in one engine
    (the later passes hit the prefix cache when it is on)."""
    from vllm import SamplingParams, TokensPrompt

    with engine(target, draft, k, spec_extend, draft_window, **overrides) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        token_ids = []
        for _ in range(repeat):
            outputs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                use_tqdm=False,
            )
            token_ids += [list(o.outputs[0].token_ids) for o in outputs]
            if len(token_ids) == len(outputs):
                request_spec_decode = [o.outputs[0].spec_decode_metrics for o in outputs]
        counters = spec_decode_counters(llm) if draft is not None else {}
        retrieval = retrieval_metrics(llm)
        num_kv_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    return EngineRun(token_ids, counters, retrieval, request_spec_decode, num_kv_blocks)


def corpus_prompts(tokenizer_dir: Path, lengths: list[int], offset: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths cut from the Austen corpus."""
    from transformers import AutoTokenizer

    from tests.tiny_models import corpus_text

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer(corpus_text(4 * (max(lengths) + offset) + 10_000))["input_ids"]
    prompts = []
    for i, length in enumerate(lengths):
        start = offset + 997 * i
        prompts.append(ids[start : start + length])
    assert all(len(p) == n for p, n in zip(prompts, lengths))
    return prompts
