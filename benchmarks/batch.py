"""Batched long-context benchmark: N different passages in one ``LLM.generate``
call per configuration, against stock vLLM.

Engines with prefix caching: the target alone (``target_sync``: under vLLM's
synchronous scheduler, as goodput control runs); the target with the draft,
where stock drafting (``mode: off``), cmr and streaming are switched between
runs, and ``goodput`` (cmr with ``speculation_control: goodput``); and, for
``cmr_k_by_batch``, cmr under vLLM's own K-by-batch-size schedule
(``benchmarks.runs.K_BY_BATCH_SIZE``). Each engine prefills every
passage once (untimed); the measured runs then hit the prefix cache, so they
are almost all decode. Per run: output tokens/s of the batch over its
decode-only steps (by the wall clock between decode steps; ``worker_tok_s``
over the worker's step calls alone), where a step's time goes
(``step_breakdown.py``), mean acceptance length, drafted tokens, draft / verify /
retrieval seconds per decode step, kept fraction.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.corpus import load_corpus
from benchmarks.machine import cpu_seconds, huge_page_share, machine_info, others_cpu
from benchmarks.prompts import summarization_prompt
from benchmarks.report import args_record, config_color, fmt, fmt_ratio, pyplot, save_figure
from benchmarks.round_spread import median_interval
from benchmarks.runs import engine_kwargs, started_engine
from benchmarks.step_breakdown import (
    breakdown_per_step,
    breakdown_table,
    install_step_breakdown,
    read_step_breakdown,
)
from benchmarks.worker_hooks import (
    control_counts,
    force_pause,
    install_timers,
    read_timers,
    reconfigure_drafter,
    run_deltas,
    spec_counters,
    worker_pid,
)

BATCH_CONFIGS = ("target", "target_sync", "ngram_no_match", "draft_model", "cmr", "streaming",
                 "goodput", "always_paused", "cmr_k_by_batch")
STOCK_ENGINES = ("target", "target_sync", "ngram_no_match")
"""One engine each, without SpecExtend."""
RETRIEVAL_CONFIGS = ("cmr", "streaming", "goodput", "always_paused", "cmr_k_by_batch")
SWITCHED_CONFIGS = ("draft_model", "cmr", "streaming", "goodput", "always_paused")
"""Run in one engine, its drafter reconfigured between runs."""
CONTROLLED_CONFIGS = ("goodput", "always_paused")
"""Under goodput control; ``always_paused`` forces every request to pause (the
floor goodput control stands on: this engine, no drafts, no draft forwards)."""
PASSAGE_STRIDE = 60_000
"""Characters between the starts of a batch's passages."""


@dataclass
class BatchMeasurement:
    config: str
    batch_size: int
    context_tokens: int
    output_tokens: int
    decode_steps: int
    decode_s: float
    output_tok_s: float
    mean_acceptance_length: float | None
    drafted_tokens: int
    draft_s_per_step: float | None
    verify_s_per_step: float | None
    retrieval_s_per_step: float | None
    kept_fraction: float | None
    same_as_target: bool | None = None
    control: dict | None = None
    """Goodput control's counts of the run (``goodput`` only)."""
    acceptance_per_position: list[float] | None = None
    """Share of drafts accepted up to each draft position."""
    round_tok_s: list[float] | None = None
    """Interleaved rounds (``--rounds``): output tok/s of every round; the
    measurement is the round of median speed."""
    paired_vs_target: float | None = None
    """Interleaved rounds: the median over rounds of this run's speed over the
    target alone's in the same round (the run beside it: drift cancels)."""
    paired_vs_target_interval: list[float] | None = None
    """Interleaved rounds: a 90% bootstrap interval of ``paired_vs_target``
    (``round_spread.py``): how far the rounds resolve it."""
    round_drafted_steps: list[int] | None = None
    """Interleaved rounds of ``goodput``: request-steps drafted in each round."""
    round_forced_draft_seconds: list[float] | None = None
    """Interleaved rounds of ``goodput``: what each round's forced drafts
    (warm-up, probes) were charged beyond their steps' predicted paused time."""
    round_forced_priced_seconds: list[float] | None = None
    """Interleaved rounds of ``goodput``: what the step-cost model priced those
    steps at, as they ran (not the warm-up's, which has its own price)."""
    worker_tok_s: float | None = None
    """Output tok/s over the worker's step calls alone (``execute_model`` and
    ``sample_tokens``): ``output_tok_s`` without the engine core's work and
    the inter-process round trips between steps."""
    breakdown: dict | None = None
    """Milliseconds per decode step of each part (``step_breakdown.py``)."""
    paired_vs_always_paused: float | None = None
    """Interleaved rounds of ``goodput`` beside ``always_paused`` (the same
    engine, no drafts): as ``paired_vs_target``, over that floor instead.
    Engine effects cancel: what is left is what the controller's decisions
    gained or cost."""
    host_cpu: dict | None = None
    """CPU the rest of the machine used during the call, in cores
    (``machine.others_cpu``: ``others``, ``kdamond`` among them, ``steal``)."""
    huge_pages: float | None = None
    """Share of the engine worker's anonymous memory on huge pages after the
    call (``machine.huge_page_share``)."""


