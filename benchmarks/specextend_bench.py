"""SpecExtend against stock vLLM, side by side, on long real text.

One engine per configuration (target alone, stock draft_model, SpecExtend cmr,
SpecExtend streaming, optionally ngram); for each context length one greedy
summarization request at batch size 1. Reported per configuration and length:
prefill seconds, decode tokens/s, mean acceptance length (from the difference
of vLLM's spec_decode counters around the request), draft and verify seconds
per step, retrieval overhead, kept fraction of the context, and agreement of
the output with the target alone. Results: JSON, a markdown table, a PNG plot.

    python -m benchmarks [--lengths 1024 4096 8192] [--needle] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.corpus import CORPUS_DIR, read_text, text_files
from benchmarks.timers import install_timers, read_timers, spec_counters

# collective_rpc ships the timing hooks (benchmarks/timers.py) to the worker.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = CORPUS_DIR
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
SUMMARY_INSTRUCTION = "Summarize the following passage in a few sentences."

# The configurations of a run, by name: spec_extend options (None: no
# retrieval) and whether the draft model is used.
STOCK_CONFIGS = ("target", "draft_model", "draft_model_full", "ngram")
"""``draft_model_full``: stock drafting with the draft's own window, for
reference when ``--draft-window`` caps the other draft configurations."""


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


# ---- prompts -----------------------------------------------------------------


def load_corpus(paths: list[Path]) -> str:
    files = text_files(paths)
    if not files:
        raise SystemExit(f"no text files in {paths}")
    return "\n\n".join(read_text(f) for f in files)


def summarization_prompt(tokenizer, text: str, total_tokens: int, offset: int = 0) -> list[int]:
    """A chat prompt of exactly ``total_tokens`` tokens asking for a summary of
    a passage cut from ``text`` at ``offset`` characters."""

    def render(passage_ids: list[int]) -> list[int]:
        passage = tokenizer.decode(passage_ids)
        messages = [{"role": "user", "content": f"{SUMMARY_INSTRUCTION}\n\n{passage}"}]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer(messages[0]["content"] + "\n\nSummary:")["input_ids"]

    chars = text[offset : offset + 8 * total_tokens + 10_000]
    passage_ids = tokenizer(chars, add_special_tokens=False)["input_ids"]
    overhead = len(render(passage_ids[:16])) - 16
    ids = render(passage_ids[: max(total_tokens - overhead, 16)])
    # Decoding and re-encoding can shift a few tokens; trim to the exact size.
    while len(ids) > total_tokens:
        passage_ids = passage_ids[: len(passage_ids) - (len(ids) - total_tokens) - 1]
        ids = render(passage_ids[: max(total_tokens - overhead, 16)])
    return ids


# ---- one configuration -------------------------------------------------------


def engine_kwargs(args, config: str, spec_extend: dict | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=args.target,
        max_model_len=max(args.lengths) + args.max_tokens + 64,
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
    elif config != "target":
        kwargs["speculative_config"] = {"method": "draft_model", "model": args.draft,
                                        "num_speculative_tokens": args.k}
        if args.draft_window and config != "draft_model_full":
            kwargs["speculative_config"]["max_model_len"] = args.draft_window
        if args.heterogeneous_vocab:
            kwargs["speculative_config"]["use_heterogeneous_vocab"] = True
    if spec_extend is not None:
        kwargs["additional_config"] = {"spec_extend": spec_extend}
    return kwargs


def measure_config(args, config: str, spec_extend: dict | None,
                   prompts: dict[int, list[int]], progress) -> list[Measurement]:
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(**engine_kwargs(args, config, spec_extend))
    try:
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
            results.append(_measurement(config, length, output, before_counts, after_counts,
                                        before_timers, after_timers))
            progress.update(1)
            progress.set_postfix_str(f"{config} {length}: {results[-1].decode_tok_s:.2f} tok/s")
        return results
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def _measurement(config, length, output, c0, c1, t0, t1) -> Measurement:
    metrics = output.metrics
    generated = list(output.outputs[0].token_ids)
    prefill_s = metrics.first_token_ts - metrics.scheduled_ts
    decode_s = metrics.last_token_ts - metrics.first_token_ts
    decode_tokens = len(generated) - 1
    drafts = c1.get("vllm:spec_decode_num_drafts", 0) - c0.get("vllm:spec_decode_num_drafts", 0)
    accepted = (c1.get("vllm:spec_decode_num_accepted_tokens", 0)
                - c0.get("vllm:spec_decode_num_accepted_tokens", 0))
    steps = t1["steps"] - t0["steps"]
    step_s = t1["step"] - t0["step"]
    draft_s = t1["draft"] - t0["draft"]
    retrieval_s = t1["retrieval"] - t0["retrieval"]
    kept = None
    s0, s1 = t0["retrieval_stats"], t1["retrieval_stats"]
    if s1 is not None:
        context = s1["context_tokens"] - s0["context_tokens"]
        kept = (s1["kept_tokens"] - s0["kept_tokens"]) / context if context else 1.0
    has_draft = drafts > 0
    return Measurement(
        config=config,
        context_tokens=length,
        prefill_s=prefill_s,
        decode_tokens=decode_tokens,
        decode_s=decode_s,
        decode_tok_s=decode_tokens / decode_s if decode_s > 0 else float("nan"),
        mean_acceptance_length=1 + accepted / drafts if has_draft else None,
        draft_s_per_step=draft_s / steps if has_draft and steps else None,
        verify_s_per_step=(step_s - draft_s) / steps if has_draft and steps else None,
        retrieval_s_per_step=retrieval_s / steps if s1 is not None and steps else None,
        retrieval_overhead_pct=100 * retrieval_s / step_s if s1 is not None and step_s else None,
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


# ---- reports -----------------------------------------------------------------


def _fmt(value, spec=".2f"):
    return "-" if value is None else format(value, spec)


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
            f"{_fmt(speedup)}x | {_fmt(m.mean_acceptance_length)} | {_fmt(acceptance)}x | "
            f"{_fmt(m.draft_s_per_step, '.3f')} | {_fmt(m.verify_s_per_step, '.3f')} | "
            f"{_fmt(m.retrieval_overhead_pct, '.2f')} | "
            f"{_fmt(None if m.kept_fraction is None else 100 * m.kept_fraction, '.1f')} | "
            f"{agreement} |"
        )
    return "\n".join(lines)


CONFIG_COLORS = {"target": "tab:gray", "draft_model": "tab:blue", "cmr": "tab:red",
                 "streaming": "tab:green", "draft_model_full": "tab:purple",
                 "ngram": "tab:brown", "cmr_k_by_batch": "tab:orange"}


def config_color(config: str) -> str:
    """One colour per configuration, the same in every figure."""
    return CONFIG_COLORS.get(config, "tab:olive")


def plot(measurements: list[Measurement], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fast_dtype() -> str:
    """bfloat16 where its matmuls are fast, else float32.

    vLLM's CPU linear layers use oneDNN, which has no bf16 matmul on CPUs
    without AVX-512 (BF16) or AMX; there vLLM falls back to a torch bf16
    matmul about 7x slower than oneDNN float32 (measured on a 2-core AVX2 EPYC).
    """
    import torch

    if torch.cuda.is_available():
        return "bfloat16"
    from vllm import _custom_ops as ops

    try:
        ops.create_onednn_mm(torch.zeros(64, 64, dtype=torch.bfloat16), 32)
    except (AttributeError, RuntimeError):
        return "float32"
    return "bfloat16"


def machine_info() -> dict[str, Any]:
    import torch
    import vllm

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "vllm": vllm.__version__,
        "cuda": torch.cuda.is_available(),
    }


# ---- needle retrieval ----------------------------------------------------------

NEEDLE_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def needle_prompt(tokenizer, text: str, total_tokens: int, depth: float,
                  passkey: str) -> list[int]:
    """A chat prompt with a passkey hidden at ``depth`` of a real-text context."""
    needle = f" The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    question = ("There is a pass key hidden in the following text. Find it and "
                "memorize it.")
    ask = "What is the pass key? Answer with the number only."

    def render(filler_ids: list[int]) -> list[int]:
        cut = int(len(filler_ids) * depth)
        body = (tokenizer.decode(filler_ids[:cut]) + needle
                + tokenizer.decode(filler_ids[cut:]))
        messages = [{"role": "user", "content": f"{question}\n\n{body}\n\n{ask}"}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]

    filler = tokenizer(text[: 8 * total_tokens + 10_000], add_special_tokens=False)["input_ids"]
    overhead = len(render(filler[:64])) - 64
    return render(filler[: total_tokens - overhead])


def run_needle(args) -> dict[str, Any]:
    """Draft acceptance on the answer span with the full draft cache, streaming
    and cmr, next to the target's answer."""
    import random

    from tqdm import tqdm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    text = load_corpus(args.corpus)[args.offset:]
    rng = random.Random(0)
    cases = [(depth, str(rng.randrange(10_000, 99_999))) for depth in NEEDLE_DEPTHS]
    prompts = [needle_prompt(tokenizer, text, args.needle_length, d, key) for d, key in cases]
    base = json.loads(args.spec_extend) if args.spec_extend else {}
    configs = {"draft_model": None, "streaming": {**base, "mode": "streaming"},
               "cmr": {**base, "mode": "cmr"}}
    if args.draft_window:
        configs = {"draft_model_full": None, **configs}
    params = SamplingParams(temperature=0.0, max_tokens=args.needle_tokens)
    rows = []
    with tqdm(total=len(configs) * len(cases), desc="needle", unit="run") as progress:
        for name, spec_extend in configs.items():
            llm = LLM(**engine_kwargs(args, name, spec_extend)
                      | {"max_model_len": args.needle_length + args.needle_tokens + 64})
            try:
                for (depth, key), ids in zip(cases, prompts):
                    before = spec_counters(llm)
                    output = llm.generate([TokensPrompt(prompt_token_ids=ids)], params,
                                          use_tqdm=False)[0]
                    after = spec_counters(llm)
                    drafted = (after["vllm:spec_decode_num_draft_tokens"]
                               - before["vllm:spec_decode_num_draft_tokens"])
                    accepted = (after["vllm:spec_decode_num_accepted_tokens"]
                                - before["vllm:spec_decode_num_accepted_tokens"])
                    answer = output.outputs[0].text
                    rows.append({"config": name, "depth": depth, "passkey": key,
                                 "answer": answer, "target_correct": key in answer,
                                 "draft_acceptance": accepted / drafted if drafted else None})
                    progress.update(1)
            finally:
                llm.llm_engine.engine_core.shutdown()
                del llm
    return {"machine": machine_info(), "context_tokens": args.needle_length, "rows": rows}


