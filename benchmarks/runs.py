"""Single requests, one at a time: SpecExtend against stock vLLM, side by side,
on long real text.

One engine per configuration (target alone, stock draft_model, SpecExtend cmr,
SpecExtend streaming, optionally ngram); for each context length one greedy
summarization request at batch size 1. Reported per configuration and length:
prefill seconds, decode tokens/s, mean acceptance length (from the difference
of vLLM's spec_decode counters around the request), draft and verify seconds
per step, retrieval overhead, kept fraction of the context, and agreement of
the output with the target alone. Results: JSON, a markdown table, a PNG plot.

    python -m benchmarks [--lengths 1024 4096 8192]
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from benchmarks.corpus import load_corpus
from benchmarks.machine import HUGE_PAGES_FOR_TORCH, free_memory_for_huge_pages, machine_info
from benchmarks.prompts import summarization_prompt
from benchmarks.report import args_record, config_color, fmt, fmt_ratio, pyplot, save_figure
from benchmarks.worker_hooks import install_timers, read_timers, run_deltas, spec_counters

# The configurations of a run, by name: spec_extend options (None: no
# retrieval) and whether the draft model is used.
STOCK_CONFIGS = ("target", "draft_model", "draft_model_full", "ngram")
"""``draft_model_full``: stock drafting with the draft's own window, for
reference when ``--draft-window`` caps the other draft configurations."""
NO_MATCH_NGRAM = 64
"""Tokens an n-gram must repeat to draft in ``ngram_no_match`` (none in the passages)."""

K_BY_BATCH_SIZE = [[1, 2, 4], [3, 1024, 0]]
"""``cmr_k_by_batch``: cmr with vLLM's own K schedule
(``num_speculative_tokens_per_batch_size``, inclusive batch-size ranges): K=4
for 1-2 running requests, no drafts from 3 on."""


def scheduled_k(batch_size: int, default_k: int) -> int:
    """The K that ``K_BY_BATCH_SIZE`` gives a batch of ``batch_size``."""
    for first, last, k in K_BY_BATCH_SIZE:
        if first <= batch_size <= last:
            return k
    return default_k


@dataclass
class Measurement:
    config: str
    context_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float
    decode_tok_s: float
    mean_acceptance_length: float | None
    draft_s_per_step: float | None
    verify_s_per_step: float | None
    retrieval_s_per_step: float | None
    retrieval_overhead_pct: float | None
    kept_fraction: float | None
    token_ids: list[int] = field(repr=False)
    agreement_prefix: int | None = None
    agreement_fraction: float | None = None


def engine_max_model_len(args) -> int:
    """The engines' ``max_model_len``: the longest prompt and its answer."""
    return max(args.lengths) + args.max_tokens + 64


@contextlib.contextmanager
def started_engine(**kwargs) -> Iterator[Any]:
    """A vLLM ``LLM`` for the block; its engine core (processes, memory) shuts
    down when the block ends, so the next configuration's engine fits. With
    the benchmarks' huge pages on, memory is freed for them first (root)."""
    from vllm import LLM

    if os.environ.get(HUGE_PAGES_FOR_TORCH) == "1":
        free_memory_for_huge_pages()
    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def engine_kwargs(args, config: str, spec_extend: dict | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=args.target,
        max_model_len=engine_max_model_len(args),
        enforce_eager=args.eager,
        dtype=args.dtype,
        gpu_memory_utilization=0.5,
        kv_cache_memory_bytes=args.kv_cache_gib << 30,
        max_num_seqs=1,
        disable_log_stats=False,
        enable_prefix_caching=False,
        seed=0,
    )
    if args.block_size:
        kwargs["block_size"] = args.block_size
    if config == "ngram":
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.k,
                                        "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    elif config == "ngram_no_match":
        # Stock vLLM's spec-decode path with zero drafts: an n-gram proposer
        # whose n-gram no passage repeats, under the synchronous scheduler
        # goodput control runs under (what a paused step costs in stock vLLM).
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.k,
                                        "prompt_lookup_max": NO_MATCH_NGRAM,
                                        "prompt_lookup_min": NO_MATCH_NGRAM}
        kwargs["async_scheduling"] = False
    elif config == "target_sync":
        # The target alone under vLLM's synchronous scheduler, which goodput
        # control needs: what the scheduler mode alone costs.
        kwargs["async_scheduling"] = False
    elif config != "target":
        kwargs["speculative_config"] = {"method": args.method, "model": args.draft,
                                        "num_speculative_tokens": args.k}
        if config == "cmr_k_by_batch":
            kwargs["speculative_config"]["num_speculative_tokens_per_batch_size"] = K_BY_BATCH_SIZE
        if args.draft_window and config != "draft_model_full":
            kwargs["speculative_config"]["max_model_len"] = args.draft_window
        if args.heterogeneous_vocab:
            kwargs["speculative_config"]["use_heterogeneous_vocab"] = True
    if spec_extend is not None:
        kwargs["additional_config"] = {"spec_extend": spec_extend}
    return kwargs