def _measure(config, batch_size, length, outputs, c0, c1, t0, t1) -> BatchMeasurement:
    run = run_deltas(c0, c1, t0, t1)
    kept = None
    if run.context_tokens:
        kept = run.kept_tokens / run.context_tokens
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    # The first token of each request comes from the (cached) prefill step.
    decode_tokens = output_tokens - batch_size
    steps = run.steps
    per_step = (lambda seconds: seconds / steps) if steps else (lambda seconds: None)
    return BatchMeasurement(
        config=config,
        batch_size=batch_size,
        context_tokens=length,
        output_tokens=output_tokens,
        decode_steps=steps,
        decode_s=run.step_s,
        output_tok_s=decode_tokens / run.step_s if run.step_s else float("nan"),
        mean_acceptance_length=run.mean_acceptance_length,
        drafted_tokens=int(run.drafted_tokens),
        # With K=0 (cmr_k_by_batch) the draft still runs once per step.
        draft_s_per_step=per_step(run.draft_s) if run.draft_s else None,
        verify_s_per_step=per_step(run.step_s - run.draft_s) if run.draft_s else None,
        retrieval_s_per_step=(per_step(run.retrieval_s) if config in RETRIEVAL_CONFIGS
                              else None),
        kept_fraction=kept,
        acceptance_per_position=run.acceptance_per_position,
    )


def engine_spec_extend(args, engine_config: str, configs: list[str]) -> dict | None:
    """``spec_extend`` of the engine that runs ``configs``: none for the target
    alone, else cmr; with goodput control when ``CONTROLLED_CONFIGS`` are
    among them (vLLM's synchronous scheduler then serves every run of the
    engine)."""
    if engine_config in STOCK_ENGINES:
        return None
    base = json.loads(args.spec_extend) if args.spec_extend else {}
    spec_extend = {**base, "mode": "cmr"}
    if engine_config == "cmr" and set(CONTROLLED_CONFIGS) & set(configs):
        spec_extend["speculation_control"] = "goodput"
    return spec_extend


def engine_runs(args, engine_config: str, configs: list[str],
                prompts: dict[int, list[list[int]]], progress,
                spec_extend: dict | None = None) -> tuple[list, dict]:
    """All runs of one engine (``spec_extend``: its options; the ``cmr``
    engine switches its drafter between ``SWITCHED_CONFIGS``); returns
    measurements and output token ids."""
    with started_engine(**_engine_kwargs(args, engine_config, spec_extend)) as llm:
        llm.collective_rpc(install_timers)
        llm.collective_rpc(install_step_breakdown)
        measurements, token_ids = [], {}
        for length, passages in prompts.items():
            progress.set_postfix_str(f"{engine_config} engine: prefill {length}")
            _prefill(llm, passages)
            for batch_size in _batch_sizes(args, passages):
                for config in configs:
                    m, ids = _measured_run(args, llm, engine_config, config,
                                           passages[:batch_size], length)
                    measurements.append(m)
                    token_ids[(config, batch_size, length)] = ids
                    _report(progress, m)
    return measurements, token_ids