def needle_table(rows: list[dict[str, Any]]) -> str:
    configs = list(dict.fromkeys(r["config"] for r in rows))
    depths = sorted({r["depth"] for r in rows})
    lines = ["| config | " + " | ".join(f"depth {d:.0%}" for d in depths)
             + " | mean draft acceptance | target correct |",
             "|---|" + "---:|" * (len(depths) + 2)]
    for config in configs:
        mine = [r for r in rows if r["config"] == config]
        by_depth = {r["depth"]: r for r in mine}
        acceptance = [r["draft_acceptance"] or 0.0 for r in mine]
        lines.append(
            f"| {config} | "
            + " | ".join(f"{100 * (by_depth[d]['draft_acceptance'] or 0):.0f}%" for d in depths)
            + f" | {100 * sum(acceptance) / len(acceptance):.1f}% | "
            f"{sum(r['target_correct'] for r in mine)}/{len(mine)} |"
        )
    return "\n".join(lines)


def write_needle(result: dict[str, Any], out_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    table = needle_table(rows)
    (out_dir / "needle.json").write_text(json.dumps(result, indent=2))
    (out_dir / "needle.md").write_text(
        f"# Needle retrieval, {result['context_tokens']} tokens: draft acceptance on the "
        f"answer span\n\n{table}\n")
    fig, ax = plt.subplots(figsize=(7, 4))
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = sorted((r for r in rows if r["config"] == config), key=lambda r: r["depth"])
        ax.plot([r["depth"] for r in mine], [r["draft_acceptance"] or 0 for r in mine],
                marker="o", label=config, color=config_color(config))
    ax.set_xlabel("needle depth")
    ax.set_ylabel("draft acceptance on the answer")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "needle.png", dpi=120)
    plt.close(fig)
    return table