def measure_config(args, config: str, spec_extend: dict | None,
                   prompts: dict[int, list[int]], progress) -> list[Measurement]:
    from vllm import SamplingParams, TokensPrompt

    with started_engine(**engine_kwargs(args, config, spec_extend)) as llm:
        llm.collective_rpc(install_timers)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        # Warm-up: first-call costs (allocations, lazy init) stay out of timings.
        llm.generate([TokensPrompt(prompt_token_ids=prompts[min(prompts)][:256])],
                     SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        results = []
        for length, ids in prompts.items():
            before_counts = spec_counters(llm)
            before_timers = llm.collective_rpc(read_timers)[0]
            output = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            after_counts = spec_counters(llm)
            after_timers = llm.collective_rpc(read_timers)[0]
            results.append(measurement_from(config, length, output, before_counts, after_counts,
                                            before_timers, after_timers))
            progress.update(1)
            progress.set_postfix_str(f"{config} {length}: {results[-1].decode_tok_s:.2f} tok/s")
        return results


def measurement_from(config, length, output, c0, c1, t0, t1) -> Measurement:
    metrics = output.metrics
    generated = list(output.outputs[0].token_ids)
    prefill_s = metrics.first_token_ts - metrics.scheduled_ts
    decode_s = metrics.last_token_ts - metrics.first_token_ts
    decode_tokens = len(generated) - 1
    run = run_deltas(c0, c1, t0, t1)
    steps, step_s = run.steps, run.step_s
    has_stats = run.context_tokens is not None
    kept = None
    if has_stats:
        kept = run.kept_tokens / run.context_tokens if run.context_tokens else 1.0
    has_draft = run.drafts > 0
    return Measurement(
        config=config,
        context_tokens=length,
        prefill_s=prefill_s,
        decode_tokens=decode_tokens,
        decode_s=decode_s,
        decode_tok_s=decode_tokens / decode_s if decode_s > 0 else float("nan"),
        mean_acceptance_length=run.mean_acceptance_length,
        draft_s_per_step=run.draft_s / steps if has_draft and steps else None,
        verify_s_per_step=(step_s - run.draft_s) / steps if has_draft and steps else None,
        retrieval_s_per_step=run.retrieval_s / steps if has_stats and steps else None,
        retrieval_overhead_pct=(100 * run.retrieval_s / step_s if has_stats and step_s
                                else None),
        kept_fraction=kept,
        token_ids=generated,
    )


def add_agreement(measurements: list[Measurement]) -> None:
    reference = {m.context_tokens: m.token_ids for m in measurements if m.config == "target"}
    for m in measurements:
        ref = reference.get(m.context_tokens)
        if ref is None:
            continue
        prefix = 0
        while prefix < min(len(ref), len(m.token_ids)) and ref[prefix] == m.token_ids[prefix]:
            prefix += 1
        m.agreement_prefix = prefix
        m.agreement_fraction = sum(a == b for a, b in zip(ref, m.token_ids)) / len(ref)


def configurations(args) -> dict[str, dict | None]:
    base = json.loads(args.spec_extend) if args.spec_extend else {}
    table: dict[str, dict | None] = {}
    for name in args.configs:
        if name in STOCK_CONFIGS:
            table[name] = None
        elif name in ("cmr", "streaming"):
            table[name] = {**base, "mode": name}
        else:
            raise SystemExit(f"unknown configuration {name!r}; choose from "
                             f"{list(STOCK_CONFIGS) + ['cmr', 'streaming']}")
    return table


def run_benchmark(args) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    text = load_corpus(args.corpus)
    prompts = {n: summarization_prompt(tokenizer, text, n, offset=args.offset)
               for n in args.lengths}
    configs = configurations(args)
    measurements: list[Measurement] = []
    with tqdm(total=len(configs) * len(prompts), desc="benchmark", unit="run") as progress:
        for name, spec_extend in configs.items():
            measurements += measure_config(args, name, spec_extend, prompts, progress)
    add_agreement(measurements)
    return {
        "machine": machine_info(),
        "args": args_record(args),
        "configs": configs,
        "measurements": [asdict(m) for m in measurements],
        "_objects": measurements,
    }


def markdown_table(measurements: list[Measurement]) -> str:
    lines = [
        "| config | context | prefill s | decode tok/s | vs draft_model | mean acc. len | "
        "acc. vs draft_model | draft s/step | verify s/step | retrieval % of step | kept % of context | "
        "same as target (prefix / tokens) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    stock = {m.context_tokens: m for m in measurements if m.config == "draft_model"}
    for m in measurements:
        ref = stock.get(m.context_tokens)
        speedup = m.decode_tok_s / ref.decode_tok_s if ref else None
        acceptance = (m.mean_acceptance_length / ref.mean_acceptance_length
                      if ref and m.mean_acceptance_length and ref.mean_acceptance_length
                      else None)
        agreement = (f"{m.agreement_prefix} / {100 * m.agreement_fraction:.0f}%"
                     if m.agreement_fraction is not None else "-")
        lines.append(
            f"| {m.config} | {m.context_tokens} | {m.prefill_s:.1f} | {m.decode_tok_s:.2f} | "
            f"{fmt_ratio(speedup)} | {fmt(m.mean_acceptance_length)} | {fmt_ratio(acceptance)} | "
            f"{fmt(m.draft_s_per_step, '.3f')} | {fmt(m.verify_s_per_step, '.3f')} | "
            f"{fmt(m.retrieval_overhead_pct, '.2f')} | "
            f"{fmt(None if m.kept_fraction is None else 100 * m.kept_fraction, '.1f')} | "
            f"{agreement} |"
        )
    return "\n".join(lines)


def plot(measurements: list[Measurement], path: Path, title: str) -> None:
    plt = pyplot()
    fig, (ax_speed, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    configs = list(dict.fromkeys(m.config for m in measurements))
    for config in configs:
        rows = sorted((m for m in measurements if m.config == config),
                      key=lambda m: m.context_tokens)
        xs = [m.context_tokens for m in rows]
        color = config_color(config)
        ax_speed.plot(xs, [m.decode_tok_s for m in rows], marker="o", label=config, color=color)
        if rows and rows[0].mean_acceptance_length is not None:
            ax_acc.plot(xs, [m.mean_acceptance_length for m in rows], marker="o", label=config,
                        color=color)
    for ax, label in ((ax_speed, "decode tokens/s"), (ax_acc, "mean acceptance length")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, path, title)


def write_results(result: dict[str, Any], out_dir: Path, title: str) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    measurements = result.pop("_objects")
    table = markdown_table(measurements)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    (out_dir / "results.md").write_text(f"# {title}\n\n{table}\n")
    plot(measurements, out_dir / "results.png", title)
    return table