def interleaved_engine_runs(args, engines: list[tuple[str, list[str], dict | None, Any]],
                            prompts: dict[int, list[list[int]]], progress,
                            rounds: int) -> tuple[list, dict]:
    """The runs of several engines, all open at once (``engines``: engine
    configuration, its configurations, its ``spec_extend``, its args): at
    every point each configuration runs ``rounds`` times, the engines taking
    turns (in reverse order every other round, an engine's configurations
    too). A host whose speed drifts
    over minutes (a VM's neighbours) then slows every configuration alike,
    where engines run one after another would each see another speed. Per
    configuration and point, the run of median speed is reported, with the
    speed of every round (``round_tok_s``) and the median of its rounds'
    speeds over the target alone's (``paired_vs_target``).

    One engine at most may draft, and it opens last: a new ``LLM`` drops the
    earlier engines' Prometheus counters (``unregister_vllm_metrics``), which
    acceptance is read from."""
    drafting = [e for e in engines if e[0] not in ("target", "target_sync")]
    if len(drafting) > 1:
        raise SystemExit(
            f"--rounds: at most one drafting engine at a time (got {[e[0] for e in drafting]}): "
            "vLLM keeps one engine's spec-decode counters per process; pass fewer --configs")
    engines = [e for e in engines if e not in drafting] + drafting
    with contextlib.ExitStack() as stack:
        llms = []
        for engine_config, _, spec_extend, engine_args in engines:
            llm = stack.enter_context(
                started_engine(**_engine_kwargs(engine_args, engine_config, spec_extend)))
            llm.collective_rpc(install_timers)
            llm.collective_rpc(install_step_breakdown)
            llms.append(llm)
        measurements, token_ids = [], {}
        for length, passages in prompts.items():
            for (engine_config, *_), llm in zip(engines, llms):
                progress.set_postfix_str(f"{engine_config} engine: prefill {length}")
                _prefill(llm, passages)
            for batch_size in _batch_sizes(args, passages):
                runs: dict[str, list] = {}
                for round_index in range(rounds):
                    turns = list(zip(engines, llms))
                    for (engine_config, configs, _, engine_args), llm in (
                            turns if round_index % 2 == 0 else turns[::-1]):
                        for config in (configs if round_index % 2 == 0 else configs[::-1]):
                            m, ids = _measured_run(engine_args, llm, engine_config, config,
                                                   passages[:batch_size], length)
                            runs.setdefault(config, []).append((m, ids))
                            progress.set_postfix_str(
                                f"round {round_index + 1}/{rounds} {config} b={batch_size} "
                                f"{length}: {m.output_tok_s:.2f} tok/s")
                target_rounds = [run[0].output_tok_s for run in runs.get("target", [])]
                floor_rounds = [run[0].output_tok_s for run in runs.get("always_paused", [])]
                for config, config_runs in runs.items():
                    m, ids = sorted(config_runs, key=lambda run: run[0].output_tok_s)[
                        len(config_runs) // 2]
                    m.round_tok_s = [run[0].output_tok_s for run in config_runs]
                    if m.control is not None:
                        m.round_drafted_steps = [run[0].control["drafted_request_steps"]
                                                 for run in config_runs]
                        m.round_forced_draft_seconds = [
                            run[0].control["forced_draft_seconds"] for run in config_runs]
                        m.round_forced_priced_seconds = [
                            run[0].control["forced_priced_seconds"] for run in config_runs]
                    if target_rounds:
                        ratios = np.array(m.round_tok_s) / np.array(target_rounds)
                        m.paired_vs_target = float(np.median(ratios))
                        if config != "target":
                            m.paired_vs_target_interval = list(median_interval(ratios.tolist()))
                    if floor_rounds and config == "goodput":
                        m.paired_vs_always_paused = float(np.median(
                            np.array(m.round_tok_s) / np.array(floor_rounds)))
                    measurements.append(m)
                    token_ids[(config, batch_size, length)] = ids
                    progress.update(1)
    return measurements, token_ids


def all_engine_runs(args, engines: list[tuple[str, list[str], dict | None, Any]],
                    prompts: dict[int, list[list[int]]], progress) -> tuple[list, dict]:
    """The runs of ``engines`` (as :func:`interleaved_engine_runs` takes
    them): turn by turn with ``--rounds``, else one engine after another."""
    if args.rounds > 1:
        return interleaved_engine_runs(args, engines, prompts, progress, args.rounds)
    measurements, token_ids = [], {}
    for engine_config, configs, spec_extend, engine_args in engines:
        runs, ids = engine_runs(engine_args, engine_config, configs, prompts, progress,
                                spec_extend)
        measurements += runs
        token_ids.update(ids)
    return measurements, token_ids


def _engine_kwargs(args, engine_config: str, spec_extend: dict | None) -> dict[str, Any]:
    return engine_kwargs(args, engine_config, spec_extend) | {
        "enable_prefix_caching": True,
        "max_num_seqs": max(args.batch_sizes),
    }


def _prefill(llm, passages: list[list[int]]) -> None:
    """Every passage into the prefix cache (untimed)."""
    from vllm import SamplingParams, TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=p) for p in passages],
                 SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)