# ---- tuning sweep ------------------------------------------------------------

# Keeps every chunk: drafting identical to stock draft_model (tested), in the same engine.
FULL_CACHE_POINT = {"top_k_chunks": 100_000, "min_context_tokens": 0}
# The stock reference, then one option changed at a time from the defaults,
# then combinations that trade recent window for retrieved chunks at the same budget.
SWEEP_POINTS: tuple[dict[str, Any], ...] = (
    FULL_CACHE_POINT,
    {},
    {"top_k_chunks": 2}, {"top_k_chunks": 4}, {"top_k_chunks": 16},
    {"chunk_size": 256, "top_k_chunks": 4},
    {"recent_tokens": 128}, {"recent_tokens": 512},
    {"retrieval_interval": 1}, {"retrieval_interval": 8},
    {"score_aggregation": "accepted_tokens"},
    {"mode": "streaming"},
    {"top_k_chunks": 5, "recent_tokens": 128},
    {"top_k_chunks": 5, "recent_tokens": 128, "score_aggregation": "accepted_tokens"},
    {"top_k_chunks": 4, "score_aggregation": "accepted_tokens", "retrieval_interval": 2},
)


def _reconfigure(worker, options: dict) -> None:
    from vllm_specextend.config import SpecExtendConfig

    worker.model_runner.drafter.reconfigure(SpecExtendConfig.from_dict(options))


