"""SpecExtend inside vLLM on a CUDA GPU: what only a GPU run shows.

For each drafter (a draft model, an EAGLE-3 head, an MTP layer), model runner
(V1, Model Runner V2) and graph mode (eager, FULL_DECODE_ONLY CUDA graphs,
FULL_AND_PIECEWISE under torch.compile), with cmr (and goodput control where
vLLM's V1 runner hosts it):

- greedy outputs equal the target alone's (float32, same runner and graphs);
- retrieval is observed: requests were retrieved for and the draft attended to
  fewer tokens than the context (V1: the draft's own attention metadata, read
  in its forward, is the planner's compacted view);
- no Triton kernel of the package compiles after warm-up (a second batch of
  other lengths and sizes);
- a steady decode step makes no host-device sync from the package
  (``torch.cuda.set_sync_debug_mode``; a sync is the package's when the
  innermost of the package's and vLLM's frames on its stack is the package's;
  vLLM's own sync sites are recorded and named in the report, not asserted).

Stock drafting (the same drafter without SpecExtend) runs too: where outputs
differ from the target alone, the report and the failure say whether stock
drafting's differ as well (then the cause is vLLM's numerics, not retrieval).

``SPECEXTEND_GPU_REPORT=path.json`` writes each test's figures there (one file
per pytest-xdist worker).
"""

from __future__ import annotations

import contextlib
import json
import os
import traceback
import warnings
from pathlib import Path

import pytest

from tests.engine_utils import (
    DRAFT_READS,
    SMALL_CACHE,
    corpus_prompts,
    engine,
    generate_greedy,
    greedy,
    retrieval_metrics,
    spec_decode_counters,
)
from tests.tiny_models import TARGET_LLAMA, TARGET_QWEN2, build_model, build_mtp_target

STANDIN = os.environ.get("SPECEXTEND_GPU_STANDIN") == "1"
"""Running on tests/gpu/standin's stand-in ops (no compiled vLLM ops)."""
BACKEND = os.environ.get("SPECEXTEND_GPU_ATTENTION_BACKEND") or ("TRITON_ATTN" if STANDIN else None)
K = 3
MAX_NUM_SEQS = 8
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32]  # up to MAX_NUM_SEQS * (K + 1) decode tokens
MAX_TOKENS = 32
WARM_UP_LENGTHS = [400, 2000]
LENGTHS = [300, 1500, 3000, 700, 120]
GRAPH_MODES = {"eager": "NONE", "full_decode_only": "FULL_DECODE_ONLY", "full": "FULL",
               "full_and_piecewise": "FULL_AND_PIECEWISE"}

CONFIGS = [
    # (runner, graphs, method, speculation control)
    ("v1", "eager", "draft_model", None),
    ("v1", "eager", "draft_model", "goodput"),
    ("v1", "eager", "eagle3", None),
    ("v1", "eager", "mtp", None),
    ("v1", "full_decode_only", "draft_model", None),
    # Goodput control refuses FULL_DECODE_ONLY (its paused steps would run
    # eagerly: test_goodput_control_refuses_decode_only_graphs); under FULL
    # they replay a graph of their own size.
    ("v1", "full", "draft_model", "goodput"),
    ("v1", "full_decode_only", "eagle3", None),
    ("v1", "full_and_piecewise", "draft_model", None),
    ("mrv2", "eager", "draft_model", None),
    ("mrv2", "eager", "eagle3", None),
    ("mrv2", "full_decode_only", "draft_model", None),
    ("mrv2", "full_decode_only", "eagle3", None),
]


def _config_id(config) -> str:
    runner, graphs, method, control = config
    return "-".join([runner, graphs, method] + ([control] if control else []))


def drafting(method: str):
    """(engine target, target without drafting layers, draft or head)."""
    from tests.eagle_heads import build_eagle_head
    from tests.tiny_models import build_noisy_copy

    if method == "mtp":
        return build_mtp_target(TARGET_QWEN2), build_model(TARGET_QWEN2), None
    target = build_model(TARGET_LLAMA)
    if method == "draft_model":
        return target, target, build_noisy_copy(TARGET_LLAMA, noise=0.03)
    return target, target, build_eagle_head(TARGET_LLAMA, method)