def _batch_sizes(args, passages: list[list[int]]) -> list[int]:
    """The batch sizes measured with these passages, largest first (points
    left out of the grid have fewer passages)."""
    return [b for b in sorted(args.batch_sizes, reverse=True) if b <= len(passages)]


def _measured_run(args, llm, engine_config: str, config: str, passages: list[list[int]],
                  length: int) -> tuple[BatchMeasurement, list[list[int]]]:
    """One ``LLM.generate`` call of the batch under ``config`` (the ``cmr``
    engine's drafter switched to it first): its measurement and output ids."""
    from vllm import SamplingParams, TokensPrompt

    if engine_config == "cmr":
        base = json.loads(args.spec_extend) if args.spec_extend else {}
        controlled = config in CONTROLLED_CONFIGS
        mode = "off" if config == "draft_model" else "cmr" if controlled else config
        llm.collective_rpc(reconfigure_drafter, args=(
            {**base, "mode": mode, "speculation_control": "goodput" if controlled else "off"},))
        if controlled:
            llm.collective_rpc(force_pause, args=(config == "always_paused",))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=p) for p in passages]
    control0 = llm.collective_rpc(control_counts)[0]
    c0, t0 = spec_counters(llm), llm.collective_rpc(read_timers)[0]
    b0 = llm.collective_rpc(read_step_breakdown)[0]
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    host_cpu = others_cpu(cpu0, cpu_seconds(), time.perf_counter() - wall0)
    c1, t1 = spec_counters(llm), llm.collective_rpc(read_timers)[0]
    b1 = llm.collective_rpc(read_step_breakdown)[0]
    m = _measure(config, len(passages), length, outputs, c0, c1, t0, t1)
    m.breakdown = breakdown_per_step(b0, b1)
    m.host_cpu = host_cpu
    m.huge_pages = huge_page_share(llm.collective_rpc(worker_pid)[0])
    if m.breakdown["period"] > 0:
        # By the wall clock between decode steps, as a user waits for them.
        m.worker_tok_s = m.output_tok_s
        m.output_tok_s *= m.decode_s / (m.decode_steps * m.breakdown["period"] / 1e3)
    if config == "goodput":
        # The controller keeps what it learnt across runs (as in a serving
        # engine); its counts are this run's.
        m.control = _count_deltas(llm.collective_rpc(control_counts)[0], control0)
    return m, [list(o.outputs[0].token_ids) for o in outputs]


def _report(progress, m: BatchMeasurement) -> None:
    progress.update(1)
    progress.set_postfix_str(
        f"{m.config} b={m.batch_size} {m.context_tokens}: {m.output_tok_s:.2f} tok/s")


def mark_same_as_target(measurements: list[BatchMeasurement], token_ids: dict) -> None:
    """``same_as_target`` of every run whose point the target alone measured
    (``token_ids``: output ids by (config, batch size, length))."""
    for m in measurements:
        reference = token_ids.get(("target", m.batch_size, m.context_tokens))
        if reference is not None:
            m.same_as_target = token_ids[(m.config, m.batch_size, m.context_tokens)] == reference