def run_sweep(args) -> dict[str, Any]:
    """One cmr engine with prefix caching: each prompt is prefilled once, then
    every option point re-decodes it, so a point costs only its decode."""
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    text = load_corpus(args.corpus)
    prompts = {n: summarization_prompt(tokenizer, text, n, offset=args.offset)
               for n in args.lengths}
    base = json.loads(args.spec_extend) if args.spec_extend else {}
    points = json.loads(args.sweep_points) if args.sweep_points else SWEEP_POINTS
    llm = LLM(**engine_kwargs(args, "cmr", {**base, "mode": "cmr"})
              | {"enable_prefix_caching": True})
    measurements: list[Measurement] = []
    try:
        llm.collective_rpc(install_timers)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for ids in prompts.values():  # prefill once; later runs hit the cache
            llm.generate([TokensPrompt(prompt_token_ids=ids)],
                         SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        with tqdm(total=len(points) * len(prompts), desc="sweep", unit="run") as bar:
            for point in points:
                options = {**base, "mode": "cmr", **point}
                label = ("draft_model" if point == FULL_CACHE_POINT
                         else ", ".join(f"{k}={v}" for k, v in point.items()) or "defaults")
                llm.collective_rpc(_reconfigure, args=(options,))
                for length, ids in prompts.items():
                    c0, t0 = spec_counters(llm), llm.collective_rpc(read_timers)[0]
                    output = llm.generate([TokensPrompt(prompt_token_ids=ids)], params,
                                          use_tqdm=False)[0]
                    c1, t1 = spec_counters(llm), llm.collective_rpc(read_timers)[0]
                    measurements.append(_measurement(label, length, output, c0, c1, t0, t1))
                    bar.update(1)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return {
        "machine": machine_info(),
        "base_options": base,
        "points": list(points),
        "measurements": [asdict(m) for m in measurements],
        "_objects": measurements,
    }


# ---- main --------------------------------------------------------------------


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
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k != "corpus"} | {"corpus": [str(p) for p in args.corpus]},
        "configs": configs,
        "measurements": [asdict(m) for m in measurements],
        "_objects": measurements,
    }


