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
# Engine cores run inside the test process: an engine starts in ~2-6 s instead
# of ~12-17 s (no process spawn, no second import of vLLM). Tests that need
# vLLM's default multiprocessing engine core ask for it (``engine(...,
# multiprocessing=True)``); the servers of test_serve and the tensor-parallel
# workers always run in processes of their own.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

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


SMALL_CACHE: dict[str, Any] = {"top_k_chunks": 2, "sink_tokens": 32, "recent_tokens": 64,
                               "min_context_tokens": 256}
"""A working cache of sink 32 + 2 chunks of 32 + recent 64 tokens (+ query and
lookahead blocks), retrieving from 256 tokens of context on."""


@dataclass
class EngineRun:
    token_ids: list[list[int]]
    spec_decode: dict[str, Any]
    retrieval: dict[str, Any] | None
    request_spec_decode: list[Any]
    """Per request (first pass), vLLM's ``RequestSpecDecodeMetrics`` when the
    engine ran with ``per_request_spec_decode_metrics``, else None."""
    num_kv_blocks: int
    worker_reports: list[Any] | None = None
    """With ``run_engine(..., worker_hooks=(install, report))``: what
    ``report`` returned on each worker (one per tensor-parallel rank)."""


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
           speculative_config_extra: dict | None = None, multiprocessing: bool = False,
           method: str = "draft_model", **overrides):
    """An ``LLM``; ``draft`` is a draft model or, with ``method`` ``eagle`` /
    ``eagle3``, a head (``mtp`` needs none: the target carries its layers);
    ``draft_window`` caps its window (speculative
    ``max_model_len``), which makes SpecExtend draft at compact positions;
    ``speculative_config_extra`` adds other speculative options;
    ``multiprocessing`` runs the engine core in a process of its own."""
    import vllm.envs
    from vllm import LLM

    kwargs = {**DEFAULT_ENGINE_KWARGS, **overrides}
    if draft is not None or method == "mtp":
        kwargs["speculative_config"] = {"method": method, "num_speculative_tokens": k}
        if draft is not None:
            kwargs["speculative_config"]["model"] = str(draft)
        if draft_window is not None:
            kwargs["speculative_config"]["max_model_len"] = draft_window
        kwargs["speculative_config"].update(speculative_config_extra or {})
    if spec_extend is not None:
        kwargs["additional_config"] = {"spec_extend": spec_extend}
    # An in-process engine core caches vLLM's environment variables once it
    # has started; every engine reads the current environment, as a process
    # of its own would.
    vllm.envs.disable_envs_cache()
    with _environment(VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else
                      os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]):
        llm = LLM(model=str(target), **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        # vLLM freezes the heap after an engine starts (gc.freeze); in one
        # process, unfreeze so that this engine can be collected, then freeze
        # what is left: vLLM collects ~9 times while an engine starts, and
        # each full collection of the test process's unfrozen heap (torch,
        # vLLM and every module they load) costs ~0.4 s.
        gc.unfreeze()
        gc.collect()
        gc.freeze()


@contextlib.contextmanager
def _environment(**values: str):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_engine(
    target: Path,
    prompts: list[list[int]],
    max_tokens: int,
    draft: Path | None = None,
    k: int = 3,
    spec_extend: dict | None = None,
    repeat: int = 1,
    draft_window: int | None = None,
    worker_hooks: tuple[Any, Any] | None = None,
    **overrides,
) -> EngineRun:
    """Greedy outputs of ``prompts``, generated ``repeat`` times in one engine
    (the later passes hit the prefix cache when it is on). ``worker_hooks``:
    ``(install, report)``, functions of a worker run on every worker before
    the generation and after it (e.g. ``watch_draft_reads``,
    ``draft_reads``)."""
    with engine(target, draft, k, spec_extend, draft_window, **overrides) as llm:
        if worker_hooks is not None:
            llm.collective_rpc(worker_hooks[0])
        run = collect_run(llm, prompts, max_tokens, repeat)
        if worker_hooks is not None:
            run.worker_reports = llm.collective_rpc(worker_hooks[1])
        return run


def collect_run(llm, prompts: list[list[int]], max_tokens: int, repeat: int = 1) -> EngineRun:
    """One run in a live engine; its figures are the engine's totals so far."""
    token_ids = []
    for _ in range(repeat):
        outputs = generate_greedy(llm, prompts, max_tokens)
        token_ids += [list(o.outputs[0].token_ids) for o in outputs]
        if len(token_ids) == len(outputs):
            request_spec_decode = [o.outputs[0].spec_decode_metrics for o in outputs]
    has_draft = llm.llm_engine.vllm_config.speculative_config is not None
    return EngineRun(
        token_ids,
        spec_decode_counters(llm) if has_draft else {},
        retrieval_metrics(llm),
        request_spec_decode,
        llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
    )


def watch_draft_reads(worker) -> None:
    """From now on, check what every draft forward of a V1-runner drafter
    reads: whenever the planner's view of the step compacts a row, the draft
    layer's attention metadata must hold the view's block table over the
    blocks its ``seq_lens`` cover, and those lengths must be the view's kept
    context plus the draft's tokens of the step (not the whole context).
    Counts and the compacted tables read go to ``draft_reads``."""
    import torch

    from vllm.forward_context import get_forward_context

    drafter = worker.model_runner.drafter
    drafter._test_reads = {"forwards": 0, "compacted_forwards": 0, "stale_reads": 0,
                           "stale_examples": [], "tables": []}
    if getattr(drafter, "_test_reads_hooked", False):
        return
    drafter._test_reads_hooked = True
    drafter._test_first_pass = (None, [])
    layer = sorted(drafter._draft_attn_layer_names)[0]
    block_size = drafter.retrieval.block_size
    # Beyond the kept context: the row's query at the proposal's first pass
    # (K + 1 tokens, or a windowed prefill chunk), and a draft per later step.
    max_query = drafter.num_speculative_tokens

    def check(module, args, kwargs):
        reads = drafter._test_reads
        reads["forwards"] += 1
        view = drafter._draft_view
        if view is None or not bool((view.removed_tokens > 0).any()):
            return
        metadata = get_forward_context().attn_metadata
        metadata = (metadata[0] if isinstance(metadata, list) else metadata)[layer]
        reads["compacted_forwards"] += 1
        if drafter._test_first_pass[0] is not view:
            # The proposal's first forward: its rows' query lengths.
            drafter._test_first_pass = (view, metadata.query_start_loc.diff().tolist())
        first_query_lens = drafter._test_first_pass[1]
        tables = []
        for row in torch.nonzero(view.removed_tokens > 0).flatten().tolist():
            seq_len = int(metadata.seq_lens[row])
            blocks = -(-seq_len // block_size)
            table = metadata.block_table[row, :blocks]
            tables.append(table.tolist())
            if (not 0 < seq_len - int(view.kept_context_lens[row])
                    <= first_query_lens[row] + max_query
                    or not torch.equal(table, view.block_table[row, :blocks])):
                reads["stale_reads"] += 1
                if len(reads["stale_examples"]) < 3:
                    reads["stale_examples"].append(
                        {"seq_len": seq_len, "kept_context": int(view.kept_context_lens[row]),
                         "read": table.tolist(), "view": view.block_table[row, :blocks].tolist()})
        reads["tables"].append(tables)

    drafter.model.register_forward_pre_hook(check, with_kwargs=True)


def draft_reads(worker) -> dict[str, Any]:
    """``watch_draft_reads``' counts, and per compacted forward the block
    table rows the draft read (compacted rows only)."""
    return dict(worker.model_runner.drafter._test_reads)


DRAFT_READS = (watch_draft_reads, draft_reads)
"""``run_engine(..., worker_hooks=DRAFT_READS)``: check what the draft read."""


def watch_draft_positions(worker) -> None:
    """From now on, check the positions of every draft forward of a V1-runner
    drafter at compact positions, the first pass and every later draft step:
    each token must run at the position vLLM gives it (its ``positions``
    buffer, which our overrides leave alone) minus its row's removed tokens
    (rows from the draft layer's query start locations), clamped into the
    draft's window (where vLLM's rejected and padding slots land). Counts go
    to ``draft_positions``."""
    import torch

    from vllm.forward_context import get_forward_context

    drafter = worker.model_runner.drafter
    drafter._test_positions = {"forwards": 0, "shifted_forwards": 0, "later_steps": 0,
                               "wrong_forwards": 0, "examples": []}
    if getattr(drafter, "_test_positions_hooked", False):
        return
    drafter._test_positions_hooked = True
    layer = sorted(drafter._draft_attn_layer_names)[0]
    window = drafter.retrieval.draft_window

    def check(module, args, kwargs):
        record = drafter._test_positions
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        record["forwards"] += 1
        view = drafter._draft_view
        if view is None or not bool((view.removed_tokens > 0).any()):
            return
        metadata = get_forward_context().attn_metadata
        metadata = (metadata[0] if isinstance(metadata, list) else metadata)[layer]
        starts = metadata.query_start_loc.long()
        num_rows = min(starts.shape[0] - 1, view.removed_tokens.shape[0])
        tokens = torch.arange(int(starts[num_rows]))
        rows = torch.searchsorted(starts[1:num_rows + 1], tokens, right=True)
        given = drafter.positions[:tokens.shape[0]]
        want = (given - view.removed_tokens.long()[rows]).clamp(0, window - 1)
        record["shifted_forwards"] += 1
        record["later_steps"] += int(tokens.shape[0] == num_rows)
        if not torch.equal(positions[:tokens.shape[0]], want):
            record["wrong_forwards"] += 1
            if len(record["examples"]) < 3:
                record["examples"].append({"ran": positions[:tokens.shape[0]].tolist(),
                                           "want": want.tolist()})

    drafter.model.register_forward_pre_hook(check, with_kwargs=True)


def draft_positions(worker) -> dict[str, Any]:
    """``watch_draft_positions``' counts since it was (re)installed."""
    return dict(worker.model_runner.drafter._test_positions)


def assert_draft_positions_exact(record: dict[str, Any], min_later_steps: int) -> None:
    """Every compacted draft forward ran at original minus removed positions,
    later draft steps (one token per row) included."""
    assert record["wrong_forwards"] == 0, record["examples"]
    assert record["later_steps"] >= min_later_steps, record
    assert record["shifted_forwards"] > record["later_steps"], record


def assert_drafted_from_compacted_views(run: EngineRun, min_draft_tokens: int,
                                        min_accepted_tokens: int,
                                        min_compacted_forwards: int) -> None:
    """Drafts were made and some accepted (floors from what the tiny models
    give), and the draft's forwards read the compacted views, never a stale
    or the whole block table (``watch_draft_reads``, on every rank)."""
    counters = run.spec_decode
    reads = run.worker_reports
    assert counters["num_draft_tokens"] >= min_draft_tokens, counters
    assert counters["num_accepted_tokens"] >= min_accepted_tokens, counters
    for rank in reads:
        assert rank["compacted_forwards"] >= min_compacted_forwards, (
            "compacted draft forwards", rank["compacted_forwards"])
        assert rank["stale_reads"] == 0, (rank["stale_reads"], rank["stale_examples"])


def generate_greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    from vllm import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                        greedy(max_tokens), use_tqdm=False)


def counter_deltas(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """vLLM's spec-decode counters of one run in a live engine (per-position
    counters are lists)."""
    return {
        name: [a - b for a, b in zip(value, before[name])] if isinstance(value, list)
        else value - before[name]
        for name, value in after.items()
    }


def greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class TargetAloneReference:
    """Greedy outputs of the target alone, for a whole test run.

    One engine per target model (``DEFAULT_ENGINE_KWARGS``, its engine core in
    a process of its own), started on first
    use and kept (the ``max_live_engines`` most recently used), with outputs
    memoised per prompt: a longer generation answers a shorter request, since
    greedy decoding of a prompt is one sequence. Call it before starting the
    engine under test: starting an engine resets vLLM's Prometheus metrics.
    """

    def __init__(self, max_live_engines: int = 3) -> None:
        self.max_live_engines = max_live_engines
        # Live engines by target, least recently used first.
        self._engines: dict[str, tuple[contextlib.ExitStack, Any]] = {}
        self._memo: dict[str, dict[tuple[int, ...], list[int]]] = {}

    def __call__(self, target: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        memo = self._memo.setdefault(str(target), {})
        missing = list({tuple(p): None for p in prompts
                        if len(memo.get(tuple(p), ())) < max_tokens})
        if missing:
            outputs = generate_greedy(self._llm(target), missing, max_tokens)
            for prompt, output in zip(missing, outputs):
                memo[prompt] = list(output.outputs[0].token_ids)
        return [memo[tuple(p)][:max_tokens] for p in prompts]

    def _llm(self, target: Path):
        key = str(target)
        if key not in self._engines:
            while len(self._engines) >= self.max_live_engines:
                self._close(next(iter(self._engines)))
            stack = contextlib.ExitStack()
            # A process of its own: in-process engines that start and stop
            # meanwhile set up and tear down the process's distributed state.
            llm = stack.enter_context(engine(target, multiprocessing=True))
            self._engines[key] = (stack, llm)
        self._engines[key] = self._engines.pop(key)  # most recently used last
        return self._engines[key][1]

    def _close(self, key: str) -> None:
        self._engines.pop(key)[0].close()

    def close(self) -> None:
        for key in list(self._engines):
            self._close(key)


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