def run_batch(args) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    text = load_corpus(args.corpus)
    prompts = {
        length: [summarization_prompt(tokenizer, text, length,
                                      offset=args.offset + i * PASSAGE_STRIDE)
                 for i in range(max(args.batch_sizes))]
        for length in args.lengths
    }
    configs = [c for c in args.configs if c in BATCH_CONFIGS]
    engines = [(c, [c]) for c in STOCK_ENGINES if c in configs]
    switched = [c for c in configs if c in SWITCHED_CONFIGS]
    if switched:
        engines.append(("cmr", switched))
    if "cmr_k_by_batch" in configs:
        engines.append(("cmr_k_by_batch", ["cmr_k_by_batch"]))
    # One engine after another (no --rounds): in the order of --configs.
    engines.sort(key=lambda engine: min(configs.index(c) for c in engine[1]))
    total = len(configs) * len(args.lengths) * len(args.batch_sizes)
    opened = [(engine_config, engine_configs,
               engine_spec_extend(args, engine_config, engine_configs), args)
              for engine_config, engine_configs in engines]
    with tqdm(total=total, desc="batched benchmark", unit="run") as progress:
        measurements, token_ids = all_engine_runs(args, opened, prompts, progress)
    mark_same_as_target(measurements, token_ids)
    return {
        "machine": machine_info(),
        "args": args_record(args),
        "measurements": [asdict(m) for m in measurements],
        "_objects": measurements,
    }


def batch_table(measurements: list[BatchMeasurement]) -> str:
    lines = [
        "| config | batch | context | output tok/s | vs draft_model | vs target | "
        "mean acc. len | acc. vs draft_model | drafted / output tokens | draft s/step | "
        "verify s/step | retrieval s/step | kept % | paused % | forced ms/step | "
        "vs always paused | same as target | rounds tok/s | others' CPU % (kdamond) | "
        "huge pages % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
        "---:|---:|",
    ]
    by_key = {(m.config, m.batch_size, m.context_tokens): m for m in measurements}
    for m in sorted(measurements, key=lambda m: (m.context_tokens, m.batch_size)):
        stock = by_key.get(("draft_model", m.batch_size, m.context_tokens))
        target = by_key.get(("target", m.batch_size, m.context_tokens))
        acc = (m.mean_acceptance_length / stock.mean_acceptance_length
               if stock and m.mean_acceptance_length and stock.mean_acceptance_length else None)
        same = "-" if m.same_as_target is None else ("yes" if m.same_as_target else "NO")
        lines.append(
            f"| {m.config} | {m.batch_size} | {m.context_tokens} | {m.output_tok_s:.2f} | "
            f"{fmt_ratio(m.output_tok_s / stock.output_tok_s if stock else None)} | "
            f"{fmt_ratio(vs_target(m, target))}{interval_note(m)} | "
            f"{fmt(m.mean_acceptance_length)} | {fmt_ratio(acc)} | "
            f"{m.drafted_tokens} / {m.output_tokens} | "
            f"{fmt(m.draft_s_per_step, '.3f')} | {fmt(m.verify_s_per_step, '.3f')} | "
            f"{fmt(m.retrieval_s_per_step, '.4f')} | "
            f"{fmt(None if m.kept_fraction is None else 100 * m.kept_fraction, '.1f')} | "
            f"{fmt(paused_percent(m.control), '.0f')} | {fmt(forced_ms_per_step(m), '.1f')} | "
            f"{fmt(m.paired_vs_always_paused)}{'x' if m.paired_vs_always_paused else ''} | "
            f"{same} | {rounds_cell(m)} | {others_cell(m.host_cpu)} | "
            f"{fmt(None if m.huge_pages is None else 100 * m.huge_pages, '.0f')} |"
        )
    return "\n".join(lines)


GAUGES = ("warm_up_pending",)
"""Goodput control's figures a run reports as they stand at its end."""