def engine_overrides(graphs: str) -> dict:
    compilation = {"cudagraph_mode": GRAPH_MODES[graphs], "cudagraph_capture_sizes": CAPTURE_SIZES}
    if graphs != "full_and_piecewise":
        compilation["mode"] = 0  # no torch.compile
    if STANDIN:
        compilation["custom_ops"] = ["none"]
    overrides = dict(enforce_eager=graphs == "eager", compilation_config=compilation,
                     gpu_memory_utilization=0.15, max_num_seqs=MAX_NUM_SEQS)
    if BACKEND:
        overrides["attention_backend"] = BACKEND
    return overrides


@contextlib.contextmanager
def model_runner(runner: str):
    """vLLM's runner choice: SpecExtend's engines run V1 unless
    ``VLLM_USE_V2_MODEL_RUNNER`` says otherwise (patches/engine_construction.py)."""
    saved = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "mrv2" else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved


class TritonCompiles:
    """Triton kernels compiled while counting, by module and name."""

    def __init__(self) -> None:
        self.kernels: list[str] = []
        self._counting = False
        import triton

        self._knobs = getattr(triton, "knobs", None)
        if self._knobs is None or not hasattr(self._knobs.runtime, "jit_post_compile_hook"):
            pytest.skip("this Triton has no jit_post_compile_hook")
        self._knobs.runtime.jit_post_compile_hook = self._compiled

    def _compiled(self, *args, **kwargs) -> None:
        if self._counting:
            fn = kwargs.get("fn")
            self.kernels.append(f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}")

    @contextlib.contextmanager
    def counting(self):
        self._counting = True
        try:
            yield self
        finally:
            self._counting = False

    def ours(self) -> list[str]:
        return [k for k in self.kernels if k.startswith("vllm_specextend")]

    def close(self) -> None:
        self._knobs.runtime.jit_post_compile_hook = None


@contextlib.contextmanager
def sync_sites(sites: list[list[str]]):
    """Record the Python stack of every host-device sync CUDA reports
    (``set_sync_debug_mode("warn")``) into ``sites``."""
    import torch

    original = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites.append([f"{f.filename}:{f.lineno} {f.name}"
                          for f in traceback.extract_stack()[:-1]])
        else:
            original(message, category, filename, lineno, file, line)

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = showwarning
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = original


def innermost(stack: list[str], package: str) -> str | None:
    hits = [frame for frame in stack if f"/{package}/" in frame]
    return hits[-1] if hits else None


def package_site(stack: list[str]) -> str | None:
    """The package's frame that made the sync, if the innermost of the
    package's and vLLM's frames is the package's (a sync inside vLLM code the
    package called, e.g. the draft's forward, is vLLM's)."""
    frames = [f for f in stack if "/vllm_specextend/" in f or "/vllm/" in f]
    return frames[-1] if frames and "/vllm_specextend/" in frames[-1] else None


def steady_decode_syncs(llm, prompts: list[list[int]], steps: int = 3) -> list[list[str]]:
    """Sync sites of ``steps`` engine steps once every request decodes."""
    from vllm import TokensPrompt

    core = llm.llm_engine
    for i, prompt in enumerate(prompts):
        core.add_request(f"steady-{i}", TokensPrompt(prompt_token_ids=prompt), greedy(64))
    for _ in range(12):  # prefill (chunked) and the first decode steps
        core.step()
    sites: list[list[str]] = []
    with sync_sites(sites):
        for _ in range(steps):
            core.step()
    core.abort_request([f"steady-{i}" for i in range(len(prompts))])
    while core.has_unfinished_requests():
        core.step()
    return sites


_REFERENCES: dict[tuple, list[list[int]]] = {}


def target_alone(runner: str, graphs: str, base: Path, prompts: list[list[int]]):
    key = (runner, graphs, str(base), tuple(map(tuple, prompts)))
    if key not in _REFERENCES:
        with model_runner(runner), engine(base, **engine_overrides(graphs)) as llm:
            outputs = generate_greedy(llm, prompts, MAX_TOKENS)
        _REFERENCES[key] = [list(o.outputs[0].token_ids) for o in outputs]
    return _REFERENCES[key]