def write_results(result: dict[str, Any], out_dir: Path, title: str) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    measurements = result.pop("_objects")
    table = markdown_table(measurements)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    (out_dir / "results.md").write_text(f"# {title}\n\n{table}\n")
    plot(measurements, out_dir / "results.png", title)
    return table


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="local path, hub id, or a short name from benchmarks.real_models")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--heterogeneous-vocab", action="store_true",
                        help="draft with its own tokenizer (use_heterogeneous_vocab)")
    parser.add_argument("--corpus", type=Path, nargs="+", default=[DEFAULT_CORPUS])
    parser.add_argument("--offset", type=int, default=100_000,
                        help="character offset of the passages in the corpus")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--draft-window", type=int, default=None,
                        help="cap the draft's window (speculative_config max_model_len) in "
                             "every draft configuration but draft_model_full")
    parser.add_argument("--configs", nargs="+",
                        default=["target", "draft_model", "cmr", "streaming"])
    parser.add_argument("--spec-extend", default=None,
                        help="JSON spec_extend options for cmr/streaming (defaults otherwise)")
    parser.add_argument("--dtype", default="auto",
                        help="model dtype; auto: bfloat16 where this CPU has fast bf16 "
                             "matmuls (AVX-512 BF16/AMX, or a GPU), else float32")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--kv-cache-gib", type=int, default=3)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                        help="enforce_eager (torch.compile start-up is slow on 2 cores)")
    parser.add_argument("--sweep", action="store_true",
                        help="run the option sweep (defaults: 4K and 8K) instead")
    parser.add_argument("--sweep-points", default=None,
                        help="JSON list of option dicts to sweep instead of the built-in "
                             "points, each applied on top of --spec-extend")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="batched mode: N passages per LLM.generate call for each N "
                             "(benchmarks/batch.py), e.g. --batch-sizes 1 4 8")
    parser.add_argument("--serve", action="store_true",
                        help="served mode: vllm serve per configuration, measured with "
                             "vllm bench serve (benchmarks/serve.py)")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="served mode: prompts and --max-concurrency")
    parser.add_argument("--needle", action="store_true",
                        help="run the needle-retrieval benchmark instead")
    parser.add_argument("--needle-length", type=int, default=4096)
    parser.add_argument("--needle-tokens", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default=None,
                        help="results folder under benchmarks/results "
                             "(default: main, sweep, needle, batch or serve)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from benchmarks.real_models import resolve_model

    args.target = resolve_model(args.target)
    args.draft = resolve_model(args.draft)
    if args.dtype == "auto":
        args.dtype = fast_dtype()
    # Slow CPUs can spend minutes on one long prefill step; vLLM's default
    # step timeout (300 s) would kill the engine.
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
    name = args.name or ("sweep" if args.sweep else "needle" if args.needle
                         else "batch" if args.batch_sizes else "serve" if args.serve
                         else "main")
    out_dir = args.out or RESULTS_DIR / name
    machine = machine_info()
    window = f" (window {args.draft_window})" if args.draft_window else ""
    title = (f"{Path(args.target).name} / draft {Path(args.draft).name}{window}, {args.dtype}, "
             f"K={args.k}, {args.max_tokens} greedy tokens, {machine['cpu_count']} CPU cores "
             f"({machine['cpu_capability']})")
    if args.sweep:
        if args.lengths == parse_args([]).lengths:
            args.lengths = [4096, 8192]
        result = run_sweep(args)
        objects = result.pop("_objects")
        out_dir.mkdir(parents=True, exist_ok=True)
        table = markdown_table(objects)
        (out_dir / "sweep.json").write_text(json.dumps(result, indent=2))
        (out_dir / "sweep.md").write_text(
            f"# Option sweep (cmr)\n\n{title}; one engine with prefix caching "
            "(each prompt prefilled once), options swapped between runs. Each row applies "
            f"its options on top of the package defaults (and `--spec-extend` "
            f"{json.dumps(result['base_options'])}); the `draft_model` row is cmr keeping "
            "every chunk, whose drafting is identical to stock draft_model (tested).\n\n"
            f"{table}\n")
        print(table)
        return
    if args.serve:
        from benchmarks.serve import run_serve, write_serve

        args.out = out_dir
        print(write_serve(run_serve(args), out_dir, title))
        print(f"\nresults: {out_dir}/results.{{json,md,png}}")
        return
    if args.batch_sizes:
        from benchmarks.batch import run_batch, write_batch

        print(write_batch(run_batch(args), out_dir, title))
        print(f"\nresults: {out_dir}/results.{{json,md,png}}")
        return
    if args.needle:
        print(write_needle(run_needle(args), out_dir))
        print(f"\nresults: {out_dir}/needle.{{json,md,png}}")
        return
    table = write_results(run_benchmark(args), out_dir, title)
    print(table)
    print(f"\nresults: {out_dir}/results.{{json,md,png}}")


if __name__ == "__main__":
    main()