def _count_deltas(after: dict, before: dict) -> dict:
    return {key: (value if key in GAUGES
                  else [a - b for a, b in zip(value, before[key])] if isinstance(value, list)
                  else value - before[key])
            for key, value in after.items()}


def interval_note(m: BatchMeasurement) -> str:
    """`` (low-high)``: the paired ratio's 90% interval over the rounds, or empty."""
    if m.paired_vs_target_interval is None:
        return ""
    low, high = m.paired_vs_target_interval
    return f" ({low:.2f}-{high:.2f})"


def vs_target(m: BatchMeasurement, target: BatchMeasurement | None) -> float | None:
    """Speed over the target alone's: paired round by round where the runs
    were interleaved, else the two measurements' ratio."""
    if m.paired_vs_target is not None:
        return m.paired_vs_target
    return m.output_tok_s / target.output_tok_s if target else None


def others_cell(host_cpu: dict | None) -> str:
    """The rest of the machine's CPU during the run, in % of one core, with
    DAMON's kdamond share in parentheses where it ran."""
    if not host_cpu:
        return "-"
    kdamond = f" ({100 * host_cpu['kdamond']:.0f})" if host_cpu["kdamond"] else ""
    return f"{100 * host_cpu['others']:.0f}{kdamond}"


def rounds_cell(m: BatchMeasurement) -> str:
    """Interleaved rounds' tok/s (``--rounds``), or empty."""
    return " / ".join(f"{x:.2f}" for x in m.round_tok_s) if m.round_tok_s else "-"


def forced_ms_per_step(m: BatchMeasurement) -> float | None:
    """Goodput control: what steps with only forced drafts (probes,
    explorations, a priced warm-up) took beyond their predicted paused step, in ms per decode
    step of the run (what the probe budget was charged)."""
    seconds = (m.control or {}).get("forced_draft_seconds")
    return None if seconds is None or not m.decode_steps else 1e3 * seconds / m.decode_steps


def paused_percent(control: dict | None) -> float | None:
    """Goodput control: request-steps without drafts, in % of all."""
    if not control:
        return None
    steps = control["drafted_request_steps"] + control["paused_request_steps"]
    return 100 * control["paused_request_steps"] / steps if steps else None


def plot_by_batch_size(points: list[dict], path: Path, title: str, ylabel: str,
                       linestyle: str = "-") -> None:
    """``value`` vs batch size, one panel per context length, one colour per
    configuration (``points``: dicts with config, batch_size, context_tokens, value)."""
    plt = pyplot()
    lengths = sorted({p["context_tokens"] for p in points})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4.2), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for config in dict.fromkeys(p["config"] for p in points):
            rows = sorted((p for p in points
                           if p["config"] == config and p["context_tokens"] == length),
                          key=lambda p: p["batch_size"])
            ax.plot([p["batch_size"] for p in rows], [p["value"] for p in rows], marker="o",
                    linestyle=linestyle, label=config, color=config_color(config))
        ax.set_title(f"{length} context tokens")
        ax.set_xlabel("batch size (requests)")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, path, title)


def write_batch(result: dict[str, Any], out_dir: Path, title: str) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    measurements = result.pop("_objects")
    table = batch_table(measurements)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    breakdowns = breakdown_table([
        (f"{m.config} {m.batch_size} x {m.context_tokens}", m.breakdown)
        for m in sorted(measurements, key=lambda m: (m.context_tokens, m.batch_size))
        if m.breakdown])
    (out_dir / "results.md").write_text(
        f"# {title}\n\nOne `LLM.generate` call per row: the first `batch` passages of the "
        "length, prefilled once per engine (prefix cache), decode-only timings; output tok/s "
        "by the wall clock between decode steps.\n\n"
        f"{table}\n\nWhere a decode step's time goes (ms per step, the reported run; "
        "`benchmarks/step_breakdown.py`; execute_model includes the target forward, drafter "
        "its control and retrieval plans):\n\n"
        f"{breakdowns}\n")
    plot_by_batch_size(
        [asdict(m) | {"value": m.output_tok_s} for m in measurements],
        out_dir / "results.png", title, "output tokens/s (batch, decode)",
    )
    return table