def stock_drafting(runner: str, graphs: str, method: str, target: Path, draft: Path | None,
                   prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of the same drafter without SpecExtend."""
    key = (runner, graphs, method, str(target), str(draft), tuple(map(tuple, prompts)))
    if key not in _REFERENCES:
        with model_runner(runner), engine(target, draft, K, method=method,
                                          **engine_overrides(graphs)) as llm:
            outputs = generate_greedy(llm, prompts, MAX_TOKENS)
        _REFERENCES[key] = [list(o.outputs[0].token_ids) for o in outputs]
    return _REFERENCES[key]


@pytest.fixture(scope="session")
def report():
    records: dict[str, dict] = {}
    yield records
    path = os.environ.get("SPECEXTEND_GPU_REPORT")
    if path:  # one file per pytest-xdist worker
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        path = Path(path)
        if worker:
            path = path.with_name(f"{path.stem}-{worker}{path.suffix}")
        path.write_text(json.dumps(records, indent=1, default=str))


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_cmr_on_gpu(config, report):
    runner, graphs, method, control = config
    target, base, draft = drafting(method)
    prompts = corpus_prompts(base, LENGTHS)
    warm_up = corpus_prompts(base, WARM_UP_LENGTHS, offset=50_000)
    expected = target_alone(runner, graphs, base, prompts)
    spec_extend = dict(SMALL_CACHE)
    if control:
        spec_extend.update(speculation_control=control, goodput_warm_up="immediate")
    record = report.setdefault(_config_id(config), {})
    compiles = TritonCompiles()
    try:
        with model_runner(runner), engine(target, draft, K, spec_extend, method=method,
                                          **engine_overrides(graphs)) as llm:
            watch = runner == "v1"
            if watch:
                llm.collective_rpc(DRAFT_READS[0])
            generate_greedy(llm, warm_up, MAX_TOKENS)
            with compiles.counting():
                outputs = generate_greedy(llm, prompts, MAX_TOKENS)
            sites = steady_decode_syncs(llm, prompts[:4])
            counters = spec_decode_counters(llm)
            retrieval = retrieval_metrics(llm) or {}
            reads = llm.collective_rpc(DRAFT_READS[1])[0] if watch else None
    finally:
        compiles.close()
    ours = [package_site(s) for s in sites]
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    stock = stock_drafting(runner, graphs, method, target, draft, prompts)
    record.update(
        outputs_equal=tokens == expected,
        stock_drafting_outputs_equal=stock == expected,
        outputs_equal_stock_drafting=tokens == stock,
        draft_tokens=counters.get("num_draft_tokens"),
        accepted_tokens=counters.get("num_accepted_tokens"),
        retrievals=retrieval.get("retrievals"),
        context_tokens=retrieval.get("context_tokens"),
        kept_tokens=retrieval.get("kept_tokens"),
        draft_forwards=None if reads is None else reads["forwards"],
        compacted_draft_forwards=None if reads is None else reads["compacted_forwards"],
        stale_draft_reads=None if reads is None else reads["stale_reads"],
        triton_compiles_after_warm_up=compiles.kernels,
        package_sync_sites=[o for o in ours if o],
        vllm_sync_sites=sorted({innermost(s, "vllm") or s[-1] for s in sites}),
        sync_stack_tails=sorted({" <- ".join(reversed(s[-6:])) for s in sites}),
    )
    assert tokens == expected, (
        f"stock drafting's outputs {'equal' if stock == expected else 'differ from'} the "
        f"target alone's; SpecExtend's {'equal' if tokens == stock else 'differ from'} stock's")
    assert compiles.ours() == [], compiles.ours()
    assert record["package_sync_sites"] == [], sites
    if control is None:
        assert record["draft_tokens"] > 0
        assert record["retrievals"] > 0, retrieval
        assert 0 < record["kept_tokens"] < record["context_tokens"], retrieval
        if reads is not None:
            assert reads["compacted_forwards"] > 0 and reads["stale_reads"] == 0, reads


def test_goodput_control_refuses_decode_only_graphs():
    """On a GPU vLLM keeps FULL_DECODE_ONLY, in which a step where goodput
    control pauses every request (one token each) has no graph: refused when
    the engine is built, before any model loads."""
    from vllm_specextend.common.options import SpecExtendConfigError

    target, base, draft = drafting("draft_model")
    with model_runner("v1"), pytest.raises(SpecExtendConfigError,
                                           match="cannot run with cudagraph_mode=FULL_DECODE_ONLY"):
        with engine(target, draft, K, {**SMALL_CACHE, "speculation_control": "goodput"},
                    **engine_overrides("full_decode_only")):
            pass
